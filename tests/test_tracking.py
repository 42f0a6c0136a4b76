"""Per-step metrics under veRL's names from a run's event log, and the JSONL / TensorBoard files they go to
(unit tests on simulated runs, no Ray)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from bidirl.core import protocol as P
from bidirl.job import config as cfgmod
from bidirl.results import metrics, tracking
from bidirl.sim import simulate

VERL_TIMING = ("timing_s/step", "timing_s/gen", "timing_s/old_log_prob", "timing_s/ref", "timing_s/update_actor",
               "perf/throughput", "perf/total_num_tokens", "fully_async/trainer/idle_ratio",
               "fully_async/rollouter/idle_ratio")


@pytest.fixture(scope="module")
def borrowing_run():
    """The paper's A6000 job: borrows in both directions within six steps."""
    return simulate("a6000-default", "bidirl", steps=6, seed=0)


def test_every_step_gets_one_row_with_verls_timing_names(borrowing_run):
    rows = tracking.step_metrics(borrowing_run)
    s = borrowing_run.summary()
    assert [r["step"] for r in rows] == list(range(6))
    assert [r["training/global_step"] for r in rows] == list(range(1, 7))
    for row in rows:
        missing = [k for k in VERL_TIMING if k not in row]
        assert not missing, missing
        assert 0.0 <= row["fully_async/trainer/idle_ratio"] <= 1.0
        # a pool-union idle is (idle seconds) / (window seconds), both sums of a few hundred span ends < 1e3 s: each
        # is off by ≤ ~1e3 · 2⁻⁵² · 300 ≈ 7e-11 s, so the ratio of a window ≥ 1 s strays ≤ ~1e-10 past [0, 1]: 1e-9.
        # The rollouter's idle ratio counts a second as idle when no primary rollouter generates, the union only when
        # no worker of the pool does anything (generation is a part of the pool's busy time), so it is never below
        # the union (same 1e-9 for the two sums' rounding); the rename to idle_pool_union left
        # both bounds unchanged, and test_idle_labels.py shows the GPU-weighted figure (0.75) differs from the
        # union one (0.0) where a key mix-up would pass unnoticed here
        for pool in P.POOLS:
            assert 0.0 <= row[f"bidirl/idle_pool_union/{pool}"] <= 1.0 + 1e-9
        assert row["fully_async/rollouter/idle_ratio"] >= row[f"bidirl/idle_pool_union/{P.ROLLOUT_POOL}"] - 1e-9
    assert np.allclose([r["timing_s/step"] for r in rows], s["step_times"])
    steps = borrowing_run.log.steps_df()
    for row, rec in zip(rows, steps.itertuples()):
        assert row["timing_s/gen"] == pytest.approx(rec.wait)
        assert row["fully_async/trainer/idle_ratio"] == pytest.approx(rec.wait / row["timing_s/step"])
        assert row["perf/throughput"] == pytest.approx(rec.tokens / (row["timing_s/step"] * 16))
        assert row["bidirl/throughput"] == pytest.approx(rec.tokens / row["timing_s/step"])


def test_stage_times_are_the_steps_chunk_times(borrowing_run):
    rows = tracking.step_metrics(borrowing_run)
    spans = borrowing_run.log.spans_df()
    chunks = spans[spans["kind"] == "chunk"]
    for row in rows:
        mine = chunks[chunks["step"] == row["step"]]
        for stage, name in tracking.STAGE_TIMING.items():
            picked = mine[[d["stage"] == stage for d in mine["detail"]]]
            assert row[name] == pytest.approx(float((picked["end"] - picked["start"]).sum()))


