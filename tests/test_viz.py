"""Gantt and bar figures: pure array building and figure structure, checked without a browser."""

from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest
from hypothesis import given, settings, strategies as st

from bidirl.results.trace import KINDS, EventLog, Span, StepRecord
from bidirl.viz import export, live
from bidirl.viz import gantt as viz

R0, R1 = "rollout_pool/rollouter/0", "rollout_pool/rollouter/1"
TR, AUX_R, AUX_T = "trainer_pool/trainer", "trainer_pool/rollouter/0", "rollout_pool/trainer"
ROT = {"direction": "rollout_on_trainer_pool"}


def span(worker, kind, start, end, detail=None, step=0):
    pool = worker.split("/")[0]
    home = "rollouter" if pool == "rollout_pool" else "trainer"
    role = "primary" if worker.split("/")[1] == home else "auxiliary"
    return Span(worker, pool, role, kind, start, end, step, step, detail or {})


def demo_log():
    log = EventLog(spans=[
        span(R0, "generate", 0, 4), span(R1, "generate", 0, 5), span(R0, "generate", 5, 7),
        span(TR, "chunk", 5, 8, {"stage": "actor_update", "chunk_id": 0, "samples": 2}),
        span(AUX_R, "switch_in", 8, 9, ROT), span(AUX_R, "generate", 9, 11), span(AUX_R, "switch_out", 11, 12, ROT),
        span(TR, "optimizer", 12, 13), span(TR, "sync", 13, 14), span(R0, "sync", 13, 14)])
    log.add_step(StepRecord(0, 0, 7, 10, 2))
    log.add_step(StepRecord(1, 7, 14, 10, 2))
    return log


def test_spans_to_bars_one_entry_per_kind_role_present():
    spans = demo_log().spans_df()
    bars = viz.spans_to_bars(spans)
    present = set(zip(spans["kind"], spans["role"]))
    assert set(bars) == present and len(bars) == 7
    assert list(bars) == [k for k in viz.TRACE_KEYS if k in present]
    lanes = viz.default_lanes(spans)
    assert lanes == [R0, R1, TR, "trainer_pool/rollouter/*"]         # auxiliary rollouters share one lane
    assert viz.default_lanes(spans, group_auxiliary=False) == [R0, R1, TR, AUX_R]
    gen = bars[("generate", "primary")]
    assert gen["y"].tolist() == [0.0, 1.0, 0.0] and gen["base"].tolist() == [0, 0, 5]
    assert gen["x"].tolist() == [4, 5, 2]
    for arrays in bars.values():
        assert arrays["y"].dtype == arrays["base"].dtype == arrays["x"].dtype == np.float64
        assert arrays["customdata"].shape == (len(arrays["x"]), len(viz.CUSTOMDATA_COLUMNS))
    chunk = bars[("chunk", "primary")]["customdata"][0]
    assert chunk[0] == TR and chunk[1] == 5 and chunk[2] == 8 and "stage=actor_update" in chunk[6]
    assert chunk[3] == 3                                                # the tooltip's duration, not the end
    assert "customdata[3]" in viz.HOVER and "%{x" not in viz.HOVER     # %{x} of a based bar is base + x
    assert viz.spans_to_bars(EventLog().spans_df()) == {}


def test_spans_to_bars_respects_given_lanes_and_rejects_missing_workers():
    spans = demo_log().spans_df()
    lanes = [AUX_R, TR, R1, R0]
    bars = viz.spans_to_bars(spans, lanes, group_auxiliary=False)
    assert bars[("generate", "auxiliary")]["y"].tolist() == [0.0]
    assert bars[("generate", "primary")]["y"].tolist() == [3.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="trainer_pool/rollouter/0"):
        viz.spans_to_bars(spans, [R0, R1, TR], group_auxiliary=False)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([R0, R1, TR, AUX_R, AUX_T]), st.sampled_from(KINDS),
                          st.floats(0, 100), st.floats(0, 10)), max_size=40))
def test_bars_hold_every_span_exactly_once(rows):
    log = EventLog(spans=[span(w, k, s, s + d) for w, k, s, d in rows])
    spans = log.spans_df()
    bars = viz.spans_to_bars(spans)
    assert len(bars) == len(set(zip(spans["kind"], spans["role"])))
    assert sum(len(b["x"]) for b in bars.values()) == len(rows)
    total = sum(float(b["x"].sum()) for b in bars.values())
    assert total == pytest.approx(float((spans["end"] - spans["start"]).sum()))


