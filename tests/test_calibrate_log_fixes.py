"""``bidirl calibrate --log``: one batch order shared with the colocated simulator, ``--knobs-only`` honoured, and a
warning when a fit has fewer operating points than parameters (issue 37, item 5)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from bidirl.calibrate import from_log as J
from bidirl.cli import main
from bidirl.job import config as cfgmod
from bidirl.perf.workload import GroupLengths
from bidirl.sim import colocated
from tests.test_job_log import JOB, LOG


class _Noiseless:
    """A numpy Generator whose normal draws are their mean: the colocated simulator's durations are then its
    models' times exactly."""

    def __init__(self, *args, **kwargs):
        self._gen = _REAL_RNG(*args, **kwargs)

    def normal(self, loc=0.0, scale=1.0, size=None):
        return loc if size is None else np.full(size, loc, dtype=float)

    def __getattr__(self, name):
        return getattr(self._gen, name)


_REAL_RNG = np.random.default_rng


def _longtail_job():
    # long-tailed responses: completion order and submission order cut very different chunks
    return cfgmod.load("h100-default").with_overrides({
        "model": "qwen3-8b", "workload.prompts_per_step": 32, "cluster.partition": None,
        "workload.response_lengths": {"mean": 600, "cv": 1.5}})


def test_calibration_times_the_trainer_in_the_colocated_simulators_order(monkeypatch):
    cfg = _longtail_job()
    monkeypatch.setattr(np.random, "default_rng", _Noiseless)
    run = colocated.simulate_colocated(cfg, steps=1, seed=cfg.seed)
    monkeypatch.setattr(np.random, "default_rng", _REAL_RNG)
    spans = run.log.spans_df()
    chunks = spans[spans.kind == "chunk"]
    simulated = {s: float((g.end - g.start).sum()) for s, g in chunks.groupby(chunks.detail.map(lambda d: d["stage"]))}
    # the same step's lengths, as the colocated simulator drew them (group-id order)
    lengths = GroupLengths.of(cfg, cfg.seed)
    w = cfg.workload
    groups = [lengths(g) for g in range(w.prompts_per_step)]
    p = np.repeat([pl for pl, _ in groups], w.group_size)
    r = np.array([n for _, targets in groups for n in targets])
    shape = J.JobShape.of(cfg, cfg.hardware_spec, colocated=True)
    obs = [J.Observation(0, "trainer", s, 1.0, p, r) for s in simulated]
    predicted = dict(zip(simulated, J.predict(obs, cfg, cfg.hardware_spec, shape)))
    for stage, seconds in simulated.items():
        assert predicted[stage] == pytest.approx(seconds, rel=1e-9)
    # the defect this guards: timed in completion order the same lengths give another trainer time
    from bidirl.job.planner import consumption_order
    from bidirl.perf.predictor import StagePredictor
    pred = StagePredictor.from_config(cfg, shape.rollout_layout, shape.trainer_layout)
    order = consumption_order(p, r, w.group_size)
    stage = next(iter(simulated))
    other = pred.trainer.stage_time(p[order], r[order], shape.trainer_replicas, cfg.rl.micro_batch_per_device,
                                    (stage,))
    assert other != pytest.approx(simulated[stage], rel=1e-9)


def test_split_jobs_keep_completion_order():
    p, r = np.array([5, 5, 7, 7]), np.array([100, 90, 3, 4])
    assert J.trainer_order(p, r, 2, colocated=False).tolist() == [2, 3, 0, 1]   # group 1 finishes first
    assert J.trainer_order(p, r, 2, colocated=True).tolist() == [0, 1, 2, 3]


def test_knobs_only_is_honoured_with_a_log(tmp_path, capsys):
    out = tmp_path / "knobs.yaml"
    assert main(["calibrate", "--log", str(LOG), "--config", str(JOB), "--out", str(out), "--knobs-only",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["stage_params"] == {}
    import yaml
    assert "stage_params" not in yaml.safe_load(out.read_text())
    full = tmp_path / "full.yaml"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", J.UnderdeterminedFit)
        assert main(["calibrate", "--log", str(LOG), "--config", str(JOB), "--out", str(full), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stage_params"]      # without it the per-model fit runs


def test_a_fit_with_fewer_operating_points_than_parameters_warns():
    # the per-model fit: a log is one operating point per stage, the appendix models have several parameters each
    with pytest.warns(J.UnderdeterminedFit, match="parameters fitted to"):
        cal = J.calibrate_from_log(LOG, JOB)
    assert any("underdetermined" in n for n in cal.notes)
    # the knobs alone: two knobs, one per side the log times (rollout and trainer): no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", J.UnderdeterminedFit)
        J.calibrate_from_log(LOG, JOB, model_params=False)
    # more knobs than the log's operating points
    with pytest.warns(J.UnderdeterminedFit, match="hardware knobs"):
        J.calibrate_from_log(LOG, JOB, model_params=False,
                             knobs=("train_mfu", "decode_mbu", "prefill_mfu", "scheduler_overhead",
                                    "kernel_overhead_per_layer"))
