"""Simulator speed on the paper's scale-up setting (§7.2 "Resource", batch 128, 32 A6000 GPUs, 16-16 split).

Figures: seconds (wall and CPU) per 60-step run, events per second and events per simulated step for ``bidirl``
and ``no-borrow``, and the simulated throughput ratio bidirl / no-borrow from the same runs (a model result, not a measurement of a real job).
"""

from __future__ import annotations

import time

from bidirl.job import config as cfgmod


def _config():
    return cfgmod.load("a6000-default").with_overrides({
        "cluster.gpus": 32, "cluster.partition": [16, 16], "workload.prompts_per_step": 128})


def bench_simulate(quick: bool) -> dict:
    from bidirl.sim import simulate
    steps = 12 if quick else 60
    out, tput = {}, {}
    for policy in ("no-borrow", "bidirl"):
        t0, c0 = time.perf_counter(), time.process_time()
        res = simulate(_config(), policy, steps=steps)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        out[f"{policy}.seconds_per_run"] = (wall, "s")
        out[f"{policy}.cpu_seconds_per_run"] = (cpu, "s")
        out[f"{policy}.events_per_second"] = (res.events_processed / wall, "events/s")
        out[f"{policy}.events_per_step"] = (res.events_processed / steps, "events")
        tput[policy] = res.summary()["throughput"]
    out["throughput_ratio_bidirl_over_no_borrow"] = (tput["bidirl"] / tput["no-borrow"], "x")
    out["steps"] = (steps, "steps")
    return out


BENCHMARKS = {"simulate_32gpu_batch128": bench_simulate}
