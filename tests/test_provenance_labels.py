"""Every figure and printed number says what it is — simulated, emulated or measured — taken from the run.

A run's ``provenance`` is a class attribute of the driver that made it (``SimDriver``, ``EmulatedDriver``,
``EngineDriver``) and travels in the ``RunResult`` and its summary; figures, widgets and printed summaries
read it from there (:data:`bidirl.results.provenance.PROVENANCE` holds the words). These tests give one simulated log
each driver's provenance, as its driver would, and check every consumer. The integration tests of the Ray
drivers check the same labels on real emulated and real engine runs.
"""

from __future__ import annotations

import dataclasses

import pytest

from bidirl.cluster.emulated import EmulatedDriver
from bidirl.cluster.engines.driver import EngineDriver
from bidirl.results.figure_text import plain_text
from bidirl.results import metrics
from bidirl.results.provenance import PROVENANCE
from bidirl.sim import simulate
from bidirl.sim.driver import SimDriver
from bidirl.viz import gantt as viz
from bidirl.widgets import LiveGantt, MetricsPanel

DRIVERS = {SimDriver: "simulated", EmulatedDriver: "emulated", EngineDriver: "measured"}


@pytest.fixture(scope="module")
def simulated():
    return simulate("tiny-cpu", "bidirl", steps=3, seed=0)


def made_by(driver, run):
    """``run`` as ``driver`` would have returned it: its provenance on the result and in the summary."""
    summary = dict(run.summary(), provenance=driver.provenance)
    return dataclasses.replace(run, provenance=driver.provenance, summary_dict=summary)


def test_the_three_kinds_have_distinct_words_and_axes():
    assert set(DRIVERS.values()) == set(PROVENANCE) == set(viz.TIME_AXIS_TITLES)
    assert len(set(viz.TIME_AXIS_TITLES.values())) == len(PROVENANCE)
    for kind, title in viz.TIME_AXIS_TITLES.items():
        assert kind in title


@pytest.mark.parametrize("driver, kind", DRIVERS.items(), ids=lambda x: getattr(x, "__name__", x))
def test_figures_widgets_and_summaries_carry_the_runs_provenance(driver, kind, simulated):
    run = made_by(driver, simulated)
    assert run.provenance == kind
    words = PROVENANCE[kind]
    others = [w for k, w in PROVENANCE.items() if k != kind]

    fig = viz.gantt_figure(run, title="bidirl")
    assert fig.layout.title.text == f"bidirl — {words}"
    assert fig.layout.xaxis.title.text == viz.TIME_AXIS_TITLES[kind]
    both = viz.compare_gantt({"a": run, "b": run}, title="two")
    assert both.layout.title.text == f"two — {words}"
    assert kind in both.layout.xaxis2.title.text or kind in both.layout.xaxis.title.text

    live = LiveGantt(labels=("bidirl",), title="live")
    live.update(run)
    assert live.figure.layout.title.text == f"live — {words}"
    assert live.figure.layout.xaxis.title.text == viz.TIME_AXIS_TITLES[kind]

    panel = MetricsPanel()
    table = panel.add_runs([run])
    assert list(table["provenance"]) == [kind] and kind in panel.table.value

    printed = metrics.format_summary(run.summary())
    assert words in printed.splitlines()[0] and not any(w in printed for w in others)
    compared = metrics.format_comparison({"x": run.summary(), "y": run.summary()}, baseline="y")
    assert compared.splitlines()[0] == f"{words}:"
    if run.summary().get("costs"):
        assert metrics.COST_SOURCES[kind] in printed


def test_costs_of_an_emulated_run_are_not_called_measured(simulated):
    summary = dict(made_by(EmulatedDriver, simulated).summary(),
                   costs={"rollout_on_trainer_pool": {"c_in": 7.7, "c_out": 5.7}})
    line = next(x for x in metrics.format_summary(summary).splitlines() if x.startswith("switch costs"))
    assert "emulated" in line and "measured" not in line


