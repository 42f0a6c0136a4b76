"""What the reproducible mode costs (issue 42; ``rl.reproducible``, ``bidirl.core.schedule``): real tiny CPU runs
with the mode on and off at s = 0, 0.5, 1 and 2.

Each call runs, per staleness, the shared tiny job (``tiny-cpu`` at 32 prompts × 8 responses, prompts up to 48
tokens: generation outlasts a hot switch, so both directions borrow) for ``STEPS`` steps under ``bidirl`` with the
mode off and on, back to back (the order alternating between rounds, so a drift in the shared machine's load does
not favour one side), on one embedded Ray whose engine workers are kept between the runs of one shape
(``KeptWorkers``: the staleness changes the rollouters' KV budget, hence the shape). Figures (``bidirl bench
--only reproducible``):

* ``tokens_per_s_s{S}_{off,on}`` — the run's §7.1 throughput (tokens of the measured steps over their time,
  ``metrics.summary``), the median of the rounds;
* ``on_over_off_s{S}`` — the median of each round's ratio on / off (runs seconds apart share the machine's load),
  and ``on_over_off_s{S}_min`` / ``_max`` — the rounds' smallest and largest ratio (how far one round's noise goes);
* ``trainer_wait_s{S}`` / ``sync_wait_s{S}`` — in the on run, the seconds the trainer waited for the rule's batch
  while the default rule had one, and a sync waited for groups in flight that partial rollout would have cut
  (``summary["reproducibility"]``): where the price is paid;
* ``reproducible_s{S}`` — 1 when the on run says it was reproducible (nothing made it depend on timing).
"""

from __future__ import annotations

import statistics

STALENESS = (0.0, 0.5, 1.0, 2.0)
STEPS = 6                  # s = 2 drops 2 steps at each end of the §7.1 window: 6 leaves 2 measured steps
ROUNDS, QUICK_ROUNDS = 3, 1
SHARED = {"workload.prompts_per_step": 32, "workload.group_size": 8, "workload.max_prompt_len": 48}


def _rate(summary: dict) -> float:
    """§7.1 throughput (``STEPS`` leaves measured steps at every staleness benchmarked)."""
    if summary.get("throughput") is None:
        raise RuntimeError(f"no §7.1 throughput: {summary.get('throughput_note')}")
    return float(summary["throughput"])


def bench_reproducible(quick: bool) -> dict:
    from bidirl.cluster.kept_workers import KeptWorkers
    from bidirl.cluster.run import run
    from bidirl.job import config as cfgmod

    steps, rounds = STEPS, (QUICK_ROUNDS if quick else ROUNDS)
    base = cfgmod.load("tiny-cpu").with_overrides(SHARED)
    rates = {(s, mode): [] for s in STALENESS for mode in ("off", "on")}
    ratios = {s: [] for s in STALENESS}
    waits = {s: {"trainer": [], "sync": [], "ok": []} for s in STALENESS}
    with KeptWorkers() as kept:
        for r in range(rounds):
            for s in STALENESS:
                got = {}
                for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                    cfg = base.with_overrides({"rl.staleness": s, "rl.reproducible": mode == "on"})
                    summary = run(cfg, "bidirl", steps=steps, seed=cfg.seed, kept_workers=kept).summary()
                    got[mode] = _rate(summary)
                    rates[(s, mode)].append(got[mode])
                    if mode == "on":
                        rep = summary["reproducibility"]
                        waits[s]["trainer"].append(rep["trainer_wait_s"])
                        waits[s]["sync"].append(rep["sync_wait_s"])
                        waits[s]["ok"].append(1.0 if rep["reproducible"] else 0.0)
                ratios[s].append(got["on"] / got["off"])
    out = {}
    for s in STALENESS:
        tag = f"s{s:g}"
        for mode in ("off", "on"):
            out[f"tokens_per_s_{tag}_{mode}"] = (statistics.median(rates[(s, mode)]), "tokens/s")
        out[f"on_over_off_{tag}"] = (statistics.median(ratios[s]), "ratio")
        out[f"on_over_off_{tag}_min"] = (min(ratios[s]), "ratio")
        out[f"on_over_off_{tag}_max"] = (max(ratios[s]), "ratio")
        out[f"trainer_wait_{tag}"] = (statistics.median(waits[s]["trainer"]), "s")
        out[f"sync_wait_{tag}"] = (statistics.median(waits[s]["sync"]), "s")
        out[f"reproducible_{tag}"] = (min(waits[s]["ok"]), "bool")
    return out


BENCHMARKS = {"reproducible": bench_reproducible}
