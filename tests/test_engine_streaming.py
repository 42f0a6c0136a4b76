"""An engine run with streaming consumption (``rl.updates_per_sync``, veRL fully-async's
``trigger_parameter_sync_step``) and optimizer mini-batches: real vLLM rollouters and torch trainer gangs on the tiny
model (``tiny-cpu``). Integration test (``-m integration``).

The job's 32 prompts per step are 2 local updates of 16 prompts, each 2 mini-batches of 8: the primary gang takes
four optimizer steps a step, each local update starting when its own prompts are ready; only the step's last makes a
version, which is published and synced once. Each local update has its own identity ``(step, local)``, so the
engine does not read the second as a rolled-back attempt of the first (which would drop what it holds). Borrowing
is on in both directions (the opportunistic policy at s = 0); an auxiliary trainer gang runs a chunk after an
optimizer step only once the primaries' new weights were loaded into it (``RefreshWeights``).
"""

from __future__ import annotations

import importlib.util

import pytest

import engine_jobs
import rounding
from engine_log_checks import aux_chunks_after_refreshes, one_mini_batch_between_optimizer_steps
from test_engine_driver import FULL_LENGTH, _check_log, _logprob_tol, _run

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="engine runs need vllm (pip install -e .[cpu])")]

STEPS = 2
LOCAL, MINI = 2, 8


def _job():
    return engine_jobs.borrowing(**{"rl.staleness": 0, **FULL_LENGTH, "rl.updates_per_sync": LOCAL,
                                    "rl.mini_batch_prompts": MINI})


@pytest.fixture(scope="module")
def streamed(model_dir, kept_workers):
    """The job's fault-free run."""
    return _run(_job(), "opportunistic", model_dir, STEPS, kept_workers)


def test_local_updates_step_the_weights_and_the_rollouters_get_one_version_per_step(model_dir, streamed):
    cfg = _job()
    per_step = cfg.workload.prompts_per_step // MINI
    assert per_step == 4
    res = streamed
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
    # gang's after an optimizer step follow a refresh of its weights that began after it
    for step in range(STEPS):
        one_mini_batch_between_optimizer_steps(res, opt, step, MINI * group)
        aux_chunks_after_refreshes(res, step)
    # the rollouters hold the trainer's weights after each sync: vLLM's log-probs of the samples of step k, all
    # generated on the version step k − 1 produced, match the trainer's recomputation (the first local update's
    # old log-probs, on the version's weights) within the run's derived tolerance (STEPS · 4 AdamW steps)
    tol = _logprob_tol(res, model_dir, cfg, STEPS * per_step)
    assert all(r["logprob_diff_max"] <= tol for r in rows), (rows, tol)


def test_a_primary_gang_lost_in_a_later_local_update_comes_back_where_it_stood(model_dir, kept_workers, streamed):
    """A rank of the primary gang killed while it runs a chunk of step 1's second local update, after the first
    one's two optimizer steps moved the weights without a new version: the restarted gang loads the model folder,
    replays step 0 (its local updates and mini-batches, the last making version 1), publishes version 1, replays
    step 1's first local update, and the coordinator starts the second one over. At s = 0 (the reproducible mode)
    the run ends with the fault-free run's prompt groups and weights bit for bit (``rounding.exact_weights``): a
    local update lost from the replay, or replayed twice, changes every weight."""
    import ray

    from bidirl.core import protocol as P

    kills = []

    def kill(driver):
        coord = driver.coordinator
        if kills or coord.steps_done != 1 or coord.local_update != 1:
            return
        if driver.chunk_running.get(P.PRIMARY_TRAINER) is None or P.PRIMARY_TRAINER in driver.failed:
            return
        ray.kill(driver.gangs[P.PRIMARY_TRAINER][0])
        kills.append(driver.chunk_running[P.PRIMARY_TRAINER].chunk.stage)

    cfg = _job()
    res = _run(cfg, "opportunistic", model_dir, STEPS, kept_workers, kill=kill)
    s = _check_log(res, STEPS)
    assert kills, "the kill's moment never came"
    assert any(r["worker"] == P.PRIMARY_TRAINER for r in s["recoveries"]), s["recoveries"]
    assert [sorted(ids) for _, _, ids in res.view.batches] == [sorted(ids) for _, _, ids in streamed.view.batches]
    assert cfg.rl.reproducible_on
    differ = rounding.exact_weights(res.weights, streamed.weights)
    assert not differ, f"{len(differ)} tensors differ from the fault-free run's: {differ[:5]}"
