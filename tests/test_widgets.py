"""Widget state without a browser: controls change, chart data follows the library's answers.

Widgets construct in plain pytest (the ``comm`` package's default comm drops messages). What a browser would
receive is observed by wrapping the figure's message senders: a batched update is one ``_send_update_msg``.
"""

from __future__ import annotations

import numpy as np
import pytest

import bidirl.config as cfgmod
from bidirl.trace import EventLog, Span
from bidirl.viz import TRACE_KEYS, spans_to_bars
from bidirl.widgets import LiveGantt, MetricsPanel, PartitionSweep, summary_table

TINY = "tiny-cpu"


def _log(n: int, t0: float = 0.0) -> EventLog:
    """A small, hand-made event log: generation on a rollouter, chunks on the trainer, one borrow window."""
    log = EventLog()
    for i in range(n):
        a = t0 + 2.0 * i
        log.add_span(Span(worker="rollout_pool/rollouter/0", pool="rollout_pool", role="primary", kind="generate",
                          start=a, end=a + 1.5, step=i, version=i, detail={}))
        log.add_span(Span(worker="trainer_pool/trainer", pool="trainer_pool", role="primary", kind="chunk",
                          start=a + 1.0, end=a + 2.0, step=i, version=i, detail={}))
    return log


def _f(values) -> np.ndarray:
    """A trace's array as float64 (plotly keeps ``base`` as an object array)."""
    return np.asarray(values, dtype=np.float64)


class Messages:
    """Counts what a FigureWidget would send to the browser."""

    def __init__(self, fig, monkeypatch):
        self.sent = {"update": 0, "restyle": 0, "relayout": 0, "addTraces": 0, "deleteTraces": 0}
        for kind in self.sent:
            name = f"_send_{kind}_msg"
            original = getattr(fig, name)

            def wrapped(*args, _kind=kind, _original=original, **kwargs):
                self.sent[_kind] += 1
                return _original(*args, **kwargs)
            monkeypatch.setattr(fig, name, wrapped)


class FakeClock:
    """Wall clock that advances a fixed amount per reading (so throttling is deterministic)."""

    def __init__(self, step: float):
        self.t, self.step = 0.0, step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


# --------------------------------------------------------------------------------------------------
# LiveGantt
# --------------------------------------------------------------------------------------------------

def test_live_gantt_creates_every_trace_up_front():
    g = LiveGantt(labels=("bidirl", "no-borrow"))
    assert len(g.figure.data) == 2 * len(TRACE_KEYS)
    assert all(len(t.x) == 0 for t in g.figure.data)
    # one legend entry per (kind, role): only the first row shows them
    assert sum(bool(t.showlegend) for t in g.figure.data) == len(TRACE_KEYS)
    # rows share one time axis
    axes = [k for k in g.figure.layout if k.startswith("xaxis")]
    assert len(axes) == 2
    assert {g.figure.layout[a].matches for a in axes} - {None} == {"x2"}


def test_live_gantt_update_adds_only_new_spans_in_one_message(monkeypatch):
    g = LiveGantt(labels=("a",))
    traces = list(g.figure.data)
    msgs = Messages(g.figure, monkeypatch)
    log = _log(3)
    assert g.update(log) == 6
    assert msgs.sent["update"] == 1
    assert g.update(log) == 0                                   # nothing new: plotly sends nothing either
    assert msgs.sent["update"] == 1
    for i in range(3, 5):                                       # the log grows
        log.extend(_log(1, t0=2.0 * i))
    assert g.update(log) == 4
    assert msgs.sent["update"] == 2 and msgs.sent["restyle"] == msgs.sent["relayout"] == 0
    assert msgs.sent["addTraces"] == 0
    assert list(g.figure.data) == traces                        # same trace objects: no full redraw
    expected = spans_to_bars(log.spans_df(), g.states["a"].lanes)
    for trace, key in zip(g.figure.data, TRACE_KEYS):
        if key in expected:
            np.testing.assert_allclose(_f(trace.base), expected[key]["base"])
            np.testing.assert_allclose(_f(trace.x), expected[key]["x"])
            np.testing.assert_allclose(_f(trace.y), expected[key]["y"])
        else:
            assert len(trace.x) == 0
    assert list(g.figure.layout.yaxis.ticktext) == ["rollout_pool/rollouter/0", "trainer_pool/trainer"]