def test_borrows_and_switch_costs_per_step_add_up_to_the_run(borrowing_run):
    rows = tracking.step_metrics(borrowing_run)
    borrows = borrowing_run.summary()["borrows"]
    for direction in P.DIRECTIONS:
        assert sum(r[f"bidirl/borrows/{direction}/admitted"] for r in rows) == borrows[direction] > 0
    assert sum(r[f"bidirl/borrows/{d}/rejected"] for r in rows for d in P.DIRECTIONS) == borrows["rejected"]
    switch_keys = {k for r in rows for k in r if k.startswith("bidirl/switch_s/")}
    for direction in P.DIRECTIONS:
        assert {f"bidirl/switch_s/{direction}/c_in", f"bidirl/switch_s/{direction}/c_out"} <= switch_keys
    assert all(r[k] > 0 for r in rows for k in r if k.startswith("bidirl/switch_s/"))


def test_a_run_whose_pools_never_borrow_reports_no_switch_costs():
    rows = tracking.step_metrics(simulate("a6000-default", "no-borrow", steps=3, seed=0))
    assert not any(k.startswith("bidirl/switch_s/") for r in rows for k in r)
    assert all(r[f"bidirl/borrows/{d}/admitted"] == 0 for r in rows for d in P.DIRECTIONS)


def test_train_statistics_become_verls_actor_and_data_metrics(borrowing_run):
    train = [{"step": k, "reward": 0.5, "reward_max": 1.0, "reward_min": 0.0, "response_length": 7.5,
              "response_length_max": 16, "response_length_min": 2, "response_clip_ratio": 0.25,
              "prompt_length": 5.0, "prompt_length_max": 6, "prompt_length_min": 4, "pg_loss": -0.1, "kl": 0.01,
              "clip_frac": 0.02, "grad_norm": 1.5, "logprob_diff_max": None} for k in range(6)]
    rows = tracking.metrics_from_log(borrowing_run.log, config=borrowing_run.config, train=train)
    row = rows[2]
    assert row["critic/score/mean"] == 0.5 and row["critic/score/max"] == 1.0
    assert row["response_length/mean"] == 7.5 and row["response_length/clip_ratio"] == 0.25
    assert row["prompt_length/mean"] == 5.0 and row["actor/pg_loss"] == -0.1 and row["actor/pg_clipfrac"] == 0.02
    assert row["actor/grad_norm"] == 1.5 and row["actor/lr"] == borrowing_run.config.rl.lr
    assert row["actor/kl_loss"] == 0.01                       # the A6000 job has a reference model
    assert "bidirl/rollout_logprob_diff_max" not in row        # None: no value, no key
    no_ref = borrowing_run.config.with_overrides({"rl.reference_model": False})
    assert "actor/kl_loss" not in tracking.metrics_from_log(borrowing_run.log, config=no_ref, train=train)[2]


def test_rows_written_while_a_run_goes_on_equal_the_rows_of_the_finished_log(tmp_path):
    """LiveStepMetrics cuts the log two steps back; what it writes is what step_metrics computes at the end."""
    from bidirl.runtime.driver import RunListener
    from bidirl.sim.driver import SimDriver

    class Rows(RunListener):                              # what the Ray drivers hang on a run for --out
        def __init__(self, metrics):
            self.metrics = metrics

        def on_report(self, driver, report):
            if isinstance(report, P.StepDone):
                self.metrics.step_done(driver.log, [])

    cfg = cfgmod.load("a6000-default")
    driver = SimDriver(cfg, "bidirl", 8, 0)
    rows = driver.add_listener(Rows(tracking.LiveStepMetrics(tracking.RunOutput(tmp_path, cfg), cfg, list(P.POOLS))))
    result = driver.run()
    assert rows.metrics.written == 7                      # the last step waits for the end of the run
    rows.metrics.close(result.log, [], result.summary())
    live = tracking.load_metrics(tmp_path)
    offline = tracking.step_metrics(result)
    assert len(live) == 8
    for row in offline:
        got = live.loc[row["step"]].dropna().to_dict()
        assert set(got) == set(row) - {"step"}
        for key, value in row.items():
            if key != "step":
                assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key


