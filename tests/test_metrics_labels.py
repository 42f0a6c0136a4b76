"""Labels, units and formatting of run numbers (``bidirl.results.metrics``): one unit per quantity, one spelling of a
split, runs labelled with their config, and a throughput ratio never printed without the whole run's time."""

from __future__ import annotations

import pytest

import bidirl.job.config as cfgmod
from bidirl.job.planner import label, plan
from bidirl.results import metrics
from bidirl.sim import simulate


def test_one_spelling_of_a_split():
    cfg = cfgmod.load("a6000-default")
    assert label(8, 24) == "8-24" == cfgmod.Partition(8, 24).label()
    assert plan(cfg).envelope.label == cfg.cluster.partition.label() == "8-8"
    free = plan(cfg.with_overrides({"cluster.partition": None, "cluster.placement": "any"}))
    assert list(free.sweep["label"]) == [f"{a}-{b}" for a, b in zip(free.sweep["rollout_gpus"],
                                                                     free.sweep["trainer_gpus"])]


def test_run_labels_carry_the_config():
    cfg = cfgmod.load("a6000-default").with_overrides({"workload.max_response_len": 4096, "rl.staleness": 0.5})
    assert metrics.run_label(cfg, "no-borrow") == \
        "no-borrow · 8-8 · qwen3-vl-4b · 16×a6000 · 64 prompts/step · 4K · s=0.5"
    assert metrics.run_label(cfg) == "bidirl · " + metrics.config_label(cfg)
    assert "planner's split" in metrics.config_label(cfg.with_overrides({"cluster.partition": None}))
    assert metrics.length_label(1536) == "1536 tok" and metrics.length_label(2048) == "2K"


def test_a_comparison_gives_the_window_and_the_whole_run():
    cfg = cfgmod.load("a6000-default").with_overrides({"cluster.partition": [4, 12], "cluster.placement": "any",
                                                       "workload.prompts_per_step": 60, "rl.staleness": 0})
    runs = {p: simulate(cfg, p, steps=4, seed=0).summary() for p in ("bidirl", "no-borrow")}
    text = metrics.format_comparison(runs, baseline="no-borrow")
    lines = text.splitlines()
    assert lines[0] == "simulated (model prediction):"
    b, n = runs["bidirl"], runs["no-borrow"]
    assert f"{b['throughput']:,.0f} tokens/s" in lines[1] and "§7.1 window: 3 of 4 steps" in lines[1]
    assert f"whole run {sum(b['step_times']):,.0f} s" in lines[1]
    assert f"{b['throughput'] / n['throughput']:.3f}x the throughput in the window" in lines[1]
    assert f"whole run {sum(n['step_times']) / sum(b['step_times']):.3f}x as fast" in lines[1]
    assert "vs" not in lines[2]
    with pytest.raises(ValueError, match="baseline"):
        metrics.format_comparison(runs, baseline="roll")
    short = dict(b, throughput=None, throughput_note="run at least 3 steps")
    assert "no §7.1 window: run at least 3 steps" in metrics.window_text(short)


def test_rates_have_one_unit_everywhere():
    from bidirl.cli import format_plan
    from bidirl.viz.plan import sweep_figure

    p = plan("a6000-default")
    assert metrics.RATE_UNIT in sweep_figure(p).layout.yaxis.title.text
    text = format_plan(p)
    assert text.count(metrics.RATE_UNIT) >= 4 and " groups/s" not in text.replace(metrics.RATE_UNIT, "")