def test_live_gantt_follows_a_growing_log_at_a_bounded_redraw_rate():
    clock = [0.0]
    g = LiveGantt(labels=("run",), clock=lambda: clock[0])
    log = _log(2)
    on_event = g.follow(log, refresh_hz=2.0)
    r0 = g.redraws
    on_event("an event")
    assert g.redraws == r0 + 1 and g._seen["run"] == 4
    log.extend(_log(1, t0=10.0))
    clock[0] = 0.2
    on_event("too soon")
    assert g.redraws == r0 + 1 and g._seen["run"] == 4
    clock[0] = 0.6
    on_event("later")
    assert g.redraws == r0 + 2 and g._seen["run"] == 6
    with pytest.raises(ValueError, match="no row"):
        g.follow(log, label="other")
    with pytest.raises(ValueError, match="refresh_hz"):
        g.follow(log, refresh_hz=0)


def test_live_gantt_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one label"):
        LiveGantt(labels=())
    with pytest.raises(ValueError, match="distinct"):
        LiveGantt(labels=("a", "a"))
    g = LiveGantt(labels=("a", "b"))
    with pytest.raises(ValueError, match="dict keyed by them"):
        g.update(_log(1))
    with pytest.raises(ValueError, match="no row for label"):
        g.update({"c": _log(1)})
    with pytest.raises(ValueError, match="EventLog"):
        g.update({"a": "not a log"})
    g.update({"a": _log(3)})
    with pytest.raises(ValueError, match="shrank"):
        g.update({"a": _log(1)})
    with pytest.raises(ValueError, match="slice_seconds"):
        g.run({"a": object()}, slice_seconds=0)


