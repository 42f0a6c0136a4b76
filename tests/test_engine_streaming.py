"""An engine run with streaming consumption (``rl.updates_per_sync``, veRL fully-async's
``trigger_parameter_sync_step``) and optimizer mini-batches: real vLLM rollouters and torch trainer gangs on the tiny
model (``tiny-cpu``). Integration test (``-m integration``).

The job's 32 prompts per step are 2 local updates of 16 prompts, each 2 mini-batches of 8: the primary gang takes
four optimizer steps a step, each local update starting when its own prompts are ready; only the step's last makes a
version, which is published and synced once. Each local update has its own identity ``(step, local)``, so the
engine does not read the second as a rolled-back attempt of the first (which would drop what it holds). Borrowing
is on in both directions (the opportunistic policy at s = 0); an auxiliary trainer gang holds the version's
weights, so it runs chunks of a step's first mini-batch of its first local update only.
"""

from __future__ import annotations

import importlib.util

import pytest

import engine_jobs
from test_engine_driver import FULL_LENGTH, _check_log, _logprob_tol, _run

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="engine runs need vllm (pip install -e .[cpu])")]

STEPS = 2
LOCAL, MINI = 2, 8


def test_local_updates_step_the_weights_and_the_rollouters_get_one_version_per_step(model_dir, kept_workers):
    cfg = engine_jobs.borrowing(**{"rl.staleness": 0, **FULL_LENGTH, "rl.updates_per_sync": LOCAL,
                                   "rl.mini_batch_prompts": MINI})
    per_step = cfg.workload.prompts_per_step // MINI
    assert per_step == 4
    res = _run(cfg, "opportunistic", model_dir, STEPS, kept_workers)
    s = _check_log(res, STEPS)
    opt = [sp for sp in res.log.spans if sp.kind == "optimizer" and sp.worker == "trainer_pool/trainer"]
    assert len(opt) == STEPS * per_step, len(opt)
    # one version and one sync per step (the engine checks each update's version against the scheduler's)
    assert [st.version for st in res.log.steps] == list(range(1, STEPS + 1))
    syncs = sorted({sp.detail["version"] for sp in res.log.spans if sp.kind == "sync"
                    and sp.worker.startswith("rollout_pool/rollouter")})
    assert syncs == list(range(1, STEPS + 1)), syncs
    rows = s["train"]
    assert [r["optimizer_updates"] for r in rows] == [per_step] * STEPS
    # the sync is checked on the first local update's samples: their old log-probs are recomputed on the version's
    # weights (the second local update's, on the weights the first one moved)
    group = cfg.workload.group_size
    assert all(r["on_policy_samples"] == cfg.prompts_per_local_update * group for r in rows), rows
    # between two optimizer steps the update chunks (either gang's) hold one mini-batch's samples; the auxiliary
    # gang's all come before a step's first optimizer step
    for step in range(STEPS):
        steps = sorted((sp.start, sp.end) for sp in opt if sp.step == step)
        chunks = [sp for sp in res.log.spans
                  if sp.kind == "chunk" and sp.detail.get("stage") == "actor_update" and sp.step == step]
        before = -float("inf")
        for start, end in steps:
            between = [c for c in chunks if c.start >= before and c.end <= start]
            assert sum(c.detail["samples"] for c in between) == MINI * group, (step, start, len(between))
            before = end
        aux = [sp for sp in res.log.spans if sp.kind == "chunk" and sp.worker == "rollout_pool/trainer"
               and sp.step == step]
        assert all(sp.end <= steps[0][0] for sp in aux), step
    # the rollouters hold the trainer's weights after each sync: vLLM's log-probs of the samples of step k, all
    # generated on the version step k − 1 produced, match the trainer's recomputation (the first local update's
    # old log-probs, on the version's weights) within the run's derived tolerance (STEPS · 4 AdamW steps)
    tol = _logprob_tol(res, model_dir, cfg, STEPS * per_step)
    assert all(r["logprob_diff_max"] <= tol for r in rows), (rows, tol)