def test_the_output_folder_holds_jsonl_tensorboard_trace_and_summary(tmp_path, borrowing_run):
    out = tracking.write_run(borrowing_run, tmp_path / "run")
    names = {p.name for p in out.iterdir()}
    assert {tracking.METRICS_FILE, tracking.TENSORBOARD_DIR, tracking.TRACE_FILE, tracking.EVENTS_FILE,
            tracking.SUMMARY_FILE, tracking.CONFIG_FILE} <= names
    rows = [json.loads(line) for line in (out / tracking.METRICS_FILE).read_text().splitlines()]
    assert rows == json.loads(json.dumps(tracking.step_metrics(borrowing_run)))
    frame = tracking.load_metrics(out)
    assert list(frame.index) == list(range(6)) and "timing_s/step" in frame
    board = tracking.read_tensorboard(out / tracking.TENSORBOARD_DIR)
    tags = set(board["tag"])
    assert set(VERL_TIMING) <= tags and "step" not in tags
    step_times = board[board["tag"] == "timing_s/step"].sort_values("step")
    assert list(step_times["step"]) == list(range(1, 7))
    assert np.allclose(step_times["value"], frame["timing_s/step"], rtol=1e-6)
    assert json.loads((out / tracking.SUMMARY_FILE).read_text())["policy"] == "bidirl"
    assert "traceEvents" in json.loads((out / tracking.TRACE_FILE).read_text())
    assert cfgmod.load(out / tracking.CONFIG_FILE) == borrowing_run.config
    from bidirl.results.trace import EventLog
    assert EventLog.load(out / tracking.EVENTS_FILE).fingerprint() == borrowing_run.log.fingerprint()


def test_non_finite_values_are_left_out_of_the_files(tmp_path):
    rows = [{"step": 0, "training/global_step": 1, "a": 1.0, "b": math.nan, "c": math.inf}]
    tracking.write_jsonl(rows, tmp_path / "m.jsonl")
    assert json.loads((tmp_path / "m.jsonl").read_text()) == {"step": 0, "training/global_step": 1, "a": 1.0}
    tracking.write_tensorboard(rows, tmp_path / "tb")
    assert set(tracking.read_tensorboard(tmp_path / "tb")["tag"]) == {"training/global_step", "a"}


def test_default_output_folders_never_collide(tmp_path):
    first = tracking.default_out_dir(tmp_path)
    assert first.parent == tmp_path and first.name.startswith("run-")
    first.mkdir()
    second = tracking.default_out_dir(tmp_path)
    assert second != first and second.name.startswith(first.name)


def test_an_unwritable_output_folder_is_named(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(tracking.OutputError, match="cannot write the run's outputs to"):
        tracking.RunOutput(blocker / "run")


def test_an_output_folder_is_never_shared_by_two_runs(tmp_path, borrowing_run):
    tracking.write_run(borrowing_run, tmp_path / "run")
    with pytest.raises(tracking.OutputError, match="already holds a run's metrics"):
        tracking.write_run(borrowing_run, tmp_path / "run")
    with pytest.raises(tracking.OutputError, match="is a file"):
        tracking.check_out_dir(tmp_path / "run" / tracking.SUMMARY_FILE)
    assert tracking.check_out_dir(tmp_path / "new") == tmp_path / "new" and not (tmp_path / "new").exists()


def test_load_metrics_names_a_folder_without_metrics(tmp_path):
    with pytest.raises(FileNotFoundError, match="--out"):
        tracking.load_metrics(tmp_path)


def test_metrics_agree_with_the_run_summary_on_a_colocated_baseline():
    """Any RunResult works: the modelled veRL colocated baseline has no borrowing and one pool."""
    cfg = cfgmod.load("a6000-default").with_overrides({"rl.staleness": 0})
    res = simulate(cfg, "verl-colocated", steps=3, seed=0)
    rows = tracking.step_metrics(res)
    assert np.allclose([r["timing_s/step"] for r in rows], metrics.step_times(res.log))