def test_live_gantt_run_polls_simulations_in_lockstep(monkeypatch):
    from bidirl.sim import simulate
    from bidirl.sim.driver import SimDriver

    cfg = cfgmod.load(TINY)
    policies = ("bidirl", "no-borrow")
    g = LiveGantt(labels=policies, clock=FakeClock(0.05))
    msgs = Messages(g.figure, monkeypatch)
    drivers = {p: SimDriver(cfg, p, steps=3, seed=0) for p in policies}
    slices = {"n": 0}
    original = SimDriver.advance

    def counting(self, seconds=float("inf"), max_events=10**9):
        slices["n"] += 1
        return original(self, seconds, max_events)
    monkeypatch.setattr(SimDriver, "advance", counting)
    panel = MetricsPanel()
    results = g.run(drivers, slice_seconds=0.02, refresh_hz=4.0, metrics=panel)

    assert set(results) == set(policies)
    assert slices["n"] >= 10
    # throttled: the fake clock moves 0.05 s per poll, so at 4 Hz one redraw per five polls, plus the last
    polls = -(-slices["n"] // len(policies))
    assert 2 <= g.redraws <= polls // 5 + 2
    assert msgs.sent["update"] <= g.redraws and msgs.sent["addTraces"] == 0
    k = len(TRACE_KEYS)
    for row, p in enumerate(policies):
        ref = simulate(cfg, p, steps=3, seed=0)                 # the same run, in one go
        assert results[p].summary() == ref.summary()
        expected = spans_to_bars(ref.log.spans_df(), g.states[p].lanes)
        got = {key: g.figure.data[row * k + j] for j, key in enumerate(TRACE_KEYS)}
        assert {key for key, t in got.items() if len(t.x)} == set(expected)
        for key, arrays in expected.items():
            order = np.lexsort((_f(got[key].y), _f(got[key].base)))
            ref_order = np.lexsort((arrays["y"], arrays["base"]))
            np.testing.assert_allclose(_f(got[key].base)[order], arrays["base"][ref_order])
            np.testing.assert_allclose(_f(got[key].x)[order], arrays["x"][ref_order])
    # each row's height follows its number of lanes
    spans = {p: len(g.states[p].lanes) for p in policies}
    heights = {p: g.figure.layout[y].domain[1] - g.figure.layout[y].domain[0]
               for p, y in zip(policies, ("yaxis", "yaxis2"))}
    assert heights["bidirl"] / heights["no-borrow"] == pytest.approx(spans["bidirl"] / spans["no-borrow"])
    step_lines = [s for s in g.figure.layout.shapes if s.name == "step_end"]
    assert len(step_lines) == 2 * 3                             # 3 steps per row
    assert list(panel.figure.data[0].x) == list(policies)       # the panel got both summaries
    assert "step 3/3" in g.status.value


# --------------------------------------------------------------------------------------------------
# MetricsPanel
# --------------------------------------------------------------------------------------------------

SUMMARY = {"policy": "bidirl", "throughput": 1234.5, "idle": {"rollout_pool": 0.25, "trainer_pool": None},
           "utilization": 0.8, "borrows": {"rollout_on_trainer_pool": 3, "trainer_on_rollout_pool": 1,
                                            "rejected": 2}, "timing_s/step": 10.0}


def test_metrics_panel_shows_the_summary_numbers(monkeypatch):
    p = MetricsPanel()
    assert len(p.figure.data) == 6
    msgs = Messages(p.figure, monkeypatch)
    table = p.update({"bidirl": SUMMARY})
    assert msgs.sent["update"] == 1
    by_name = {t.meta: t for t in p.figure.data}
    assert list(by_name["throughput"].y) == [1234.5]
    assert list(by_name["idle_rollout_pool"].y) == [0.25]
    assert np.isnan(by_name["idle_trainer_pool"].y[0])          # None -> NaN, drawn as no bar
    assert [by_name[k].y[0] for k in ("borrows_rollout_on_trainer_pool", "borrows_trainer_on_rollout_pool",
                                      "borrows_rejected")] == [3, 1, 2]
    assert table.loc[0, "utilization"] == 0.8
    assert "1,234.5" in p.table.value and "25.0 %" in p.table.value
    other = dict(SUMMARY, throughput=None, borrows={"rollout_on_trainer_pool": 0, "trainer_on_rollout_pool": 0,
                                                    "rejected": 0})
    p.update({"no-borrow": other})
    assert list(by_name["throughput"].x) == ["bidirl", "no-borrow"]
    assert np.isnan(by_name["throughput"].y[1])
    p.clear()
    assert len(p.figure.data[0].x) == 0 and p.table.value == ""


def test_metrics_panel_rejects_bad_input():
    p = MetricsPanel()
    with pytest.raises(ValueError, match="summaries must be a dict"):
        p.update([SUMMARY])
    with pytest.raises(ValueError, match="summary dict"):
        p.update({"x": 3})
    assert summary_table({}).empty


# --------------------------------------------------------------------------------------------------
# PartitionSweep
# --------------------------------------------------------------------------------------------------

def _sweep_arrays(fig) -> list:
    """Per trace: x labels, y values (None where not finite) and marker colours."""
    out = []
    ticks = fig.layout.xaxis.ticktext
    for t in fig.data:
        x = [ticks[int(v)] for v in t.x] if ticks else list(t.x)
        y = np.asarray(t.y, dtype=float)
        colors = t.marker.color
        out.append((tuple(map(str, x)), tuple(None if not np.isfinite(v) else round(float(v), 12) for v in y),
                    tuple(colors) if isinstance(colors, (list, tuple, np.ndarray)) else colors))
    return out


@pytest.fixture
def explorer():
    return PartitionSweep("a6000-default", steps=3, seed=0)


def test_sweep_shows_the_planners_sweep(explorer):
    from bidirl.planner import plan
    from bidirl.viz_plan import sweep_figure

    cfg = cfgmod.load("a6000-default").with_overrides({"cluster.partition": None})
    reference = sweep_figure(plan(cfg))
    assert _sweep_arrays(explorer.figure) == _sweep_arrays(reference)
    # numeric positions with the labels as ticks: a live restyle cannot re-guess the axis as dates
    assert explorer.figure.layout.xaxis.type == "linear"
    assert list(explorer.figure.data[0].x) == list(range(len(reference.data[0].x)))
    assert list(explorer.figure.layout.xaxis.ticktext) == list(reference.layout.xaxis.ticktext)
    env = plan(cfg).envelope
    assert explorer.selected() == (env.rollout_gpus, env.trainer_gpus)     # the planner's choice by default


def test_staleness_change_recomputes_the_sweep(explorer, monkeypatch):
    from bidirl.planner import plan
    from bidirl.viz_plan import sweep_figure

    traces = list(explorer.figure.data)
    before, n = _sweep_arrays(explorer.figure), explorer.recomputes
    msgs = Messages(explorer.figure, monkeypatch)
    explorer.controls["staleness"].value = 0.0
    assert explorer.recomputes == n + 1
    cfg = cfgmod.load("a6000-default").with_overrides({"cluster.partition": None, "rl.staleness": 0.0})
    assert explorer.plan.sweep.equals(plan(cfg).sweep)
    assert _sweep_arrays(explorer.figure) == _sweep_arrays(sweep_figure(plan(cfg)))
    # at most one batched message (none when the new sweep equals the old: plotly drops unchanged values)
    assert msgs.sent["update"] <= 1 and msgs.sent["restyle"] == msgs.sent["relayout"] == 0
    assert msgs.sent["addTraces"] == 0
    assert list(explorer.figure.data) == traces
    if not plan(cfg).sweep.equals(plan(cfg.with_overrides({"rl.staleness": 1.0})).sweep):
        assert _sweep_arrays(explorer.figure) != before


def test_budget_change_changes_the_number_of_bars(explorer):
    from bidirl.planner import plan

    counts = {}
    for gpus in (16, 32):
        explorer.controls["gpus"].value = gpus
        counts[gpus] = len(explorer.figure.data[0].x)
        cfg = cfgmod.load("a6000-default").with_overrides({"cluster.partition": None, "cluster.gpus": gpus})
        assert counts[gpus] == len(plan(cfg).sweep)
        assert sum(r + t == gpus for r, t in explorer.plan.sweep[["rollout_gpus", "trainer_gpus"]].to_numpy()) \
            == len(explorer.plan.sweep)
    assert counts[32] > counts[16]


def test_invalid_inputs_show_the_error_and_keep_the_chart(explorer):
    before, n = _sweep_arrays(explorer.figure), explorer.recomputes
    explorer.controls["gpus"].value = 12                  # not a whole number of 8-GPU nodes
    assert explorer.recomputes == n
    assert "cluster.gpus" in explorer.error and "cluster.gpus" in explorer.status.value
    assert _sweep_arrays(explorer.figure) == before
    explorer.controls["gpus"].value = 16
    assert explorer.error is None


def test_simulate_button_runs_the_selected_partition(explorer):
    from bidirl.sim import simulate

    options = [v for _, v in explorer.controls["partition"].options]
    assert options and all(sum(v) == explorer.controls["gpus"].value for v in options)
    pick = options[-1]
    explorer.controls["partition"].value = pick
    assert any(s.name == "selected" for s in explorer.figure.layout.shapes)
    explorer.controls["policy"].value = "no-borrow"
    explorer.button.click()
    cfg = cfgmod.load("a6000-default").with_overrides({"cluster.partition": list(pick)})
    ref = simulate(cfg, "no-borrow", steps=3, seed=0)
    assert explorer.result.summary() == ref.summary()
    label = f"no-borrow @ {pick[0]}-{pick[1]}"
    assert label in explorer.metrics.summaries
    thr = explorer.metrics.figure.data[0]
    assert list(thr.x) == [label]
    expected = ref.summary()["throughput"]
    assert (np.isnan(thr.y[0]) if expected is None else thr.y[0] == pytest.approx(expected))


def test_response_length_change_moves_the_rates(explorer):
    from bidirl.planner import plan

    explorer.controls["placement"].value = "any"
    before = _sweep_arrays(explorer.figure)
    explorer.controls["max_response_len"].value = 8192
    cfg = cfgmod.load("a6000-default").with_overrides({"cluster.partition": None, "cluster.placement": "any",
                                                       "workload.max_response_len": 8192})
    assert explorer.plan.sweep.equals(plan(cfg).sweep)
    after = _sweep_arrays(explorer.figure)
    assert after[0][0] == before[0][0]                          # the same partitions ...
    assert after[1][1] != before[1][1]                          # ... with other predicted rollout rates
    ok = explorer.plan.sweep["compatible"].to_numpy(dtype=bool)
    colors = np.asarray(explorer.figure.data[0].marker.color)
    assert len(set(colors[~ok])) == 1 and not set(colors[~ok]) & set(colors[ok])   # incompatible: one grey


def test_clicking_a_bar_selects_its_partition(explorer):
    from plotly.callbacks import Points

    explorer.controls["placement"].value = "any"
    sweep = explorer.plan.sweep.reset_index(drop=True)
    ok = sweep.index[sweep["compatible"].astype(bool) & ~sweep["chosen"].astype(bool)]
    bad = sweep.index[~sweep["compatible"].astype(bool)]
    assert len(ok) and len(bad)
    chosen = explorer.selected()
    explorer._on_click(explorer.figure.data[0], Points(point_inds=[int(bad[0])], trace_index=0), None)
    assert explorer.selected() == chosen                         # an incompatible split cannot be simulated
    explorer._on_click(explorer.figure.data[0], Points(point_inds=[int(ok[0])], trace_index=0), None)
    row = sweep.iloc[int(ok[0])]
    assert explorer.selected() == (row["rollout_gpus"], row["trainer_gpus"])
    shaded = [s for s in explorer.figure.layout.shapes if s.name == "selected"]
    assert len(shaded) == 1 and shaded[0].x0 == int(ok[0]) - 0.5
