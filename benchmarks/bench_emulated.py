"""The Ray control path with emulated workers against the simulator, at 16 and at 256 virtual GPUs.

* ``emulated_16gpu_default``: ``a6000-default`` (16 virtual A6000 GPUs, 8-8, batch 64 × 8, 2K, s = 1) under
  ``bidirl`` on embedded local Ray with model-timed workers, and the simulator on the same config, seed and
  policy;
* ``emulated_256gpu``: the same job scaled to 256 virtual GPUs (128-128, batch 1,024 × 8): 256 rollout replicas
  on 16 :class:`~bidirl.cluster.emulated_workers.RolloutHost` processes, two trainer gangs.

Each reports the emulated (virtual-time) throughput, the simulated one and their ratio, the wall time of the
emulated run, and where the driver's wall time goes per event fed to the coordinator: handling replies (driver
and coordinator, ``handle_ms_per_event``), Ray calls per event, and the median round trip of a no-op actor call
on the same Ray (``ray_round_trip_ms``). At ``time_scale`` 20 every wall millisecond the control path adds to
the critical path costs 20 virtual milliseconds, so the ratio falls when the machine is loaded: read it with the
one-minute load average reported beside it. It is not a measurement of a GPU job.

Stated margin: the emulated throughput is expected within ±5 % of the simulated one on an idle machine
(``within_margin`` is 1 when it is).
"""

from __future__ import annotations

import os
import statistics
import time

from bidirl.job import config as cfgmod

MARGIN = 0.05


class _Echo:
    def ping(self) -> int:
        return 0


def _round_trip_ms(ray, calls: int = 200) -> float:
    """Median wall milliseconds of one no-op actor call and its reply."""
    actor = ray.remote(_Echo).options(num_cpus=0.01).remote()
    ray.get(actor.ping.remote())
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        ray.get(actor.ping.remote())
        times.append(time.perf_counter() - t0)
    ray.kill(actor)
    return 1e3 * statistics.median(times)


def _emulated_vs_simulated(cfg, steps: int, time_scale: float = 20.0) -> dict:
    import ray

    from bidirl.cluster.emulated import EmulatedDriver
    from bidirl.sim import simulate
    t0 = time.perf_counter()
    driver = EmulatedDriver(cfg, "bidirl", steps, cfg.seed, time_scale=time_scale)
    try:
        emulated = driver.run().summary()
        round_trip = _round_trip_ms(ray)
    finally:
        ray.shutdown()
    wall = time.perf_counter() - t0
    load = os.getloadavg()[0]
    simulated = simulate(cfg, "bidirl", steps=steps).summary()
    stats = driver.loop_stats
    events = max(1, stats["events"])
    ratio = emulated["throughput"] / simulated["throughput"]
    return {"emulated.throughput": (emulated["throughput"], "tokens/s (virtual time)"),
            "simulated.throughput": (simulated["throughput"], "tokens/s (model)"),
            "ratio_emulated_over_simulated": (ratio, "x"),
            "within_margin": (float(abs(ratio - 1) <= MARGIN), "bool"),
            "emulated.wall_seconds": (wall, "s"),
            "rollout_processes": (len(driver.backend.hosts), "processes"),
            "events": (stats["events"], "events"),
            "handle_ms_per_event": (1e3 * stats["handle_s"] / events, "ms wall"),
            "ray_calls_per_event": (stats["calls"] / events, "calls"),
            "ray_round_trip_ms": (round_trip, "ms wall"),
            "load_average_1min": (load, "runnable processes")}


def bench_emulated_16(quick: bool) -> dict:
    return _emulated_vs_simulated(cfgmod.load("a6000-default"), 5 if quick else 10)


def bench_emulated_256(quick: bool) -> dict:
    cfg = cfgmod.load("a6000-default").with_overrides({
        "cluster.gpus": 256, "cluster.partition": [128, 128], "workload.prompts_per_step": 1024})
    return _emulated_vs_simulated(cfg, 4 if quick else 6)


BENCHMARKS = {"emulated_16gpu_default": bench_emulated_16, "emulated_256gpu": bench_emulated_256}
