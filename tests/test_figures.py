"""The reproduced paper figures say what they show: words on the axes, the paper's number beside the
reproduced one on every panel, modelled baselines named as such, distinct marks for unsupported and failed."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from bidirl.experiments import figures as F
from bidirl.experiments.run import RESULT_COLUMNS, speedups
from bidirl.experiments.specs import SPECS, get
from bidirl.results.figure_text import plain_text
from bidirl.results.provenance import mark_records
from bidirl.sim.baselines import BASELINES, unsupported_reason


def fake_results(spec, fail=()) -> pd.DataFrame:
    """A results table shaped like ``run_specs``': every cell ok with a made-up throughput, except the cells a
    baseline cannot run (unsupported, with the library's reason) and the ``fail`` cells."""
    rows = []
    for order, point in enumerate(spec.points):
        cfg = spec.config(point)
        for k, policy in enumerate(spec.policies):
            row = {c: np.nan for c in RESULT_COLUMNS}
            row.update(panel=spec.id, kind=spec.kind, order=order, point=point.label, value=point.value,
                       policy=policy, status="ok", reason="", throughput=1000.0 + 100 * order - 50 * k)
            why = unsupported_reason(policy, cfg)
            if why:
                row.update(status="unsupported", reason=why, throughput=np.nan)
            elif (point.label, policy) in fail:
                row.update(status="failed", reason="RuntimeError: boom", throughput=np.nan)
            rows.append(row)
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def staleness():
    spec = get("e2e-a6000-staleness", quick=True)
    results = fake_results(spec, fail={("s=1", "roll")})
    return spec, results, speedups(results, {spec.id: spec})


def test_every_panel_has_the_papers_number_to_draw():
    for spec in SPECS.values():
        paper = F.paper_values(spec)
        assert paper["range"] or paper["spread"] or paper["median"] is not None, spec.id
        assert "." not in F.variable_title(spec) or " " in F.variable_title(spec), spec.id   # words, not keys


def test_panel_axes_are_words_with_units(staleness):
    spec, results, sp = staleness
    fig = F.panel_figure(spec, results, sp)
    assert fig.layout.xaxis2.title.text == "staleness bound s (actor versions a sample may lag)"
    assert fig.layout.yaxis.title.text == "throughput<br>(tokens/s, §7.1 window)"      # two lines: no overlap
    assert "simulated (model prediction)" in plain_text(fig.layout.title.text)


def test_the_papers_range_and_points_sit_beside_the_reproduced_speedups(staleness):
    spec, results, sp = staleness
    fig = F.panel_figure(spec, results, sp)
    band = [s for s in fig.layout.shapes if s.name == "paper_range"]
    assert len(band) == 1 and (band[0].y0, band[0].y1) == (1.45, 1.68) and band[0].yref == "y2"
    reproduced = next(t for t in fig.data if t.name == "BiDiRL speedup, reproduced")
    want = dict(zip(sp["point"], sp["speedup"]))
    assert [want[x] for x in reproduced.x] == pytest.approx(list(reproduced.y))
    assert "paper 1.45x–1.68x" in plain_text(fig.layout.title.text)
    response = get("e2e-a6000-response", quick=True)
    res = fake_results(response)
    fig = F.panel_figure(response, res, speedups(res, {response.id: response}))
    stars = next(t for t in fig.data if t.name == "paper's number at this point")
    assert dict(zip(stars.x, stars.y)) == {"1K": 1.55, "4K": 1.27}


def test_baselines_are_labelled_modelled_with_their_mechanisms(staleness):
    spec, results, sp = staleness
    fig = F.panel_figure(spec, results, sp)
    bars = {t.offsetgroup: t for t in fig.data if t.type == "bar" and t.name and "unsupported" not in t.name
            and "failed" not in t.name}
    for name in BASELINES:
        assert "modelled" in bars[name].name and BASELINES[name].version in bars[name].name
        assert "modelled:" in bars[name].hovertemplate
    assert bars["bidirl"].name == "BiDiRL" and "modelled" not in bars["bidirl"].hovertemplate
    # the three disaggregated systems differ in what the model gives them
    mech = {n: F.mechanisms(n, spec) for n in ("verl-async", "areal", "roll")}
    assert len({tuple(m) for m in mech.values()}) == 3
    assert any("earliest-submitted" in m for m in mech["areal"])
    assert any("drops groups" in m for m in mech["roll"])
    assert any("groups generating at once" in m for m in mech["verl-async"])
    assert any("time-shared" in m for m in F.mechanisms("verl-colocated", spec))
    assert F.mechanisms("bidirl", spec) == []


def test_unsupported_and_failed_have_different_marks(staleness):
    spec, results, sp = staleness
    fig = F.panel_figure(spec, results, sp)
    marks = {t.legendgroup: t for t in fig.data if t.legendgroup in F.MARKS and t.showlegend}
    assert set(marks) == {"unsupported", "failed"}
    assert marks["unsupported"].text[0] == "×" and marks["failed"].text[0] == "⚠"
    assert marks["unsupported"].name != marks["failed"].name
    unsupported = [t for t in fig.data if t.legendgroup == "unsupported"]
    cells = {(t.offsetgroup, x) for t in unsupported for x in t.x}
    expected = set(zip(*[results.loc[results["status"] == "unsupported", c] for c in ("policy", "point")]))
    assert cells == expected
    failed = [t for t in fig.data if t.legendgroup == "failed"]
    assert [(t.offsetgroup, list(t.x)) for t in failed] == [("roll", ["s=1"])]
    assert "boom" in failed[0].hovertext[0]


def test_static_and_stage_panels_show_the_papers_numbers():
    spec = get("static-4b")
    results = fake_results(spec)
    sweep = pd.DataFrame({"rollout_gpus": [8, 16, 24], "trainer_gpus": [24, 16, 8], "pipeline_rate": [1.0, 0.9, 0.5]})
    fig = F.static_figure(spec, results, sweep)
    star = next(t for t in fig.data if "paper's measured best" in t.name)
    assert list(star.x) == ["8-24"] and fig.layout.xaxis.type == "category"
    assert "paper 2.09x" in plain_text(fig.layout.title.text) and "predicted 2.00x" in plain_text(fig.layout.title.text)
    stage = get("stage-rollout")
    records = pd.DataFrame({"x": [1, 2, 1, 2], "max_response_len": [8, 8, 16, 16],
                            "observed": [1.0, 2.0, 2.0, 4.0], "predicted": [1.1, 2.0, 2.0, 4.0]})
    fig = F.stage_figure(stage, mark_records(records, "measured", "measured on CPU, tiny model"))
    assert "paper: median 3.12 %, p90 5.77 %" in plain_text(fig.layout.title.text)
    assert "median 0.00 %" in plain_text(fig.layout.title.text)
    assert fig.layout.xaxis.title.text == "prompt groups per GPU"


def test_a_quick_panel_says_so_and_its_speedup_axis_shows_the_papers_band_with_room():
    spec = get("abl-staleness", quick=True)
    fig = F.panel_figure(spec, fake_results(spec))
    points = len(get("abl-staleness").points)
    assert f"quick variant: 2 of the {points} points (s=0, s=1)" in plain_text(fig.layout.title.text)
    full = F.panel_figure(get("abl-staleness"), fake_results(get("abl-staleness")))
    assert "quick variant" not in plain_text(full.layout.title.text)
    lo, hi = fig.layout.yaxis2.range
    band = next(sh for sh in fig.layout.shapes if sh.name == "paper_range")
    # the span [1.0, 1.12] (1× and the paper's top) widened by 25 % of itself: 0.03 room on each side
    assert lo == pytest.approx(1.0 - 0.03, abs=1e-6) and hi == pytest.approx(1.12 + 0.03, abs=1e-6)
    assert lo < band.y0 and band.y1 < hi
    assert F.speedup_range([1.0]) == pytest.approx((0.95, 1.05), abs=1e-6)     # at least 0.1 wide


def test_the_panels_bars_are_the_window_throughput_and_its_speedups_say_their_metric():
    # 01-03 and `simulate` report the §7.1 window throughput; an ablation panel's claim is judged on the paper's
    # total-run throughput. The bars show the former, the speedup axis names the latter.
    spec = get("abl-staleness", quick=True)
    results = fake_results(spec)
    results = results.assign(summary_throughput=results["throughput"] * 2.0)
    fig = F.panel_figure(spec, results, speedups(results, {spec.id: spec}))
    bars = {t.name: t for t in fig.data if t.type == "bar" and t.name == F.policy_name("bidirl")}
    ok = results[(results["policy"] == "bidirl") & (results["status"] == "ok")].set_index("point")
    drawn = dict(zip(bars[F.policy_name("bidirl")].x, bars[F.policy_name("bidirl")].y))
    assert drawn and all(drawn[p] == ok.at[p, "summary_throughput"] for p in drawn)
    assert "§7.1 window" in fig.layout.yaxis.title.text
    assert spec.metric == "total_run_throughput" and "total-run throughput" in fig.layout.yaxis2.title.text
