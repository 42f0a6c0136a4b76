"""Every admitted borrowing window answers for itself: the work it ran or why it ran none (bidirl.results.windows)."""

from __future__ import annotations

import pytest

import bidirl.job.config as cfgmod
from bidirl.core.protocol import Decision, StepRecord
from bidirl.results.trace import EventLog, Span
from bidirl.results.windows import (NO_SWITCH_IN, NOT_HANDED, PRIMARIES_FIRST, SCHEDULER_SAID, WINDOW_COLUMNS,
                                    borrow_windows, idle_windows_text)
from bidirl.sim import simulate

ROT, TOR = "rollout_on_trainer_pool", "trainer_on_rollout_pool"


def _switch(pool: str, worker: str, role: str, kind: str, start: float, end: float, direction: str) -> Span:
    return Span(worker, pool, role, kind, start, end, detail={"direction": direction})


def test_each_admitted_window_of_a_simulation_has_a_record_with_its_work():
    # the §7.3 ablation split at s = 0: both windows open in every step (notebook 03's job)
    cfg = cfgmod.load("a6000-default").with_overrides({"cluster.partition": [4, 12], "cluster.placement": "any",
                                                       "workload.prompts_per_step": 60, "rl.staleness": 0})
    run = simulate(cfg, "bidirl", steps=3, seed=0)
    decisions = run.log.decisions_df()
    windows = borrow_windows(run)
    assert list(windows.columns) == list(WINDOW_COLUMNS)
    assert len(windows) == int(decisions["admitted"].sum()) > 0
    assert set(windows["direction"]) == {ROT, TOR}
    # a record holds work or a reason, never both, never neither
    assert ((windows["work_spans"] > 0) != (windows["reason"] != "")).all(), windows
    # the simulator only admits windows whose work is still open after the switch: each ran borrowed work
    assert (windows["work_spans"] > 0).all() and (windows["work_s"] > 0).all(), windows
    spans = run.log.spans_df()
    aux = spans[(spans["role"] == "auxiliary") & spans["kind"].isin(["generate", "chunk"])]
    assert windows["work_spans"].sum() == len(aux)          # every borrowed work span belongs to one window
    assert (windows["start"] < windows["end"]).all()
    assert idle_windows_text(windows).startswith(f"{len(windows)} of {len(windows)} admitted windows ran")


def test_a_window_revoked_with_no_work_carries_the_schedulers_reason():
    # opportunistic borrowing (no cost gate) on the tiny job: the trainer pool is lent whenever it idles, and the
    # two primaries often complete the batch (16 groups of ~3 tokens) before the 0.075 s switch in ends
    cfg = cfgmod.load("tiny-cpu")
    run = simulate(cfg, "opportunistic", steps=4, seed=0)
    windows = borrow_windows(run)
    empty = windows[windows["work_spans"] == 0]
    assert len(empty) > 0 and ((windows["work_spans"] > 0) != (windows["reason"] != "")).all(), windows
    assert set(empty["reason"]) == {SCHEDULER_SAID}
    assert all(e.startswith("the primaries had completed the batch when the switch in ended")
               for e in empty["explanation"]), list(empty["explanation"])
    # the reason travels in the switch out's detail only where the window sent its guests nothing
    spans = run.log.spans_df()
    said = spans[spans["kind"] == "switch_out"]["detail"].map(lambda d: bool(d.get("no_work")))
    assert int(said.sum()) == len(empty)


def _log(*records) -> EventLog:
    log = EventLog()
    for r in records:
        log.add(r)
    return log


def test_a_window_whose_batch_the_primaries_finished_during_the_switch_says_so():
    # the batch of step 0 was complete at 0 + 10.5 s; the switch-in ran 10.0–11.0 s, the lease was revoked at once
    log = _log(Decision(10.0, ROT, True, 2.0, 1.5, {"step": 0}),
               _switch("trainer_pool", "trainer_pool/rollouter/0", "auxiliary", "switch_in", 10.0, 11.0, ROT),
               _switch("trainer_pool", "trainer_pool/trainer", "primary", "switch_out", 11.0, 11.5, ROT),
               StepRecord(0, 0.0, 20.0, 100, 8, wait=10.5, consume=9.5, version=1),
               Decision(30.0, ROT, False, 0.1, 1.5, {"step": 1}))          # rejected: no window, no record
    w = borrow_windows(log)
    assert len(w) == 1
    row = w.iloc[0]
    assert row["reason"] == PRIMARIES_FIRST and row["work_spans"] == 0 and row["work_s"] == 0.0
    assert row["switch_in_s"] == pytest.approx(1.0) and row["switch_out_s"] == pytest.approx(0.5)
    assert "t = 10.50 s, 0.50 s before the 1.00 s switch-in" in row["explanation"]
    assert idle_windows_text(w) == f"0 of 1 admitted windows ran borrowed work; none in 1 ({PRIMARIES_FIRST})"


def test_a_window_with_work_still_open_but_none_handed_over_and_one_never_switched_in():
    # training on the rollout pool: the primaries' last chunk of step 0 ends at 30 s, after the switch-in (12 s)
    log = _log(Decision(10.0, TOR, True, 5.0, 2.0, {"step": 0}),
               _switch("rollout_pool", "rollout_pool/trainer", "auxiliary", "switch_in", 10.0, 12.0, TOR),
               _switch("rollout_pool", "rollout_pool/rollouter/0", "primary", "switch_out", 12.9, 13.5, TOR),
               Span("trainer_pool/trainer", "trainer_pool", "primary", "chunk", 10.0, 30.0, step=0,
                    detail={"stage": "actor_update", "chunk_id": 1, "samples": 8}),
               Decision(40.0, TOR, True, 5.0, 2.0, {"step": 1}))       # the run ended before its switch-in
    w = borrow_windows(log)
    assert list(w["reason"]) == [NOT_HANDED, NO_SWITCH_IN]
    assert "still open" in w.iloc[0]["explanation"]
    # the same window with an auxiliary chunk after the switch-in holds that work instead
    log.add(Span("rollout_pool/trainer", "rollout_pool", "auxiliary", "chunk", 12.0, 12.8, step=0,
                 detail={"stage": "actor_update", "chunk_id": 2, "samples": 8}))
    w = borrow_windows(log)
    assert w.iloc[0]["reason"] == "" and w.iloc[0]["work_spans"] == 1
    assert w.iloc[0]["work_s"] == pytest.approx(0.8) and w.iloc[0]["work"] == "1 trainer chunks (actor_update 1)"


def test_borrow_windows_refuses_what_is_not_an_event_log():
    with pytest.raises(TypeError, match="EventLog"):
        borrow_windows({"spans": []})
