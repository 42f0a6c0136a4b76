"""Real engine runs on the user's data and reward, tracked to an output folder, and on a ``ray start`` cluster.

Integration tests (``-m integration``): each starts the tiny model's four vLLM engines and two trainer gangs
(``tiny-cpu``) for one or two steps, on the session's Ray or, for ``bidirl run``, on the cluster it reaches.

* the shipped veRL-layout parquet drives a run scored by a ``compute_score`` file given by path, whose scores
  are the per-step rewards, and the run's output folder holds JSONL and TensorBoard metrics under veRL's names;
* a reward function that raises stops the run with a ``ClusterError`` naming it and the sample;
* ``bidirl run --address auto`` reaches a cluster started with ``ray start --head``, trains from a JSONL file and
  prints the CLI's JSON contract, with the trace written.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from bidirl.job import config as cfgmod
from bidirl.results import tracking

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="engine runs need vllm (pip install -e .[cpu])")]

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "data/datasets/arithmetic_word/train.parquet"

#: veRL names every engine run's metrics carry (actor/kl_loss only with a reference model)
ENGINE_METRICS = ("timing_s/step", "timing_s/gen", "timing_s/old_log_prob", "timing_s/update_actor",
                  "timing_s/param_sync", "critic/score/mean", "response_length/mean", "response_length/max",
                  "prompt_length/mean", "actor/pg_loss", "actor/pg_clipfrac", "actor/grad_norm", "perf/throughput",
                  "fully_async/trainer/idle_ratio", "fully_async/rollouter/idle_ratio",
                  "bidirl/idle/rollout_pool", "bidirl/idle/trainer_pool")

# A veRL reward file: its score depends on the row only, so each step's mean reward is known in advance.
SCORE_BY_ROW = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source != "bidirl/arithmetic_word" or not isinstance(solution_str, str):
        raise ValueError(f"unexpected arguments {data_source!r}, {solution_str!r}")
    return {"score": (extra_info["index"] % 5) / 10, "answer_chars": len(solution_str)}
"""

