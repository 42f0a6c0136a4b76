"""Decision regret of the admission gates over the BiDiRL runs ``bidirl reproduce`` simulates
(``bidirl.experiments.gate_regret``): each decision flipped in turn, the run simulated again with the same seed.

* ``gate_regret``: per direction (``rot``: Rollouter-on-TrainerPool, ``tor``: Trainer-on-RolloutPool) the decisions,
  the wrong ones (a flip raises the run's total-run throughput), the wrong refusals, their summed log gain and the
  largest flip ratio; the median / p90 |error| and mean signed error (s) of the predicted wait with the window
  (``rot``: C_in + T_joint + C_out to the batch; ``tor``: T_borrow to the workload's optimizer step) and without it
  (T_no) against what the run or its flip realized. ``--quick``: the ablation panels' quick points only.

Simulated, not measured (it measures the gates against the simulator); counts and seconds, not wall time.
"""

from __future__ import annotations

from bidirl.core import protocol as P

SHORT = {P.ROLLOUT_ON_TRAINER_POOL: "rot", P.TRAINER_ON_ROLLOUT_POOL: "tor"}


def bench_gate_regret(quick: bool) -> dict:
    from bidirl.experiments import gate_regret
    summary = gate_regret.summarize(gate_regret.regret_frame(gate_regret.reproduce_points(quick)))
    out = {}
    for direction, entry in summary.items():
        for key, value in entry.items():
            unit = "s" if key.endswith("_s") else ("ratio" if key == "regret_max" else
                                                   ("log" if key == "regret_log_sum" else "count"))
            out[f"{SHORT[direction]}_{key}"] = (value, unit)
    return out


BENCHMARKS = {"gate_regret": bench_gate_regret}
