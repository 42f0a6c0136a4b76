"""The Ray control path with emulated workers against the simulator, on the paper's default setting.

Runs ``a6000-default`` (16 virtual A6000 GPUs, 8-8, batch 64 × 8, 2K, s = 1) under ``bidirl`` on embedded local
Ray with model-timed workers, and the simulator on the same config, seed and policy. Reports the measured
(virtual-time) throughput, the simulated one, their ratio, and the wall time of the emulated run. The ratio
shows what the real control path (Ray scheduling, ``ray.wait`` loop, actor calls) costs or changes relative to
the model; it is not a measurement of a GPU job.
"""

from __future__ import annotations

import time

from bidirl import config as cfgmod


def bench_emulated_vs_simulated(quick: bool) -> dict:
    import ray

    from bidirl.cluster.driver import RayDriver
    from bidirl.sim import simulate
    steps = 5 if quick else 10
    cfg = cfgmod.load("a6000-default")
    t0 = time.perf_counter()
    try:
        emulated = RayDriver(cfg, "bidirl", steps, cfg.seed, emulate=True, time_scale=20.0).run().summary()
    finally:
        ray.shutdown()
    wall = time.perf_counter() - t0
    simulated = simulate(cfg, "bidirl", steps=steps).summary()
    return {"emulated.throughput": (emulated["throughput"], "tokens/s (virtual time)"),
            "simulated.throughput": (simulated["throughput"], "tokens/s (model)"),
            "ratio_emulated_over_simulated": (emulated["throughput"] / simulated["throughput"], "x"),
            "emulated.wall_seconds": (wall, "s")}


BENCHMARKS = {"emulated_16gpu_default": bench_emulated_vs_simulated}
