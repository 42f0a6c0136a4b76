"""Engine runs beyond the default: the tiny Llama, with trainer gangs sharded over their replica (ρ_t = 2).

Integration tests (``-m integration``) on the session's Ray, like ``tests/test_engine_driver.py`` and with its
tolerances (fp32, derived in ``tests/rounding.py``): vLLM's log-probs of sampled tokens vs the trainer's
recomputation after every weight sync within the rounding bound, and borrowing vs no borrowing at s = 0 ends at
the same weights bit for bit (``rounding.exact_weights``: the reproducible mode, on by default at s = 0).

One run pair covers two departures from the default at once, since each needs workers of its own (another model,
another layout — most of the test's time):

* the tiny Llama (``bidirl.rl.tiny_model.TINY_LLAMA``: an untied output head, no biases) runs where the Qwen2
  model runs: every weight sync is checked by the log-prob gap;
* with trainer replicas of two GPU slots (ρ_t = 2, as the planner picks for a model whose trainer state does
  not fit one GPU — an untied 8B model, say; forced here by the planner's layout step) each trainer gang is one
  replica of two ranks, so the model really is sharded in the run: chunks are split over a replica's ranks,
  forward stages gather the sharded weights, the auxiliary gang's gradients are gathered once and cut to shards
  on the primary ranks, and the weight sync gathers the shards.

The tied Qwen2 head sharded over two ranks is checked against the unsharded trainer in
``tests/test_trainer_fsdp.py``; the Qwen2 model on one-slot replicas by every other engine run.
"""

from __future__ import annotations

import importlib.util

import pytest

from bidirl.job import config as cfgmod
from bidirl.results import metrics

import rounding

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="engine runs need vllm (pip install -e .[cpu])")]

#: three steps: three optimizer steps and weight syncs per run, each sync's log-prob gap checked, and the
#: rollout pool's trainer slots borrowed at s = 0
STEPS = 3


@pytest.fixture(scope="module")
def llama_dir(model_dir):
    from bidirl.rl.bootstrap import ensure_tiny_model
    from bidirl.rl.tiny_model import TINY_LLAMA
    return ensure_tiny_model(cache_dir=model_dir.parent, cfg=TINY_LLAMA)


def _run(cfg, policy, model_dir, kept_workers, steps=STEPS):
    from bidirl.cluster.engines.driver import EngineDriver
    driver = EngineDriver(cfg, policy, steps, cfg.seed, model_dir=str(model_dir), kept_workers=kept_workers)
    return driver, driver.run()


def _check_equivalent_runs(cfg, model_dir, kept_workers):
    """No-borrow and opportunistic runs: both borrow directions used, same batches and rewards, same weights,
    every on-policy sample's log-prob gap within tolerance. Returns the two drivers."""
    runs = {}
    for policy in ("no-borrow", "opportunistic"):
        driver, res = _run(cfg, policy, model_dir, kept_workers)
        s = res.summary()
        assert len(res.log.steps) == STEPS
        assert s["samples"]["lost"] == 0 and s["samples"]["duplicated"] == 0, s["samples"]
        assert metrics.role_conflicts(res.log) == []
        tol = rounding.run_logprob_tolerance(model_dir, res.weights, cfg.rl.lr, STEPS)
        for st in s["train"]:
            assert st["on_policy_samples"] == cfg.workload.prompts_per_step * cfg.workload.group_size
            assert st["logprob_diff_max"] <= tol, (st, tol)
        runs[policy] = (driver, res, s)
    (_, base, a), (_, borrow, b) = runs["no-borrow"], runs["opportunistic"]
    assert b["borrows"]["trainer_on_rollout_pool"] > 0, b["borrows"]
    assert [sorted(g) for _, _, g in base.view.batches] == [sorted(g) for _, _, g in borrow.view.batches]
    assert a["reward"] == b["reward"]
    # s = 0: the reproducible mode is on by default, so borrowing changes no bit of the weights
    assert cfg.rl.reproducible_on
    differ = rounding.exact_weights(base.weights, borrow.weights)
    assert not differ, f"{len(differ)} tensors differ: {differ[:5]}"
    return runs["no-borrow"][0], runs["opportunistic"][0]


def test_the_tiny_llama_sharded_over_two_slot_replicas_trains_and_borrowing_keeps_its_weights(
        llama_dir, kept_workers, monkeypatch):
    from bidirl.job import planner
    real = planner.min_feasible_layouts

    def two_slot_trainer_replicas(cfg, hardware=None):
        rho_r, _, needs = real(cfg, hardware)
        return rho_r, 2, needs
    monkeypatch.setattr(planner, "min_feasible_layouts", two_slot_trainer_replicas)
    cfg = cfgmod.load("tiny-cpu").with_overrides({"rl.staleness": 0})
    assert planner.plan(cfg).envelope.trainer_layout == 2
    base, borrow = _check_equivalent_runs(cfg, llama_dir, kept_workers)
    for driver in (base, borrow):
        env, top = driver.plan.envelope, driver.topology
        assert (env.trainer_layout, top.trainer_replicas, top.aux_trainer_replicas) == (2, 1, 1)
        assert [len(driver.gangs[g]) for g in ("trainer_pool/trainer", "rollout_pool/trainer")] == [2, 2]
    # the Llama's own weights were trained and synced: an untied head, no biases
    assert set(borrow.final_weights) >= {"lm_head.weight", "model.embed_tokens.weight"}
    assert not any(k.endswith(".bias") for k in borrow.final_weights)
