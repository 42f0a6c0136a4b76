"""A real tiny mixture-of-experts run (issue 41): ``tiny-moe-cpu`` on engine workers — vLLM's CPU build generating and
recording routes, FSDP2-free torch trainers replaying them — with borrowing in both directions.

Tolerance: the on-policy samples' log-prob gap between vLLM and the trainer with R3 is bounded by
``tests/rounding.run_logprob_tolerance`` over the run's weights (the rounding of two fp32 computations of a log-prob,
with the MoE layer's reductions), as the dense runs' are."""

from __future__ import annotations

import importlib.util

import pytest

import rounding

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="engine runs need vllm (pip install -e .[cpu])")]


def test_tiny_moe_cpu_runs_with_borrowing_both_ways_and_the_routes_replayed_in_every_chunk(ray_session):
    from bidirl.cluster.engines.driver import EngineDriver
    from bidirl.job import config as cfgmod

    cfg = cfgmod.load("tiny-moe-cpu")
    steps = cfg.workload.steps
    driver = EngineDriver(cfg, cfg.scheduler.policy, steps, cfg.seed)
    res = driver.run()
    s = res.summary()
    assert len(res.log.steps) == steps
    assert s["samples"]["lost"] == 0 and s["samples"]["duplicated"] == 0, s["samples"]
    assert s["borrows"]["rollout_on_trainer_pool"] > 0 and s["borrows"]["trainer_on_rollout_pool"] > 0, s["borrows"]
    # auxiliary workers really worked: generation on the trainer pool, chunks on the rollout pool
    assert any(sp.kind == "generate" and sp.worker.startswith("trainer_pool/rollouter") for sp in res.log.spans)
    assert any(sp.kind == "chunk" and sp.worker == "rollout_pool/trainer" for sp in res.log.spans)
    # every chunk of every trainer stage replayed the rollout's routes for all the tokens it fed
    rr = s["route_replay"]
    assert rr["on"] and rr["every_chunk_replayed"] and rr["replayed_chunks"] == rr["chunks"], rr
    assert set(rr["per_stage"]) == set(cfg.rl.stages)
    assert all(v["chunks"] >= steps for v in rr["per_stage"].values()), rr      # every step ran each stage
    tol = rounding.run_logprob_tolerance(driver.model_dir, res.weights, cfg.rl.lr, steps)
    for st in s["train"]:
        assert st["on_policy_samples"] == cfg.workload.prompts_per_step * cfg.workload.group_size
        assert st["logprob_diff_max"] <= tol, st
        assert st["logprob_diff_max_no_r3"] is not None          # rl.route_replay_compare: measured each step
    print(f"\ntiny-moe-cpu: {rr['replayed_chunks']}/{rr['chunks']} chunks replayed ({rr['tokens']} tokens); "
          f"borrows {s['borrows']}; log-prob gap with R3 {s['logprob_diff_max']:.3e}, without "
          f"{s['logprob_diff_max_no_r3']:.3e} (bound {tol:.3e}); reward {s['reward']}")