def test_gantt_figure_structure():
    log = demo_log()
    fig = viz.gantt_figure(log, title="demo")
    bars = [t for t in fig.data if isinstance(t, go.Bar)]
    assert len(bars) == 7 and all(t.orientation == "h" for t in bars)
    names = [t.name for t in fig.data]
    assert len(set(names)) == len(names) and "generation · borrowed GPUs" in names
    # legend entries for the one window direction present and the step lines, after the bars
    assert names[7:] == [viz.WINDOW_NAMES["rollout_on_trainer_pool"], viz.STEP_LINE_NAME]
    assert fig.layout.xaxis.type == "linear"
    assert list(fig.layout.yaxis.ticktext) == [R0, R1, TR, "trainer_pool/rollouter/* (1 auxiliary)"]
    chunk = next(t for t in fig.data if t.name == "training chunk")
    assert list(chunk.base) == [5.0] and list(chunk.x) == [3.0]
    assert chunk.marker.color == viz.COLORS[("chunk", "primary")]
    aux = next(t for t in fig.data if t.name == "generation · borrowed GPUs")
    assert aux.marker.color != next(t for t in fig.data if t.name == "generation").marker.color
    windows = [s for s in fig.layout.shapes if s.name == "borrow:rollout_on_trainer_pool"]
    # the window spans switch_in start .. switch_out end on the trainer pool's lanes (indices 2..3)
    assert len(windows) == 1 and (windows[0].x0, windows[0].x1) == (8.0, 12.0)
    assert (windows[0].y0, windows[0].y1) == (1.5, 3.5)
    assert sorted(s.x0 for s in fig.layout.shapes if s.name == "step_end") == [7.0, 14.0]
    assert len([s for s in fig.layout.shapes if s.name == "pool_separator"]) == 1
    # a bare spans table works too (no step lines)
    fig2 = viz.gantt_figure(log.spans_df())
    assert len(fig2.data) == 7 + 1 and not [s for s in fig2.layout.shapes if s.name == "step_end"]
    assert viz.STEP_LINE_NAME not in [t.name for t in fig2.data]
    # the legend sits below the plot with room reserved for its rows
    assert fig.layout.legend.orientation == "h" and fig.layout.margin.b >= 58 + viz.LEGEND_ROW_PX


def test_compare_gantt_stacks_runs_on_a_shared_axis():
    a = demo_log()
    b = EventLog(spans=[span(R0, "generate", 0, 3), span(TR, "chunk", 3, 6)], steps=[StepRecord(0, 0, 6, 5, 1)])
    fig = viz.compare_gantt({"bidirl": a, "no-borrow": b})
    assert len(fig.data) == 7 + 2 + 2                       # bars of both rows, then window and step entries
    assert {t.yaxis for t in fig.data} == {"y", "y2"}
    assert fig.layout.xaxis.matches == "x2" or fig.layout.xaxis2.matches == "x"
    legend = [t.name for t in fig.data if t.showlegend is not False]
    assert sorted(legend) == sorted(set(t.name for t in fig.data))
    assert [a.text for a in fig.layout.annotations] == ["bidirl", "no-borrow"]
    row2_steps = [s for s in fig.layout.shapes if s.name == "step_end" and s.xref == "x2"]
    assert [s.x0 for s in row2_steps] == [6.0] and row2_steps[0].yref == "y2 domain"
    with pytest.raises(ValueError, match="at least one"):
        viz.compare_gantt({})


def test_throughput_bars_single_and_grouped():
    df = pd.DataFrame({"policy": ["bidirl", "no-borrow"], "throughput": [120.0, 100.0]})
    fig = viz.throughput_bars(df, title="t")
    assert len(fig.data) == 1 and list(fig.data[0].x) == ["bidirl", "no-borrow"]
    assert list(fig.data[0].y) == [120.0, 100.0]
    grouped = pd.DataFrame({"policy": ["bidirl", "no-borrow"] * 2, "setting": ["s=0", "s=0", "s=1", "s=1"],
                            "throughput": [1.0, 2.0, 3.0, 4.0], "throughput_std": [0.1] * 4})
    fig = viz.throughput_bars(grouped)
    assert [t.name for t in fig.data] == ["bidirl", "no-borrow"] and fig.layout.barmode == "group"
    assert list(fig.data[1].y) == [2.0, 4.0] and list(fig.data[0].error_y.array) == [0.1, 0.1]
    with pytest.raises(ValueError, match="throughput"):
        viz.throughput_bars(pd.DataFrame({"policy": ["a"]}))
    with pytest.raises(ValueError, match="numeric"):
        viz.throughput_bars(pd.DataFrame({"policy": ["a"], "throughput": ["fast"]}))
    with pytest.raises(ValueError, match="empty"):
        viz.throughput_bars(pd.DataFrame({"policy": [], "throughput": []}))


