"""Real engine runs on the user's data and reward, tracked to an output folder.

Integration tests (``-m integration``): ``tiny-cpu`` (four vLLM engines, two trainer gangs) for one or two steps
on the session's kept workers (``tests/engine_jobs.py``: the shared worker shape; the reward is set by the
workers' reset).

* the shipped veRL-layout parquet drives a run scored by a ``compute_score`` file given by path, whose scores
  are the per-step rewards, and the run's output folder holds JSONL and TensorBoard metrics under veRL's names;
* a reward function that raises stops the run with a ``ClusterError`` naming it and the sample.

``bidirl run --address auto`` joining a running Ray, its JSON contract and trace are checked by the
driver-death test of ``tests/test_chaos.py``; ``tests/test_run_inputs.py`` checks that ``--data-file`` and
``--reward`` reach the job (a bad value of either is named).
"""

from __future__ import annotations

import importlib.util
import json
import textwrap
from pathlib import Path

import numpy as np
import pytest

from bidirl.results import tracking

import engine_jobs

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
                  "bidirl/idle_pool_union/rollout_pool", "bidirl/idle_pool_union/trainer_pool")

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


def _run(cfg, model_dir, kept_workers, steps, out_dir=None):
    from bidirl.cluster.engines.driver import EngineDriver
    return EngineDriver(cfg, "bidirl", steps, cfg.seed, model_dir=str(model_dir), out_dir=out_dir,
                        kept_workers=kept_workers).run()


def test_a_verl_parquet_and_a_compute_score_file_drive_a_tracked_run(model_dir, kept_workers, tmp_path):
    reward = _write(tmp_path / "row_reward.py", SCORE_BY_ROW)
    cfg = engine_jobs.borrowing(**{"workload.data_file": str(SAMPLE), "rl.reward": reward})
    out = tmp_path / "run"
    res = _run(cfg, model_dir, kept_workers, 2, out)
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


def test_a_reward_that_raises_stops_the_run_naming_the_function_and_the_sample(model_dir, kept_workers, tmp_path):
    from bidirl.cluster.pool import ClusterError
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(16)))
    reward = _write(tmp_path / "bad_reward.py", RAISES)
    cfg = engine_jobs.borrowing(**{"workload.data_file": str(data), "rl.reward": reward})
    out = tmp_path / "run"
    with pytest.raises(ClusterError, match=r"worker \S*rollouter/\d raised in \S+: reward function "
                                           r"bad_reward.py:compute_score failed on group \d+, response \d+ "
                                           r"\(data_source 'sums', ground truth '\d+', response '.*'\): "
                                           r"raised ValueError: cannot parse the answer"):
        _run(cfg, model_dir, kept_workers, 1, out)
    # the failed run still leaves its trace; it has no summary
    assert (out / tracking.TRACE_FILE).exists() and not (out / tracking.SUMMARY_FILE).exists()
