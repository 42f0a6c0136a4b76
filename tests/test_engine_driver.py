"""The Ray runtime with real engines (vLLM rollouters, torch trainers) under the coordinator, on local Ray.

Integration tests (``-m integration``): each run starts Ray, four vLLM engines and two trainer gangs of two
gloo ranks on the tiny model (``tiny-cpu``), on the session's Ray and kept workers (``tests/conftest.py``).
Tolerances, fp32 throughout, derived in ``tests/rounding.py`` (none from one machine's output):

* vLLM's log-probs of sampled tokens vs the trainer's recomputation after each sync: rounding only, ≤ 2·2ρ·Z_max
  with Z_max bounded from the run's weights (≈ 4e-3 here; measured ≈ 3e-6 on an AMD EPYC);
* borrowing vs no borrowing at s = 0, and kept vs fresh workers: the same prompt groups per step, identical
  rewards, the same final weights bit for bit (``rounding.exact_weights``: the reproducible mode, on by default at
  s = 0, sums the chunk gradients in one order whichever gang computed them; before it, borrowing left them ≈ 1.5e-6
  apart).
"""

from __future__ import annotations

import importlib.util

import pytest

from bidirl.job import config as cfgmod
from bidirl.results import metrics

import engine_jobs
import rounding

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="engine runs need vllm (pip install -e .[cpu])")]



def _run(cfg, policy, model_dir, steps, kept_workers, kill=None):
    from bidirl.cluster.engines.driver import EngineDriver
    driver = EngineDriver(cfg, policy, steps, cfg.seed, model_dir=str(model_dir), kept_workers=kept_workers)
    return driver.run(kill=kill)


def _logprob_tol(res, model_dir, cfg, steps) -> float:
    """vLLM against the trainer on any weights of the run (``tests/rounding.py``)."""
    return rounding.run_logprob_tolerance(model_dir, res.weights, cfg.rl.lr, steps)


def _check_same_weights(a, b, cfg, steps) -> None:
    """Two runs of one job at s = 0 (the reproducible mode on by default): the same weights bit for bit."""
    assert cfg.rl.reproducible_on
    differ = rounding.exact_weights(a.weights, b.weights)
    assert not differ, f"{len(differ)} tensors differ: {differ[:5]}"


def _check_log(res, steps):
    s = res.summary()
    assert len(res.log.steps) == steps
    assert s["samples"]["lost"] == 0 and s["samples"]["duplicated"] == 0, s["samples"]
    assert metrics.role_conflicts(res.log) == [], "a pool hosted both roles at once"
    _check_rollouters_ran_free(s["rollout_calls"])
    return s


def _check_rollouters_ran_free(calls):
    """Rollouters run free (``RolloutActor.stream``): a stream covers a whole busy period and a new one opens only
    for a start the last one did not see, so a rollouter gets at most one generation call per ``Generate`` — where
    polling sent one per 50 ms slice, each slice waiting for the driver's round trip — and its engine makes many
    steps per call."""
    for worker, c in calls["rollouters"].items():
        assert c["advances"] <= c["starts"], (worker, c)
    assert calls["steps"] > calls["advances"] > 0, calls


#: every response generated to the full max_response_len (16 tokens, vLLM ignore_eos): the warm-started tiny model
#: answers in 2.9 tokens (answer digits + EOS; data/presets/workloads/arithmetic.yaml), so a step's generation is
#: three decode iterations — shorter than an auxiliary rollouter's switch-in (wake, weight load over a fresh
#: rendezvous, Ray round trips), whose latency grows with the machine's load. Sixteen iterations are the longest
#: generation the tiny model's 64 positions allow beside 48-token prompts (engine_jobs.SHARED); lengths are
#: min(16, round(X)), X log-normal of mean 16 and cv 0.01, so 16 or 15 tokens (the workload model's draw, seeded)
FULL_LENGTH = {"workload.forced_lengths": True, "workload.response_lengths": {"mean": 16, "cv": 0.01}}


def _borrowing_job():
    """At s = 0 each pool idles every step (rollout waits for the sync, training waits for the batch), so borrowing
    windows in both directions open at every step; 32 x 8 responses of 16 tokens per step make generation outlast
    a rollouter's switch-in (:data:`FULL_LENGTH`), so groups migrate to the auxiliary rollouters."""
    return engine_jobs.borrowing(**{"rl.staleness": 0, **FULL_LENGTH})


