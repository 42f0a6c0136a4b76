"""Titles wrap instead of running off a figure, and log axes always carry readable ticks
(bidirl.results.figure_text), in the figures of notebooks 05–07."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bidirl.results.figure_text import (CHAR_EM, SUBTITLE_PX, TITLE_MARGIN_PX, TITLE_PX, log_ticks, plain_text,
                                        wrapped_title)


def _fits(title: dict, width: int) -> bool:
    """Every line of a wrapped title within the figure's width at CHAR_EM per character."""
    for line in title["text"].split("<br>"):
        px = SUBTITLE_PX if "font-size" in line else TITLE_PX
        if len(plain_text(line)) * CHAR_EM * px > width - TITLE_MARGIN_PX:
            return False
    return True


def test_a_long_title_wraps_and_keeps_every_word():
    words = ("Stage-time model: rollout (M_r) (Fig. eval-static (c)) — synthetic (seeded generator, not a "
             "measurement)")
    title = wrapped_title(words, "held-out error: median 2.10 %, p90 4.00 %", width_px=1000)
    assert title["text"].count("<br>") >= 2 and _fits(title, 1000)
    assert plain_text(title["text"]) == words + " held-out error: median 2.10 %, p90 4.00 %"
    assert f"font-size:{SUBTITLE_PX}px" in title["text"] and "<sup>" not in title["text"]
    assert wrapped_title("short", width_px=1000)["text"] == "short"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(min_value=1e-3, max_value=1e7, allow_nan=False), min_size=1, max_size=8))
def test_log_ticks_give_two_labels_inside_the_range(values):
    axis = log_ticks(values)
    lo, hi = axis["range"]
    inside = [t for t in axis["tickvals"] if lo <= math.log10(t) <= hi]
    assert len(inside) >= 2 and len(axis["ticktext"]) == len(axis["tickvals"])
    assert lo < math.log10(min(values)) and math.log10(max(values)) < hi


def test_log_ticks_refuse_values_a_log_axis_cannot_show():
    with pytest.raises(ValueError, match="positive"):
        log_ticks([0.0, 1.0])


def test_the_scaling_figure_has_full_width_rows_and_ticked_log_axes():
    from bidirl.sim.scaling import scaling_figure
    # notebook 07's CI shape: three sizes whose costs sit within one decade (the case dtick=1 left unlabelled)
    by_gpus = pd.DataFrame({"gpus": [16, 32, 64], "steps": [1, 1, 1], "wall_s": [0.9, 1.4, 2.6],
                            "us_per_gpu_step": [3500.0, 2800.0, 2600.0],
                            "cpu_us_per_gpu_step": [3300.0, 2700.0, 2500.0],
                            "cpu_us_per_gpu_step_min": [3200.0, 2600.0, 2400.0],
                            "cpu_us_per_gpu_step_max": [3400.0, 2900.0, 2700.0], "repeats": [2, 2, 2]})
    by_steps = pd.DataFrame({"gpus": [32, 32], "steps": [2, 4], "wall_s": [2.0, 3.9]})
    fig = scaling_figure(by_gpus, by_steps)
    layout = fig.layout
    for name in ("yaxis", "yaxis2", "xaxis", "xaxis2"):
        axis = layout[name]
        assert axis.type == "log" and len(axis.tickvals) >= 2, (name, axis.tickvals)
        lo, hi = axis.range
        assert sum(lo <= np.log10(t) <= hi for t in axis.tickvals) >= 2, (name, axis.tickvals, axis.range)
    # one subplot a row, each the figure's width: no 220 px panels
    assert all(tuple(layout[f"xaxis{k}"].domain) == (0.0, 1.0) for k in ("", "2", "3"))
    assert layout.height >= 3 * 300 and _fits(layout.title.to_plotly_json(), layout.width)


def test_the_calibration_figures_title_fits_and_shows_the_spread_of_repetitions():
    from bidirl.experiments import get
    from bidirl.experiments.figures import stage_figure
    from bidirl.experiments.stage_models import perturb, rollout_records, with_predictions
    from bidirl.perf import RolloutModel
    spec = get("stage-rollout", quick=True)
    cfg = spec.config(spec.points[0])
    prior = RolloutModel(cfg.model_spec, cfg.hardware_spec, tp=1)
    truth = RolloutModel(cfg.model_spec, cfg.hardware_spec, tp=1,
                         params=perturb(prior.params, np.random.default_rng([0, 17]), 0.15))
    records = with_predictions(rollout_records(spec, truth, repeats=4, seed=0),
                               lambda row: prior.replica_time(row["prompt_lens"], row["response_lens"]))
    fig = stage_figure(spec, records)
    title = fig.layout.title.to_plotly_json()
    assert "(seeded generator, not a measurement)" in plain_text(title["text"]) and _fits(title, fig.layout.width)
    observed = [t for t in fig.data if t.mode == "markers"]
    assert observed and all(t.error_y.visible and "mean of 4 repetitions" in t.name for t in observed)
    for t in observed:            # the bars reach the extreme repetitions at each x
        sub = records[records["max_response_len"] == int(t.legendgroup)].groupby("x")["observed"]
        assert np.allclose(np.asarray(t.y) + np.asarray(t.error_y.array), sub.max().to_numpy())
        assert np.allclose(np.asarray(t.y) - np.asarray(t.error_y.arrayminus), sub.min().to_numpy())


def test_the_sweep_figures_config_subtitle_is_readable_and_fits():
    import bidirl.job.config as cfgmod
    from bidirl.job.planner import plan
    from bidirl.viz.plan import WIDTH, sweep_figure
    fig = sweep_figure(plan(cfgmod.load("a6000-default").with_overrides({"cluster.partition": None,
                                                                         "cluster.placement": "any"})))
    title = fig.layout.title.to_plotly_json()
    assert "<sup>" not in title["text"] and f"font-size:{SUBTITLE_PX}px" in title["text"]   # was ≈ 8 px
    assert "qwen3-vl-4b on 16 × a6000" in plain_text(title["text"]) and _fits(title, WIDTH)
