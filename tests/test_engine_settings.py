"""Engine runs with the trainer's job settings (real vLLM rollouters and torch trainer gangs on the tiny model,
``tiny-cpu``): token-budget micro-batches with parameter and optimizer offload, and bypass (old log-probs from the
rollout). Integration tests (``-m integration``).

Tolerances: the weights of two runs of one job compare as ``tests/rounding.py``'s ``same_weights`` derives
(at most 1 % of the weights with a gradient more than lr/3 apart, none more than Adam's 2·κ·lr·steps): micro-batches
and offload change the gradient's grouping only (``tests/test_trainer_settings.py``: the micro-batch sum within
fp32 rounding, the offloaded state bit for bit), which is what that bound covers.
"""

from __future__ import annotations

import importlib.util

import pytest

import engine_jobs
import rounding
from test_engine_driver import FULL_LENGTH, _check_log, _run, _timing_free

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="engine runs need vllm (pip install -e .[cpu])")]

STEPS = 2


def _job(**overrides):
    return engine_jobs.borrowing(**{"rl.staleness": 0, **FULL_LENGTH, **overrides})


def test_token_budget_and_offload_run_and_learn_what_the_plain_job_learns(model_dir, kept_workers):
    """The same job with a token budget of 128 tokens (two full-length samples of the tiny job, ≤ 64 tokens each: the
    coordinator cuts chunks by it, and a share whose padded size exceeds it runs in several passes) and both
    offloads: the same prompt groups, rewards and versions per step as the plain job, weights as two runs of one
    job."""
    plain_cfg = _job()
    cfg = _job(**{"rl.max_tokens_per_micro_batch": 128, "rl.param_offload": True, "rl.optimizer_offload": True})
    plain = _run(plain_cfg, "opportunistic", model_dir, STEPS, kept_workers)
    got = _run(cfg, "opportunistic", model_dir, STEPS, kept_workers)
    _check_log(got, STEPS)
    assert _timing_free(got) == _timing_free(plain)
    assert any(sp.kind == "chunk" and sp.worker == "rollout_pool/trainer" for sp in got.log.spans)  # a borrowed one
    gap = rounding.same_weights(got.weights, plain.weights, cfg.rl.lr, STEPS)
    assert gap.ok, str(gap)


def test_bypass_runs_without_the_old_logprob_stage(model_dir, kept_workers):
    """``rl.recompute_old_logprob: false``: no ``old_logprob`` chunk runs, the update takes vLLM's log-probs, and the
    sync check that compares them with a recomputation reports none."""
    cfg = _job(**{"rl.recompute_old_logprob": False})
    res = _run(cfg, "opportunistic", model_dir, STEPS, kept_workers)
    _check_log(res, STEPS)
    stages = {sp.detail.get("stage") for sp in res.log.spans if sp.kind == "chunk"}
    assert "actor_update" in stages and "old_logprob" not in stages, stages
    rows = res.summary()["train"]
    assert len(rows) == STEPS and all(r["logprob_diff_max"] is None and r["on_policy_samples"] == 0 for r in rows)