def _timing_free(res) -> dict:
    """What a run computed, without when: per step its prompt groups, version and tokens, and the rewards."""
    return {"steps": [(r.step, r.version, sorted(g), r.tokens, r.samples)
                      for r, (_, _, g) in zip(res.log.steps, res.view.batches)],
            "reward": res.summary()["reward"]}


@pytest.mark.fresh_workers
def test_kept_workers_run_a_job_as_fresh_ones_do(model_dir, kept_workers):
    """The library's reuse (``KeptWorkers``, as notebooks and side-by-side runs use it): a run on workers an earlier
    run left, each reset, computes what a run on freshly started workers computes for the same seed — the same
    prompt groups, versions and tokens per step, the same rewards, the same weights — and borrows as it does: the
    auxiliary rollouters generate in both (a fresh engine warms up at start-up, so its first busy period is as fast
    as a kept one's). Path: start, reset of every kind of worker (primary and auxiliary rollouters and gangs),
    switches both ways, weight syncs, optimizer steps."""
    cfg = _borrowing_job()
    steps = 3
    kept_workers.release()                       # the next run starts its workers
    fresh = _run(cfg, "opportunistic", model_dir, steps, kept_workers)
    started, reused = kept_workers.started, kept_workers.reused
    kept = _run(cfg, "opportunistic", model_dir, steps, kept_workers)
    assert (kept_workers.started, kept_workers.reused) == (started, reused + 1), "the second run did not reuse"
    for res in (fresh, kept):
        s = _check_log(res, steps)
        assert s["borrows"]["rollout_on_trainer_pool"] > 0 and s["borrows"]["trainer_on_rollout_pool"] > 0
        # the auxiliary workers work in both runs: generation on the trainer pool, chunks on the rollout pool
        assert any(sp.kind == "generate" and sp.worker.startswith("trainer_pool/rollouter") for sp in res.log.spans)
        assert any(sp.kind == "chunk" and sp.worker == "rollout_pool/trainer" for sp in res.log.spans)
    assert _timing_free(kept) == _timing_free(fresh)
    _check_same_weights(fresh, kept, cfg, steps)


def test_borrowing_changes_where_work_runs_not_what_is_learned_and_the_reward_rises(model_dir, kept_workers,
                                                                                  reference_run):
    """The borrowing run is the session's reference run (``tests/conftest.py``: this job under ``opportunistic``
    for 10 steps, its Ray traffic metered, a recovery snapshot every 3 steps and a checkpoint after every step,
    which change no result); the no-borrow run is the same job's."""
    cfg, steps = engine_jobs.reference(), engine_jobs.REFERENCE_STEPS
    ref = reference_run.of(cfg, engine_jobs.REFERENCE_POLICY)
    base = _run(cfg, "no-borrow", model_dir, steps, kept_workers)
    borrow, meter = ref.result, ref.meter
    a, b = _check_log(base, steps), _check_log(borrow, steps)
    # the auxiliary gang's gradients went shard to shard, once per window: nothing of them through the object store
    assert b["aux_gradients"]["path"] == "shard to shard" and b["aux_gradients"]["transfers"] > 0, b["aux_gradients"]
    grads = b["aux_gradients"]
    assert meter.store["gradients"] == 0 and meter.calls.get("receive_gradient", 0) == 0, (meter.calls, meter.store)
    switched_back = sum(sp.kind == "switch_out" and sp.pool == "rollout_pool" for sp in borrow.log.spans)
    assert 0 < grads["windows"] <= switched_back, (grads, switched_back)       # once per window, not per chunk
    assert meter.calls["send_window"] == grads["windows"] * grads["senders"], (meter.calls, grads)
    # what the run is travels with it to its figures
    from bidirl.viz.gantt import TIME_AXIS_TITLES, gantt_figure
    assert borrow.provenance == b["provenance"] == "measured"
    assert gantt_figure(borrow).layout.xaxis.title.text == TIME_AXIS_TITLES["measured"]
    assert b["borrows"]["rollout_on_trainer_pool"] > 0 and b["borrows"]["trainer_on_rollout_pool"] > 0, b["borrows"]
    assert a["borrows"]["rollout_on_trainer_pool"] == a["borrows"]["trainer_on_rollout_pool"] == 0
    # auxiliary workers really worked: generation on the trainer pool, chunks on the rollout pool
    kinds = {(sp.kind, sp.worker) for sp in borrow.log.spans}
    assert any(k == "generate" and w.startswith("trainer_pool/rollouter") for k, w in kinds)
    assert ("chunk", "rollout_pool/trainer") in kinds
    # same prompt groups per step, same rewards, same weights
    assert [sorted(g) for _, _, g in base.view.batches] == [sorted(g) for _, _, g in borrow.view.batches]
    assert a["reward"] == b["reward"]
    # the model learns: every step trains on the same 16 problems (workload.prompt_pool), on-policy
    first, last = sum(a["reward"][:3]) / 3, sum(a["reward"][-3:]) / 3
    assert last > first + 0.05, a["reward"]
    _check_same_weights(base, borrow, cfg, steps)
    # on-policy at s = 0: every sample checks the weight sync that preceded its step
    for s in (a, b):
        for st in s["train"]:
            assert st["on_policy_samples"] == cfg.workload.prompts_per_step * cfg.workload.group_size
            assert st["logprob_diff_max"] <= _logprob_tol(base, model_dir, cfg, steps), st
    # measured hot-switch costs of both directions, in seconds
    for direction, keys in (("rollout_on_trainer_pool", ("c_in", "c_out")),
                            ("trainer_on_rollout_pool", ("c_in", "c_out", "c_grad"))):
        for k in keys:
            assert 0 < b["costs"][direction][k] < 30, (direction, k, b["costs"])


