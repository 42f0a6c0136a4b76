"""The event log: record validation, fixed-schema tables, Chrome trace export, files, fingerprints."""

import json
import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings, strategies as st

from bidirl.results.trace import (DECISION_COLUMNS, SPAN_COLUMNS, STEP_COLUMNS, Decision, EventLog, Span, StepRecord,
                                  lane_order)

R0, R1 = "rollout_pool/rollouter/0", "rollout_pool/rollouter/1"
TR, AUX_R, AUX_T = "trainer_pool/trainer", "trainer_pool/rollouter/0", "rollout_pool/trainer"


def small_log() -> EventLog:
    log = EventLog()
    log.add_span(Span(R0, "rollout_pool", "primary", "generate", 0.0, 5.0, 0, 0, {}))
    log.add_span(Span(R1, "rollout_pool", "primary", "generate", 1.0, 3.0, 0, 0, {}))
    log.add_span(Span(TR, "trainer_pool", "primary", "chunk", 5.0, 8.0, 0, 0,
                      {"stage": "actor_update", "chunk_id": 3, "samples": 4}))
    log.add_span(Span(AUX_R, "trainer_pool", "auxiliary", "switch_in", 8.0, 9.0, 1, 1,
                      {"direction": "rollout_on_trainer_pool"}))
    log.add_span(Span(AUX_R, "trainer_pool", "auxiliary", "generate", 9.0, 12.0, 1, 1, {}))
    log.add_span(Span(AUX_R, "trainer_pool", "auxiliary", "switch_out", 12.0, 13.0, 1, 1,
                      {"direction": "rollout_on_trainer_pool"}))
    log.add_span(Span(TR, "trainer_pool", "primary", "sync", 13.0, 13.5, 1, 1, {"version": 2}))
    for i in range(3):
        log.add_step(StepRecord(i, 5.0 * i, 5.0 * i + 5.0, 100 + i, 4, 1.0, 4.0, i + 1))
    log.add_decision(Decision(8.0, "rollout_on_trainer_pool", True, 2.0, 1.5, {"deficit": 3}))
    log.add_decision(Decision(10.0, "trainer_on_rollout_pool", False, -1.0, 2.0, {}))
    return log


# ---------------------------------------------------------------------------------------------- validation

@pytest.mark.parametrize("field,kwargs", [
    ("end", {"start": 2.0, "end": 1.0}),
    ("kind", {"kind": "decode"}),
    ("role", {"role": "helper"}),
    ("pool", {"pool": "gpu_pool"}),
    ("start", {"start": float("nan")}),
    ("worker", {"worker": "trainer_pool/trainer"}),   # a trainer-pool worker on the rollout pool
    ("step", {"step": 1.5}),
])
def test_bad_span_raises_naming_the_field(field, kwargs):
    base = dict(worker=R0, pool="rollout_pool", role="primary", kind="generate", start=0.0, end=1.0, step=0,
                version=0, detail={})
    with pytest.raises(ValueError, match=rf"Span\.{field}"):
        Span(**{**base, **kwargs})


def test_zero_length_span_and_numpy_inputs_are_accepted():
    s = Span(R0, "rollout_pool", "primary", "generate", np.float64(2.0), np.float32(2.0), np.int64(3), 4, {})
    assert s.start == 2.0 and s.end == 2.0 and s.duration == 0.0
    assert type(s.start) is float and type(s.step) is int


def test_bad_step_and_decision_raise_naming_the_field():
    with pytest.raises(ValueError, match=r"StepRecord\.end"):
        StepRecord(0, 5.0, 4.0, 10, 1)
    with pytest.raises(ValueError, match=r"StepRecord\.tokens"):
        StepRecord(0, 0.0, 4.0, -1, 1)
    with pytest.raises(ValueError, match=r"Decision\.direction"):
        Decision(1.0, "sideways", True, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"Decision\.t"):
        Decision(float("inf"), "rollout_on_trainer_pool", True, 1.0, 1.0)