def test_gantt_state_accumulates_like_a_one_shot_build():
    log = demo_log()
    spans = log.spans_df()
    state = live.GanttState()
    fig = state.figure()
    assert len(fig.data) == len(viz.TRACE_KEYS)
    for chunk in (spans.iloc[:2], spans.iloc[2:5], spans.iloc[5:0], spans.iloc[5:]):
        out = state.add(chunk)
        assert list(out) == list(viz.TRACE_KEYS)
    assert state.lanes == viz.default_lanes(spans) and state.n_spans == len(spans)
    once = viz.spans_to_bars(spans)
    for key, arrays in state.arrays().items():
        if key not in once:
            assert len(arrays["x"]) == 0
            continue
        order = np.lexsort((arrays["y"], arrays["base"]))
        ref = np.lexsort((once[key]["y"], once[key]["base"]))
        for name in ("y", "base", "x"):
            assert arrays[name][order].tolist() == once[key][name][ref].tolist()
    state.apply(fig, log.steps_df())
    gen = fig.data[viz.TRACE_KEYS.index(("generate", "primary"))]
    assert len(gen.x) == 3 and list(fig.layout.yaxis.ticktext) == viz.lane_labels(state.lanes, spans["worker"])
    assert len([s for s in fig.layout.shapes if s.name == "step_end"]) == 2


def test_gantt_state_relanes_when_a_new_worker_appears():
    state = live.GanttState()
    state.add(EventLog(spans=[span(TR, "chunk", 0, 1), span(R0, "generate", 0, 2)]).spans_df())
    assert state.lanes == [R0, TR]
    out = state.add(EventLog(spans=[span(AUX_T, "chunk", 2, 3)]).spans_df())
    assert state.lanes == [R0, AUX_T, TR]
    assert out[("chunk", "primary")]["y"].tolist() == [2.0]
    assert out[("chunk", "auxiliary")]["y"].tolist() == [1.0]
    fixed = live.GanttState(lanes=[TR, R0])
    fixed.add(EventLog(spans=[span(AUX_T, "chunk", 2, 3)]).spans_df())
    assert fixed.lanes == [TR, R0, AUX_T]
    with pytest.raises(ValueError, match="GanttState"):
        live.GanttState().apply(go.Figure())
    limited = live.GanttState(keys=(("generate", "primary"),))
    with pytest.raises(ValueError, match="no trace"):
        limited.add(EventLog(spans=[span(TR, "chunk", 0, 1)]).spans_df())


def test_figures_serialise_to_html(tmp_path):
    fig = viz.compare_gantt({"a": demo_log(), "b": demo_log()})
    path = tmp_path / "g.html"
    fig.write_html(path, include_plotlyjs=False)
    assert path.stat().st_size > 0 and "training chunk" in path.read_text()


def test_replay_clipping_shows_the_run_as_it_stood():
    log = demo_log()
    spans = log.spans_df()
    bars = viz.spans_to_bars(spans)
    at = viz.clip_bars(bars[("generate", "primary")], 4.5)
    assert at["base"].tolist() == [0, 0] and at["x"].tolist() == [4, 4.5]     # R1's span cut at t, R0's later one hidden
    assert at["customdata"][1][2] == 5                                          # its tooltip keeps the real end
    cut = viz.clip_spans(spans, 10.0)
    assert (cut["end"] <= 10.0).all() and len(cut) == (spans["start"] <= 10.0).sum()
    state = live.GanttState()
    state.add(log)
    assert state.end == 14.0
    layout = state.layout(log.steps_df(), until=10.0)
    windows = [s for s in layout["shapes"] if s["name"].startswith("borrow:")]
    assert [(w["x0"], w["x1"]) for w in windows] == [(8.0, 10.0)]             # the window still open at t
    assert [s["x0"] for s in layout["shapes"] if s["name"] == "step_end"] == [7.0]


def test_many_auxiliary_rollouters_share_one_lane_unless_asked():
    spans = [span(f"trainer_pool/rollouter/{i}", "generate", i, i + 1) for i in range(12)] + [span(TR, "chunk", 0, 3)]
    log = EventLog(spans=spans)
    fig = viz.gantt_figure(log, provenance="simulated")
    assert list(fig.layout.yaxis.ticktext) == [TR, "trainer_pool/rollouter/* (12 auxiliary)"]
    expanded = viz.gantt_figure(log, provenance="simulated", group_auxiliary=False)
    assert len(expanded.layout.yaxis.ticktext) == 13
    aux = next(t for t in fig.data if t.name == "generation · borrowed GPUs")
    assert set(aux.y) == {1.0} and sorted(aux.customdata[:, 0]) == sorted(s.worker for s in spans[:12])


