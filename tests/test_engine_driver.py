"""The Ray runtime with real engines (vLLM rollouters, torch trainers) under the coordinator, on local Ray.

Integration tests (``-m integration``): each run starts Ray, four vLLM engines and two trainer gangs of two
gloo ranks on the tiny model (``tiny-cpu``), about a minute each on 2 cores. Tolerances, fp32 throughout:

* vLLM's log-probs of sampled tokens vs the trainer's recomputation after each sync: max |Δ| ≤ 1e-4
  (measured ≈ 3e-6);
* borrowing vs no borrowing at s = 0: the same prompt groups per step, identical rewards, final weights
  within max |Δ| ≤ 1e-4 (measured ≈ 1.5e-6: the chunk gradients are summed in a different grouping).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from bidirl.job import config as cfgmod
from bidirl.results import metrics

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="engine runs need vllm (pip install -e .[cpu])")]

LOGPROB_TOL = 1e-4
WEIGHT_TOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def own_ray():
    """The driver starts an embedded Ray and keeps it for later runs; this module starts and ends its own."""
    import ray
    ray.shutdown()
    yield
    ray.shutdown()


def _run(cfg, policy, model_dir, steps, kill=None):
    from bidirl.cluster.engines.driver import EngineDriver
    return EngineDriver(cfg, policy, steps, cfg.seed, model_dir=str(model_dir)).run(kill=kill)


def _check_log(res, steps):
    s = res.summary()
    assert len(res.log.steps) == steps
    assert s["samples"]["lost"] == 0 and s["samples"]["duplicated"] == 0, s["samples"]
    assert metrics.role_conflicts(res.log) == [], "a pool hosted both roles at once"
    return s


def test_borrowing_changes_where_work_runs_not_what_is_learned_and_the_reward_rises(model_dir):
    cfg = cfgmod.load("tiny-cpu").with_overrides({"rl.staleness": 0})
    steps = 10
    base = _run(cfg, "no-borrow", model_dir, steps)
    borrow = _run(cfg, "opportunistic", model_dir, steps)
    a, b = _check_log(base, steps), _check_log(borrow, steps)
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
    diff = max(float((base.weights[k] - borrow.weights[k]).abs().max()) for k in base.weights)
    assert diff <= WEIGHT_TOL, diff
    # on-policy at s = 0: every sample checks the weight sync that preceded its step
    for s in (a, b):
        for st in s["train"]:
            assert st["on_policy_samples"] == cfg.workload.prompts_per_step * cfg.workload.group_size
            assert st["logprob_diff_max"] <= LOGPROB_TOL, st
    # measured hot-switch costs of both directions, in seconds
    for direction, keys in (("rollout_on_trainer_pool", ("c_in", "c_out")),
                            ("trainer_on_rollout_pool", ("c_in", "c_out", "c_grad"))):
        for k in keys:
            assert 0 < b["costs"][direction][k] < 30, (direction, k, b["costs"])


def test_killing_auxiliary_workers_mid_window_loses_no_sample(model_dir):
    import ray

    from bidirl.core import protocol as P
    # at s = 0 each pool idles every step (rollout waits for the sync, training waits for the batch), so
    # borrowing windows in both directions open at every step; 32 x 8 responses per step make generation
    # outlast a switch, so groups migrate to the auxiliary rollouters (interrupts crossing completions)
    cfg = cfgmod.load("tiny-cpu").with_overrides({"rl.staleness": 0, "workload.prompts_per_step": 32,
                                                  "workload.group_size": 8})
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
    res = _run(cfg, "opportunistic", model_dir, steps, kill=kill)
    s = _check_log(res, steps)
    assert set(killed) == {"rollout", "trainer"}, killed
    # both were restarted (fresh processes) and the run ended with every worker back
    assert {killed["rollout"], P.AUX_TRAINER} <= {r["worker"] for r in s["recoveries"]} and res.view.failed == ()
    consumed = cfg.workload.prompts_per_step * cfg.workload.group_size * steps
    assert s["samples"]["consumed"] == consumed


def test_a_worker_that_fails_to_start_names_itself_and_the_cause(model_dir, tmp_path):
    import shutil

    from bidirl.cluster.engines.driver import EngineDriver
    from bidirl.cluster.pool import ClusterError
    # a checkpoint whose weight file is cut short: the driver reads only its config and tokenizer, the workers'
    # engines fail to load it (a KV budget the engines cannot use is refused before: tests/test_rollout_memory.py)
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    driver = EngineDriver(cfgmod.load("tiny-cpu"), "bidirl", 1, 0, model_dir=str(broken))
    with pytest.raises(ClusterError, match=r"(rollouter|trainer)/\d failed to start: .*deserializing header"):
        driver.run()


def test_cli_run_prints_the_contract_and_writes_the_event_log(model_dir, tmp_path):
    trace = tmp_path / "run.json"
    env = dict(os.environ, BIDIRL_CACHE=str(model_dir.parent))
    out = subprocess.run([sys.executable, "-m", "bidirl.cli", "run", "tiny-cpu", "--steps", "3", "--json",
                          "--trace", str(trace)], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    s = json.loads(out.stdout)        # stdout holds the JSON object only (Ray's own output goes to stderr)
    for key in ("policy", "throughput", "step_times", "idle", "utilization", "borrows", "samples", "costs",
                "reward", "train", "startup", "weight_sync"):
        assert key in s, key
    assert s["emulated"] is False and s["policy"] == "bidirl"
    assert len(s["reward"]) == 3 and len(s["step_times"]) == 3 and s["samples"]["lost"] == 0
    assert all(0.0 <= r <= 1.0 for r in s["reward"])
    events = json.loads(trace.read_text())
    assert any(e.get("name") == "generate" for e in events["traceEvents"]), "the trace holds the generation spans"
