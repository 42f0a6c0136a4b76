"""An engine run with optimizer mini-batches (``rl.mini_batch_prompts``, veRL's ``ppo_mini_batch_size``): real vLLM
rollouters and torch trainer gangs on the tiny model (``tiny-cpu``). Integration test (``-m integration``).

The job's 32 prompts per step are 4 mini-batches of 8: the primary gang takes one optimizer step after each, the
first three keeping the version, the fourth making the step's version, and the rollouters get the weights once per
step. Borrowing is on in both directions (the opportunistic policy at s = 0: each pool idles every step), so an
auxiliary trainer gang computes chunks of the forward stages and of the mini-batches, each mini-batch's gradients
merged before its optimizer step, and its weights refreshed after it (``tests/test_engine_aux_refresh.py``).
"""

from __future__ import annotations

import importlib.util

import pytest

import engine_jobs
from engine_log_checks import one_mini_batch_between_optimizer_steps
from test_engine_driver import FULL_LENGTH, _check_log, _logprob_tol, _run

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="engine runs need vllm (pip install -e .[cpu])")]

STEPS = 2
MINI = 8


def test_mini_batches_take_one_optimizer_step_each_and_the_rollouters_get_the_steps_weights(model_dir,
                                                                                           kept_workers):
    cfg = engine_jobs.borrowing(**{"rl.staleness": 0, **FULL_LENGTH, "rl.mini_batch_prompts": MINI})
    per_step = cfg.workload.prompts_per_step // MINI
    assert per_step == 4
    res = _run(cfg, "opportunistic", model_dir, STEPS, kept_workers)
    s = _check_log(res, STEPS)
    # one optimizer step per mini-batch on the primary gang, and one version per step (the engine checks each
    # update's version against the scheduler's: a mini-batch that made a version would stop the run)
    opt = [sp for sp in res.log.spans if sp.kind == "optimizer" and sp.worker == "trainer_pool/trainer"]
    assert len(opt) == STEPS * per_step, len(opt)
    assert [st.version for st in res.log.steps] == list(range(1, STEPS + 1))
    rows = s["train"]
    assert [r["optimizer_updates"] for r in rows] == [per_step] * STEPS
    assert [r["version"] for r in rows] == list(range(1, STEPS + 1))
    # the update chunks between two optimizer steps of a step (on either gang) hold one mini-batch's samples, and
    # none runs across an optimizer step: the next mini-batch computes on the updated weights
    group = cfg.workload.group_size
    for step in range(STEPS):
        chunks = one_mini_batch_between_optimizer_steps(res, opt, step, MINI * group)
        assert sum(c.detail["samples"] for c in chunks) == per_step * MINI * group
    # the rollouters hold the trainer's weights after each sync: at s = 0 every sample of step k was generated on
    # the version step k − 1 produced, and vLLM's log-probs of it match the trainer's recomputation on the weights
    # it holds then, within the run's derived tolerance (STEPS · per_step AdamW steps from the model folder)
    tol = _logprob_tol(res, model_dir, cfg, STEPS * per_step)
    for r in rows:
        assert r["on_policy_samples"] == cfg.workload.prompts_per_step * group
        assert r["logprob_diff_max"] <= tol, (r, tol)
    assert any(sp.kind == "chunk" and sp.worker == "rollout_pool/trainer" for sp in res.log.spans), "no borrowing"