def test_contradictions_are_refused(simulated):
    emulated = made_by(EmulatedDriver, simulated)
    with pytest.raises(ValueError, match="one provenance"):
        viz.compare_gantt({"sim": simulated, "ray": emulated})
    with pytest.raises(ValueError, match="contradicts"):
        viz.gantt_figure(emulated, provenance="measured")
    with pytest.raises(ValueError, match="provenance must be one of"):
        viz.gantt_figure(simulated.log, provenance="guessed")
    # a bare log says nothing it does not know
    assert viz.gantt_figure(simulated.log).layout.xaxis.title.text == viz.UNKNOWN_TIME_AXIS


# --------------------------------------------------------------------------------------------------
# stage-time records: a figure's label comes from where its records come from
# --------------------------------------------------------------------------------------------------

def _says(title: str, source: str) -> bool:
    """The title names ``source`` and no other record source."""
    from bidirl.results.provenance import RECORD_SOURCES
    return source in title and not any(k in title for k in RECORD_SOURCES if k != source)


def test_synthetic_records_are_drawn_as_synthetic_as_in_the_calibration_notebook():
    """Notebook 06's path: the seeded generator's records, predicted, (trainer: summed per stage) and drawn."""
    import numpy as np

    from bidirl.experiments import get
    from bidirl.experiments.figures import stage_figure
    from bidirl.experiments.stage_models import (noise_floor_pct, perturb, rollout_records, stage_times,
                                                 trainer_records, with_predictions)
    from bidirl.perf import RolloutModel, TrainerModel
    spec_r, spec_t = get("stage-rollout", quick=True), get("stage-trainer", quick=True)
    cfg = spec_r.config(spec_r.points[0])
    prior_r = RolloutModel(cfg.model_spec, cfg.hardware_spec, tp=1)
    truth_r = RolloutModel(cfg.model_spec, cfg.hardware_spec, tp=1,
                           params=perturb(prior_r.params, np.random.default_rng([0, 17]), 0.15))
    rec_r = with_predictions(rollout_records(spec_r, truth_r, repeats=1, seed=0),
                             lambda row: prior_r.replica_time(row["prompt_lens"], row["response_lens"]))
    prior_t = TrainerModel(cfg.model_spec, cfg.hardware_spec, layout=1)
    rec_t = stage_times(with_predictions(
        trainer_records(spec_t, prior_t, repeats=1, seed=0),
        lambda row: prior_t.chunk_time(row["stage"], row["prompt_lens"], row["response_lens"], 1)))
    for spec, records in ((spec_r, rec_r), (spec_t, rec_t)):
        assert records.attrs["source"] == "synthetic"
        fig = stage_figure(spec, records)
        title = plain_text(fig.layout.title.text)
        assert _says(title, "synthetic"), title
        assert "qwen3-vl-4b / a6000" in title and "paper: median" not in title
        assert f"{noise_floor_pct():.2f} %" in title
        observed = [t.name for t in fig.data if t.mode == "markers"]
        assert observed and all(n.startswith("synthetic,") for n in observed)


def test_measured_records_are_drawn_as_measured():
    from bidirl.experiments import get
    from bidirl.experiments.figures import stage_figure
    from bidirl.experiments.stage_models import run_stage_panel
    spec = get("stage-rollout", quick=True)
    res = run_stage_panel(spec, quick=True)
    fig = stage_figure(spec, res["records"])
    assert _says(plain_text(fig.layout.title.text), "measured") and "paper: median" in plain_text(fig.layout.title.text)


def test_records_that_do_not_say_where_they_come_from_or_contradict_it_are_refused():
    import pandas as pd

    from bidirl.experiments import get
    from bidirl.experiments.figures import stage_figure
    from bidirl.results.provenance import mark_records
    bare = pd.DataFrame({"x": [1], "max_response_len": [8], "observed": [1.0], "predicted": [1.0]})
    with pytest.raises(ValueError, match="do not say where they come from"):
        stage_figure(get("stage-rollout"), bare)
    with pytest.raises(ValueError, match="must say 'synthetic' and not"):
        mark_records(bare.copy(), "synthetic", "synthetic, measured on CPU")
    with pytest.raises(ValueError, match="must say 'measured'"):
        mark_records(bare.copy(), "measured", "tiny model on CPU")
    with pytest.raises(ValueError, match="record source must be one of"):
        mark_records(bare.copy(), "guessed", "guessed")
