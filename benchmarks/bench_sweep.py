"""PartitionSweep's "simulate all candidates" (``bidirl.sim.sweep.simulate_partitions``): the paper's default job
(§7.1) on 32 GPUs with placement ``any``, every hot-switch compatible split simulated for 20 steps (10 with
``--quick``) under ``no-borrow``, as the widget runs it — in this process, and on two forked workers.

Figures: seconds for all splits (serial and two workers), CPU seconds of the serial run, splits simulated.
"""

from __future__ import annotations

import time

from bidirl.job import config as cfgmod


def bench_sweep(quick: bool) -> dict:
    from bidirl.sim.sweep import simulate_partitions
    cfg = cfgmod.load("a6000-default").with_overrides({"cluster.gpus": 32, "cluster.placement": "any",
                                                         "cluster.partition": None})
    steps = 10 if quick else 20
    out = {}
    for workers in (1, 2):
        t0, c0 = time.perf_counter(), time.process_time()
        frame = simulate_partitions(cfg, steps=steps, workers=workers)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        tag = "serial" if workers == 1 else "workers2"
        out[f"{tag}.seconds_all"] = (wall, "s")
        if workers == 1:
            out["serial.cpu_seconds"] = (cpu, "s")
    out["splits"] = (int((frame["status"] == "ok").sum()), "splits")
    out["steps_each"] = (steps, "steps")
    return out


BENCHMARKS = {"sweep_simulate_all": bench_sweep}
