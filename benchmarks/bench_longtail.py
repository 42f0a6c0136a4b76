"""A CPU job where borrowing pays, measured: ``bidirl`` against ``no-borrow`` on real engines, side by side.

Runs ``tiny-cpu-longtail`` (the built-in tiny model with forced long-tailed response lengths, one logical GPU
slot per core, on-policy) under ``no-borrow`` and then ``bidirl`` on an embedded local Ray with vLLM rollouters
and torch trainers, with the same seed and steps, and reports (paper §7.1, §5.2):

* each policy's throughput over §7.1's measured window and the ratio bidirl / no-borrow (measured), and the same
  ratio from the medians of per-step throughputs (``median_step_ratio``; robust to one step slowed by other work
  on a shared machine);
* the windows the gate admitted and evaluated in each direction during the bidirl run;
* the switch costs that run measured (medians): C_in / C_out of Rollouter-on-TrainerPool and C_in / C_out /
  C_grad of Trainer-on-RolloutPool;
* the simulator's ratio for the same config (``simulated_ratio``: a model prediction, not a measurement), each
  policy's median step time measured and simulated (how far the stage-time models are from this runtime), and
  the machine's one-minute load average when the runs ended (other work on the machine takes the cores that
  borrowing would use; read the ratio with it).

``bidirl bench --only longtail`` calls it ``--repeats`` times (default 5) and reports medians.
"""

from __future__ import annotations

import os

import numpy as np

from bidirl.job import config as cfgmod

CONFIG = "tiny-cpu-longtail"
POLICIES = ("no-borrow", "bidirl")


def bench_longtail(quick: bool) -> dict:
    import ray

    from bidirl.experiments import side_by_side as sbs

    steps = 5 if quick else 8
    cfg = cfgmod.load(CONFIG)
    try:
        measured = sbs.run_policies(cfg, POLICIES, steps)
    finally:
        ray.shutdown()      # the embedded Ray has this job's slots; the next benchmark starts its own
    load = os.getloadavg()[0]
    simulated = sbs.run_policies(cfg, POLICIES, steps, simulate=True)

    ratio = sbs.throughput_ratio(measured)
    out = {f"{policy}.throughput": (res.summary()["throughput"], "tokens/s") for policy, res in measured.items()}
    out["ratio_bidirl_over_no-borrow"] = (ratio.window, "x")
    out["median_step_ratio_bidirl_over_no-borrow"] = (ratio.median_step, "x")
    for direction, counts in sbs.window_counts(measured["bidirl"]).items():
        out[f"{direction}.windows_admitted"] = (counts["admitted"], "windows")
        out[f"{direction}.windows_evaluated"] = (counts["evaluated"], "windows")
    for name, seconds in sbs.measured_costs(measured["bidirl"]).items():
        out[name] = (seconds, "s")
    sync = measured["bidirl"].summary()["weight_sync"]
    if sync is not None:
        out["weight_sync"] = (sync, "s")
    out["simulated_ratio_bidirl_over_no-borrow"] = (sbs.throughput_ratio(simulated).window, "x (simulated)")
    for policy in POLICIES:     # how far the stage-time models' step times are from the measured ones
        out[f"{policy}.median_step_time"] = (float(np.median(sbs.measured_steps(measured[policy])[1])), "s")
        out[f"{policy}.simulated_median_step_time"] = (float(np.median(sbs.measured_steps(simulated[policy])[1])),
                                                       "s (simulated)")
    out["load_average_1min"] = (load, "runnable processes")
    return out


BENCHMARKS = {"longtail_cpu": bench_longtail}