def test_killing_auxiliary_workers_mid_window_loses_no_sample(model_dir, kept_workers):
    import ray

    from bidirl.core import protocol as P
    cfg = _borrowing_job()          # groups migrate to the auxiliary rollouters (interrupts crossing completions)
    killed = {}

    def kill(driver):
        if "rollout" not in killed:
            running = [w for w in driver.topology.aux_rollouters if driver.r_busy.get(w)]
            if running:
                killed["rollout"] = running[0]
                ray.kill(driver.actors[running[0]])
        if "trainer" not in killed and driver.chunk_running.get(P.AUX_TRAINER) is not None:
            killed["trainer"] = driver.chunk_running[P.AUX_TRAINER].chunk.chunk_id
            ray.kill(driver.gangs[P.AUX_TRAINER][0])

    steps = 6
    res = _run(cfg, "opportunistic", model_dir, steps, kept_workers, kill=kill)
    s = _check_log(res, steps)
    assert set(killed) == {"rollout", "trainer"}, killed
    # both were restarted (fresh processes) and the run ended with every worker back
    assert {killed["rollout"], P.AUX_TRAINER} <= {r["worker"] for r in s["recoveries"]} and res.view.failed == ()
    consumed = cfg.workload.prompts_per_step * cfg.workload.group_size * steps
    assert s["samples"]["consumed"] == consumed


def test_a_worker_that_fails_to_start_names_itself_and_the_cause(model_dir, ray_session, tmp_path):
    import shutil

    from bidirl.cluster.engines.driver import EngineDriver
    from bidirl.cluster.pool import ClusterError
    # a checkpoint whose weight file is cut short: the driver reads only its config and tokenizer, the workers'
    # engines fail to load it (a KV budget the engines cannot use is refused before: tests/test_rollout_memory.py)
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    # the smallest layout (one GPU slot per pool: a rollouter, a one-rank gang and their auxiliaries): what is
    # checked is the first failure's report, and every worker of any layout loads the same files
    small = cfgmod.load("tiny-cpu").with_overrides({"cluster.gpus": 2, "cluster.gpus_per_node": 2,
                                                    "cluster.partition": {"rollout": 1, "trainer": 1}})
    driver = EngineDriver(small, "bidirl", 1, 0, model_dir=str(broken))
    with pytest.raises(ClusterError, match=r"(rollouter|trainer)/\d failed to start: .*deserializing header"):
        driver.run()
