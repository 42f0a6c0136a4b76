"""Engine runs with the trainer's job settings (real vLLM rollouters and torch trainer gangs on the tiny model,
``tiny-cpu``): bypass (old log-probs from the rollout). Integration tests (``-m integration``).

Token-budget micro-batches and parameter / optimizer offload are tested on one trainer engine and a two-rank gang
(``tests/test_trainer_settings.py``); whole engine runs with them are refused for now (``config.ENGINE_PENDING``:
such a run stalled at its first step in this version).
"""

from __future__ import annotations

import importlib.util

import pytest

import engine_jobs
from test_engine_driver import FULL_LENGTH, _check_log, _run

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="engine runs need vllm (pip install -e .[cpu])")]

STEPS = 2


def _job(**overrides):
    return engine_jobs.borrowing(**{"rl.staleness": 0, **FULL_LENGTH, **overrides})


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
