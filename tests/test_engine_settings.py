"""Engine runs with the trainer's job settings (real vLLM rollouters and torch trainer gangs on the tiny model,
``tiny-cpu``): token-budget micro-batches, parameter and optimizer offload, and bypass (old log-probs from the
rollout). Integration tests (``-m integration``).

Each trainer gang of ``tiny-cpu`` is two replicas of one rank (ρ_t = 1), the layout whose runs with a token budget
stalled at their first step (issue #37: a short log-prob chunk went only to the replica with samples and the
budget's passes were agreed per replica, so the gang's launch order diverged between its ranks; the unit case is
in ``tests/test_launch_order.py``).

Weights. The jobs run at s = 0, where the reproducible mode is on: parameter and optimizer offload move bytes and
change no arithmetic, so an offloaded run's weights equal the plain job's bit for bit (``rounding.exact_weights``).
Token-budget micro-batches group each share's sum in passes — other arithmetic — and two runs whose arithmetic
differs hold no per-weight bound after their first step (``tests/rounding.py``), so the token-budget run is held to
the plain job's batches, rewards and versions here, and its gradient to the one-pass gradient chunk by chunk within
a derived fp32 bound in ``tests/test_trainer_settings.py``.
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


#: the token budget of the budget run: two full-length samples of the tiny job (≤ 48 prompt + 16 response tokens
#: each, engine_jobs.SHARED): the coordinator cuts chunks by it, and a share whose padded size exceeds it runs in
#: several passes
BUDGET = 128


def test_offload_learns_the_plain_jobs_weights_bit_for_bit_and_a_token_budget_its_batches(model_dir, kept_workers):
    """The same job with both offloads: the plain job's prompt groups, rewards, versions and weights, bit for bit.
    With a token budget of :data:`BUDGET` tokens besides: the same prompt groups, rewards and versions per step, and
    no pass over more than the budget — a pass holds at most ``BUDGET`` padded tokens, at least its samples' own, so
    a step's update runs at least ⌈step tokens / ``BUDGET``⌉ passes over all ranks."""
    plain_cfg = _job()
    offload_cfg = _job(**{"rl.param_offload": True, "rl.optimizer_offload": True})
    budget_cfg = _job(**{"rl.max_tokens_per_micro_batch": BUDGET, "rl.param_offload": True,
                         "rl.optimizer_offload": True})
    plain = _run(plain_cfg, "opportunistic", model_dir, STEPS, kept_workers)
    offloaded = _run(offload_cfg, "opportunistic", model_dir, STEPS, kept_workers)
    budget = _run(budget_cfg, "opportunistic", model_dir, STEPS, kept_workers)
    for got in (offloaded, budget):
        _check_log(got, STEPS)
        assert _timing_free(got) == _timing_free(plain)
        assert any(sp.kind == "chunk" and sp.worker == "rollout_pool/trainer" for sp in got.log.spans)  # borrowed
    assert offload_cfg.rl.reproducible_on
    differ = rounding.exact_weights(offloaded.weights, plain.weights)
    assert not differ, f"{len(differ)} tensors differ: {differ[:5]}"
    for row, step in zip(budget.summary()["train"], budget.log.steps):
        assert row["micro_batch_passes"] >= -(-step.tokens // BUDGET), (row, step)
    assert all("micro_batch_passes" not in row for row in plain.summary()["train"])


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