RAISES = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    raise ValueError("cannot parse the answer")
"""


def _write(path: Path, text: str) -> str:
    path.write_text(textwrap.dedent(text))
    return str(path)


def _run(cfg, model_dir, steps, out_dir=None):
    from bidirl.cluster.engines.driver import EngineDriver
    return EngineDriver(cfg, "bidirl", steps, cfg.seed, model_dir=str(model_dir), out_dir=out_dir).run()


def test_a_verl_parquet_and_a_compute_score_file_drive_a_tracked_run(model_dir, ray_session, tmp_path):
    reward = _write(tmp_path / "row_reward.py", SCORE_BY_ROW)
    cfg = cfgmod.load("tiny-cpu").with_overrides({"workload.data_file": str(SAMPLE), "rl.reward": reward})
    out = tmp_path / "run"
    res = _run(cfg, model_dir, 2, out)
    s = res.summary()
    assert s["reward_function"] == "row_reward.py:compute_score" and s["samples"]["lost"] == 0
    # the file's scores are the per-step rewards: group g is row g mod 16 (tiny-cpu's prompt_pool)
    expected = [np.mean([((g % 16) % 5) / 10 for g in groups]) for _, _, groups in res.view.batches]
    assert s["reward"] == pytest.approx(expected)
    # the output folder
    rows = tracking.load_metrics(out)
    assert list(rows.index) == [0, 1]
    missing = [k for k in ENGINE_METRICS if k not in rows]
    assert not missing, missing
    assert list(rows["critic/score/mean"]) == pytest.approx(s["reward"])
    assert (rows["prompt_length/max"] <= 46).all() and (rows["response_length/max"] <= 16).all()
    tags = set(tracking.read_tensorboard(out / tracking.TENSORBOARD_DIR)["tag"])
    assert set(ENGINE_METRICS) <= tags
    assert json.loads((out / tracking.SUMMARY_FILE).read_text())["reward"] == pytest.approx(s["reward"])
    assert any(e.get("name") == "generate" for e in json.loads((out / tracking.TRACE_FILE).read_text())["traceEvents"])


def test_a_reward_that_raises_stops_the_run_naming_the_function_and_the_sample(model_dir, ray_session, tmp_path):
    from bidirl.cluster.pool import ClusterError
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(16)))
    reward = _write(tmp_path / "bad_reward.py", RAISES)
    cfg = cfgmod.load("tiny-cpu").with_overrides({"workload.data_file": str(data), "rl.reward": reward})
    out = tmp_path / "run"
    with pytest.raises(ClusterError, match=r"worker \S*rollouter/\d failed: reward function "
                                           r"bad_reward.py:compute_score failed on group \d+, response \d+ "
                                           r"\(data_source 'sums', ground truth '\d+', response '.*'\): "
                                           r"raised ValueError: cannot parse the answer"):
        _run(cfg, model_dir, 1, out)
    # the failed run still leaves its trace; it has no summary
    assert (out / tracking.TRACE_FILE).exists() and not (out / tracking.SUMMARY_FILE).exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_run_with_address_auto_reaches_a_ray_start_head_cluster(model_dir, tmp_path):
    """``bidirl run --address auto --json --trace`` on a cluster of ``ray start --head --block``: it prints the CLI's
    contract (only the JSON object on stdout) and writes the trace and the output folder. The head runs in its own
    session, stopped by signalling that process group only (``ray stop`` would stop every Ray instance on the
    machine). The embedded-Ray path of ``bidirl run`` is the one ``tests/test_chaos.py`` kills and resumes."""
    ray_cli = Path(sys.executable).parent / "ray"
    port = _free_port()
    ray_tmp = tempfile.mkdtemp(prefix="ray")          # short: Ray's socket paths must stay under 108 bytes
    env = dict(os.environ, RAY_enable_metrics_collection="0")
    head = subprocess.Popen([str(ray_cli), "start", "--head", "--block", f"--port={port}", "--num-cpus=4",
                             '--resources={"gpu_slot": 4}', f"--temp-dir={ray_tmp}", "--include-dashboard=false",
                             "--disable-usage-stats"], env=env, start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines, started = [], threading.Event()

    def pump():
        for line in head.stdout:
            lines.append(line)
            if "Ray runtime started" in line:
                started.set()
    threading.Thread(target=pump, daemon=True).start()
    try:
        assert started.wait(300), "ray start --head did not start:\n" + "".join(lines)[-3000:]
        data = tmp_path / "sums.jsonl"
        data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": 2 * i}) + "\n" for i in range(16)))
        out = tmp_path / "run"
        run_env = dict(env, BIDIRL_CACHE=str(model_dir.parent), RAY_ADDRESS=f"127.0.0.1:{port}")
        trace = tmp_path / "run.json"
        cmd = [sys.executable, "-m", "bidirl.cli", "run", "tiny-cpu", "--steps", "1", "--address", "auto",
               "--data-file", str(data), "--reward", "last_number", "--out", str(out), "--json",
               "--trace", str(trace)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=run_env, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        s = json.loads(done.stdout)     # stdout holds the JSON object only (Ray's own output goes to stderr)
        # the CLI's contract (the keys outside checks read)
        for key in ("policy", "throughput", "step_times", "idle", "utilization", "borrows", "samples", "costs",
                    "reward", "train", "startup", "weight_sync"):
            assert key in s, key
        assert s["emulated"] is False and s["policy"] == "bidirl" and len(s["step_times"]) == 1
        assert all(0.0 <= r <= 1.0 for r in s["reward"])
        events = json.loads(trace.read_text())
        assert any(e.get("name") == "generate" for e in events["traceEvents"]), "the trace holds the generation spans"
        # the user's inputs and outputs
        assert s["data_file"] == str(data) and s["reward_function"] == "last_number" and len(s["reward"]) == 1
        assert s["out_dir"] == str(out) and s["samples"]["lost"] == 0
        assert len(tracking.load_metrics(out)) == 1
        assert set(ENGINE_METRICS) <= set(tracking.read_tensorboard(out / tracking.TENSORBOARD_DIR)["tag"])
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(60)
        try:                                          # stragglers of the group (workers that outlive the head)
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        import shutil
        shutil.rmtree(ray_tmp, ignore_errors=True)
