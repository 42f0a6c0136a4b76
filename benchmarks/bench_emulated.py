"""The Ray control path with emulated workers against the simulator, on the paper's default setting.

Runs ``a6000-default`` (16 virtual A6000 GPUs, 8-8, batch 64 × 8, 2K, s = 1) under ``bidirl`` on embedded local
Ray with model-timed workers, and the simulator on the same config, seed and policy. Reports the measured
(virtual-time) throughput, the simulated one, their ratio, and the wall time of the emulated run. The ratio
shows what the real control path (Ray scheduling, ``ray.wait`` loop, actor calls) costs or changes relative to
the model; it is not a measurement of a GPU job.

Stated margin: the emulated throughput is expected within ±15 % of the simulated one (``within_margin`` is 1
when it is). Measured on a 2-core machine, 5 steps, 3 repeats: ratio 0.956 (0.948-0.958); the shortfall is the
control path's wall time multiplied by ``time_scale``.
"""

from __future__ import annotations

import time

from bidirl import config as cfgmod

MARGIN = 0.15


def bench_emulated_vs_simulated(quick: bool) -> dict:
    import ray

    from bidirl.cluster.emulated import EmulatedDriver
    from bidirl.sim import simulate
    steps = 5 if quick else 10
    cfg = cfgmod.load("a6000-default")
    t0 = time.perf_counter()
    try:
        emulated = EmulatedDriver(cfg, "bidirl", steps, cfg.seed, time_scale=20.0).run().summary()
    finally:
        ray.shutdown()
    wall = time.perf_counter() - t0
    simulated = simulate(cfg, "bidirl", steps=steps).summary()
    return {"emulated.throughput": (emulated["throughput"], "tokens/s (virtual time)"),
            "simulated.throughput": (simulated["throughput"], "tokens/s (model)"),
            "ratio_emulated_over_simulated": (emulated["throughput"] / simulated["throughput"], "x"),
            "within_margin": (float(abs(emulated["throughput"] / simulated["throughput"] - 1) <= MARGIN), "bool"),
            "emulated.wall_seconds": (wall, "s")}


BENCHMARKS = {"emulated_16gpu_default": bench_emulated_vs_simulated}