def test_log_rejects_records_of_the_wrong_type():
    log = EventLog()
    with pytest.raises(ValueError, match="Span"):
        log.add_span(StepRecord(0, 0.0, 1.0, 1, 1))
    with pytest.raises(ValueError, match="EventLog.add"):
        log.add("span")
    with pytest.raises(ValueError, match="EventLog.spans"):
        EventLog(spans=[StepRecord(0, 0.0, 1.0, 1, 1)])


# ---------------------------------------------------------------------------------------------- tables

def _dtypes(df):
    return {c: str(t) for c, t in df.dtypes.items()}


@pytest.mark.parametrize("log", [EventLog(), small_log()], ids=["empty", "small"])
def test_tables_have_fixed_columns_and_dtypes(log):
    assert _dtypes(log.spans_df()) == SPAN_COLUMNS
    assert _dtypes(log.steps_df()) == STEP_COLUMNS
    assert _dtypes(log.decisions_df()) == DECISION_COLUMNS


def test_tables_hold_the_records():
    log = small_log()
    spans = log.spans_df()
    assert len(spans) == 7 and spans["end"].sum() == 5 + 3 + 8 + 9 + 12 + 13 + 13.5
    assert spans.loc[2, "detail"] == {"stage": "actor_update", "chunk_id": 3, "samples": 4}
    assert log.steps_df()["tokens"].tolist() == [100, 101, 102]
    assert log.decisions_df()["admitted"].tolist() == [True, False]


def test_extend_accepts_a_log_or_records():
    a, b = small_log(), EventLog()
    b.extend(a)
    assert (len(b.spans), len(b.steps), len(b.decisions)) == (7, 3, 2)
    b.extend([Span(R0, "rollout_pool", "primary", "generate", 20.0, 21.0), StepRecord(3, 15.0, 20.0, 1, 1)])
    assert (len(b.spans), len(b.steps), len(b)) == (8, 4, 14)


# ---------------------------------------------------------------------------------------------- Chrome trace

def test_chrome_trace_is_valid_json_with_one_event_per_record(tmp_path):
    log = small_log()
    path = log.save(tmp_path / "trace.json")
    trace = json.loads(path.read_text())
    assert trace == json.loads(json.dumps(log.to_chrome_trace()))
    events = trace["traceEvents"]
    by_phase = pd.Series([e["ph"] for e in events]).value_counts().to_dict()
    workers = {s.worker for s in log.spans}
    assert by_phase["X"] == len(log.spans)
    assert by_phase["i"] == len(log.decisions) + len(log.steps)
    assert by_phase["M"] == 2 * 2 + 2 * len(workers)      # name + sort index per pool and per worker
    processes = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
    assert set(processes) == {"rollout_pool", "trainer_pool"} and len(set(processes.values())) == 2
    threads = {e["args"]["name"]: (e["pid"], e["tid"]) for e in events if e["name"] == "thread_name"}
    assert set(threads) == workers
    assert threads[AUX_R][0] == processes["trainer_pool"] and threads[R1][0] == processes["rollout_pool"]
    chunk = next(e for e in events if e["ph"] == "X" and e["name"].startswith("chunk"))
    assert chunk["ts"] == 5.0e6 and chunk["dur"] == 3.0e6 and chunk["name"] == "chunk:actor_update"
    assert chunk["tid"] == threads[TR][1] and chunk["args"]["chunk_id"] == 3
    step_ends = sorted(e["ts"] for e in events if e.get("cat") == "step")
    assert step_ends == [5.0e6, 10.0e6, 15.0e6]


def test_chrome_trace_of_nonfinite_detail_is_still_strict_json():
    log = EventLog()
    log.add_decision(Decision(1.0, "trainer_on_rollout_pool", False, float("inf"), 1.0, {"t_no": float("nan")}))
    json.dumps(log.to_chrome_trace(), allow_nan=False)