def test_export_writes_html_and_png_where_kaleido_renders(tmp_path):
    written = export.export_figure(viz.gantt_figure(demo_log(), provenance="simulated"), tmp_path / "g")
    assert written["html"] == tmp_path / "g.html" and "training chunk" in written["html"].read_text()
    try:
        import kaleido  # noqa: F401
    except ImportError:
        assert written["png"] is None and "kaleido is not installed" in written["note"]
    else:
        # installed: either a PNG, or a note saying why this machine could not render one
        assert (written["png"] is not None and written["png"].stat().st_size > 1000) or "could not" in written["note"]
    only_html = export.export_figure(viz.gantt_figure(demo_log()), tmp_path / "h.html", png=False)
    assert only_html["png"] is None and only_html["note"] == "HTML only"


def test_png_export_keeps_each_figures_own_size(tmp_path, monkeypatch):
    pytest.importorskip("kaleido")
    import plotly.io as pio

    seen = {}

    def write_images(figs, paths, width=None, height=None):
        seen.update(width=width, height=height, paths=paths)
        for p in paths:
            open(p, "wb").close()

    monkeypatch.setattr(pio, "write_images", write_images)
    sized = viz.gantt_figure(demo_log(), provenance="simulated")
    bare = go.Figure()
    assert export.write_pngs({tmp_path / "a.png": sized, tmp_path / "b.png": bare}) is None
    assert seen["width"] == [sized.layout.width, export.PNG_SIZE[0]]
    assert seen["height"] == [sized.layout.height, export.PNG_SIZE[1]]


def test_png_cache_renders_only_figures_it_has_not_seen(tmp_path, monkeypatch):
    pytest.importorskip("kaleido")
    import plotly.io as pio

    rendered = []

    def write_images(figs, paths, width=None, height=None):
        rendered.append(len(paths))
        for fig, p in zip(figs, paths):
            Path(p).write_bytes(fig.to_json().encode())   # stands in for the picture: distinct per figure

    monkeypatch.setattr(pio, "write_images", write_images)
    cache = tmp_path / "png-cache"
    a, b = go.Figure(go.Bar(y=[1, 2])), go.Figure(go.Bar(y=[3]))
    first = {tmp_path / "1" / "a.png": a, tmp_path / "1" / "b.png": b}
    (tmp_path / "1").mkdir()
    assert export.write_pngs(first, cache_dir=cache) is None
    (tmp_path / "2").mkdir()
    again = {tmp_path / "2" / "a.png": a, tmp_path / "2" / "b.png": go.Figure(go.Bar(y=[4]))}
    assert export.write_pngs(again, cache_dir=cache) is None
    assert rendered == [2, 1]                      # the unchanged figure came from the cache
    assert (tmp_path / "2" / "a.png").read_bytes() == (tmp_path / "1" / "a.png").read_bytes()
    assert (tmp_path / "2" / "b.png").read_bytes() != (tmp_path / "1" / "b.png").read_bytes()
    a.update_layout(width=640)                     # a new size is a new picture
    assert export.write_pngs({tmp_path / "2" / "a.png": a}, cache_dir=cache) is None
    assert rendered == [2, 1, 1]


def test_the_sweep_legend_names_only_what_the_chart_shows():
    import bidirl.job.config as cfgmod
    from bidirl.job.planner import plan
    from bidirl.viz.plan import TRACE_NAMES, sweep_figure
    p = plan(cfgmod.load("a6000-default").with_overrides({"cluster.partition": None, "cluster.placement": "any"}))
    shown = {t.name for t in sweep_figure(p).data if t.showlegend is not False}
    # no simulation and no selection: those entries are absent; 13-3 … 15-1 cannot hold a 4-GPU trainer replica,
    # so the × entry is there
    assert not shown & {"simulated rate", "column: split selected to simulate"}
    assert "a stage does not fit its pool (no rate)" in shown
    assert {"bar: compatible split", "bar: not hot-switch compatible", "bar / column: planner's choice"} <= shown
    fig = sweep_figure(p, selected=0)
    assert next(t for t in fig.data if t.name == TRACE_NAMES[-1]).showlegend
    assert any(s.name == "selected" for s in fig.layout.shapes)