# ---------------------------------------------------------------------------------------------- files

@pytest.mark.parametrize("ext", ["parquet", "csv"])
def test_save_load_round_trip(tmp_path, ext):
    log = small_log()
    log.add_decision(Decision(11.0, "trainer_on_rollout_pool", False, float("inf"), 0.1, {"ids": (1, 2)}))
    path = log.save(tmp_path / f"run.{ext}")
    back = EventLog.load(path)
    assert back.fingerprint() == log.fingerprint()
    pd.testing.assert_frame_equal(back.spans_df(), log.spans_df())
    pd.testing.assert_frame_equal(back.steps_df(), log.steps_df())
    assert math.isinf(back.decisions[-1].predicted_gain) and back.decisions[-1].detail == {"ids": [1, 2]}


def test_empty_log_round_trips(tmp_path):
    for ext in ("parquet", "csv"):
        back = EventLog.load(EventLog().save(tmp_path / f"empty.{ext}"))
        assert len(back) == 0 and _dtypes(back.spans_df()) == SPAN_COLUMNS


def test_csv_spans_file_is_a_plain_spans_table(tmp_path):
    path = small_log().save(tmp_path / "run.csv")
    df = pd.read_csv(path)
    assert list(df.columns) == list(SPAN_COLUMNS) and len(df) == 7
    assert (tmp_path / "run.steps.csv").exists() and (tmp_path / "run.decisions.csv").exists()


def test_file_format_errors(tmp_path):
    with pytest.raises(ValueError, match=r"\.json.*\.parquet.*\.csv"):
        small_log().save(tmp_path / "run.txt")
    path = small_log().save(tmp_path / "run.json")
    with pytest.raises(ValueError, match="export-only"):
        EventLog.load(path)
    with pytest.raises(FileNotFoundError):
        EventLog.load(tmp_path / "missing.parquet")


# ---------------------------------------------------------------------------------------------- fingerprint

def test_fingerprint_equal_for_equal_logs_and_different_when_a_span_changes():
    a, b = small_log(), small_log()
    assert a.fingerprint() == b.fingerprint()
    s = b.spans[2]
    b.spans[2] = Span(s.worker, s.pool, s.role, s.kind, s.start, s.end + 1e-3, s.step, s.version, s.detail)
    assert a.fingerprint() != b.fingerprint()
    c = small_log()
    c.spans[2] = Span(s.worker, s.pool, s.role, s.kind, s.start, s.end, s.step, s.version, {**s.detail, "samples": 5})
    assert a.fingerprint() != c.fingerprint()
    d = small_log()
    d.steps.pop()
    assert a.fingerprint() != d.fingerprint()


def test_fingerprint_ignores_float_noise_below_a_nanosecond():
    a, b = small_log(), small_log()
    s = b.spans[0]
    b.spans[0] = Span(s.worker, s.pool, s.role, s.kind, s.start, s.end + 1e-13, s.step, s.version, s.detail)
    assert a.fingerprint() == b.fingerprint()


@settings(max_examples=30, deadline=None)
@given(st.randoms(use_true_random=False))
def test_fingerprint_is_independent_of_append_order(rnd):
    a = small_log()
    spans, steps, decisions = list(a.spans), list(a.steps), list(a.decisions)
    rnd.shuffle(spans), rnd.shuffle(steps), rnd.shuffle(decisions)
    assert EventLog(spans, steps, decisions).fingerprint() == a.fingerprint()


def test_lane_order_groups_by_pool_primaries_first_numeric_indices():
    workers = ["trainer_pool/rollouter/10", "trainer_pool/rollouter/2", TR, AUX_T,
               "rollout_pool/rollouter/10", R1, R0]
    assert lane_order(workers) == [R0, R1, "rollout_pool/rollouter/10", AUX_T, TR, "trainer_pool/rollouter/2",
                                   "trainer_pool/rollouter/10"]
