"""Calibration from a job's own step log (bidirl.calibrate.from_log): the shipped log of a real CPU run round-trips to a
preset that plans and simulates, a synthetic log recovers the knobs that made it, and bad logs say what is wrong."""

import json
import math

import numpy as np
import pytest

from bidirl.calibrate import from_log as J
from bidirl.cli import main
from bidirl.job import config as cfgmod, presets
from bidirl.job.planner import plan
from bidirl.sim import simulate

LOG = presets.data_dir() / "logs" / "tiny-cpu-s0" / "metrics.jsonl"
JOB = presets.data_dir() / "logs" / "tiny-cpu-s0" / "config.yaml"


def test_shipped_real_log_round_trips_to_a_preset(tmp_path):
    """bidirl's own engine run (metrics.jsonl, veRL keys) → fitted preset → a config that plans and simulates."""
    cal = J.calibrate_from_log(LOG, JOB, hardware="cpu")
    for kind in ("rollout", "trainer"):
        before, after = cal.error(kind, predictor="prior"), cal.error(kind)
        assert after["median"] < before["median"] / 4, kind      # the nominal cpu preset is off by ~100 %
        assert after["median"] < 15.0, kind
    path = J.write_preset(cal, tmp_path / "my-job.yaml")
    loaded = presets.hardware(str(path))
    assert {k: getattr(loaded, k) for k in cal.knobs} == cal.knobs
    assert loaded.stage_params["tiny"] == cal.hardware.stage_params["tiny"]
    # the file predicts what the calibration predicted
    obs, _ = J.observations(J.read_step_log(LOG), cfgmod.load(JOB))
    obs = [o for o in obs if o.step >= cal.skip]
    np.testing.assert_allclose(J.predict(obs, cfgmod.load(JOB), loaded, cal.shape), cal.table["fitted"], rtol=1e-9)
    job = cfgmod.load(JOB).with_overrides({"hardware": str(path)})
    assert plan(job).envelope.rollout_time > 0
    assert simulate(job, "bidirl", steps=3).summary()["throughput"] > 0


def test_synthetic_log_recovers_the_knobs_that_made_it(tmp_path):
    """Stage times predicted with known knobs, written as a veRL-style log, give those knobs back."""
    cfg = cfgmod.load("a6000-default").with_overrides({
        "model": "qwen3-vl-2b", "cluster.gpus": 16, "cluster.placement": "any", "cluster.partition": [8, 8],
        "workload.prompts_per_step": 16, "workload.max_response_len": 2048, "rl.staleness": 0})
    truth = {"train_mfu": 0.31, "decode_mbu": 0.47}
    from bidirl.perf.fit import knob_hardware
    true_hw = knob_hardware(cfg.hardware_spec, truth)
    shape = J.JobShape.of(cfg, true_hw, colocated=False)
    rng = np.random.default_rng(0)
    rows = []
    for step in range(10):
        mean, top = float(rng.uniform(300, 900)), float(rng.uniform(1200, 2048))
        p, r = J.step_batch(cfg, step, mean, top)
        o = [J.Observation(step, "rollout", "generate", 1.0, p, r)] + \
            [J.Observation(step, "trainer", s, 1.0, p, r) for s in cfg.rl.stages]
        t = J.predict(o, cfg, true_hw, shape)
        row = {"training/global_step": step + 1, "response_length/mean": mean, "response_length/max": top,
               J.GEN_KEY: t[0]}
        row.update({J.STAGE_KEYS[s]: v for s, v in zip(cfg.rl.stages, t[1:])})
        rows.append(row)
    log = tmp_path / "verl.jsonl"
    log.write_text("\n".join(json.dumps({"step": r["training/global_step"], "data": r}) for r in rows))  # veRL file logger
    cal = J.calibrate_from_log(log, cfg, skip=0, model_params=False)
    for k, v in truth.items():
        assert math.isclose(cal.knobs[k], v, rel_tol=0.01), (k, cal.knobs[k])
    assert cal.error("trainer")["p90"] < 1.0 and cal.error("rollout")["p90"] < 1.0


def test_console_and_csv_logs_read_like_jsonl(tmp_path):
    rows = [json.loads(line) for line in LOG.read_text().splitlines()]
    console = tmp_path / "train.log"
    console.write_text("\n".join("(TaskRunner pid=1) step:%d - " % r["training/global_step"] + " - ".join(
        f"{k}:{v}" for k, v in r.items() if k not in ("step", "training/global_step")) for r in rows))
    csv = tmp_path / "metrics.csv"
    import pandas as pd
    pd.DataFrame(rows).to_csv(csv, index=False)
    want = J.read_step_log(LOG)
    for path in (console, csv):
        got = J.read_step_log(path)
        np.testing.assert_allclose(got["timing_s/update_actor"], want["timing_s/update_actor"], rtol=1e-12)
        np.testing.assert_allclose(got["response_length/max"], want["response_length/max"])


def test_step_batch_matches_the_logged_mean_and_max():
    cfg = cfgmod.load("a6000-default")
    p, r = J.step_batch(cfg, 3, 700.0, 2500.0, prompt_mean=300.0)
    assert r.max() == 2500 and abs(r.mean() - 700.0) < 2.0 and abs(p.mean() - 300.0) < 2.0
    assert p.size == r.size == cfg.workload.prompts_per_step * cfg.workload.group_size


def test_bad_logs_name_the_problem(tmp_path):
    bad = tmp_path / "m.jsonl"
    bad.write_text('{"training/global_step": 1, "timing_s/update_actor": 1.0}\n')
    with pytest.raises(J.LogError, match="response_length/mean"):
        J.calibrate_from_log(bad, JOB)
    bad.write_text('{"training/global_step": 1}\n{"training/global_step": 1}\n')
    with pytest.raises(J.LogError, match="step 1 appears twice"):
        J.read_step_log(bad)
    bad.write_text('{"training/global_step": 1}\nnot json\n')
    with pytest.raises(J.LogError, match="line 2"):
        J.read_step_log(bad)
    with pytest.raises(J.LogError, match="no such step log"):
        J.read_step_log(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="knobs"):
        J.calibrate_from_log(LOG, JOB, knobs=["warp_speed"])
    split_free = cfgmod.load(JOB).with_overrides({"cluster.partition": None})
    with pytest.raises(cfgmod.ConfigError, match="cluster.partition"):
        J.calibrate_from_log(LOG, split_free)


def test_async_log_fits_the_trainer_only_and_says_so():
    cal = J.calibrate_from_log(LOG, cfgmod.load(JOB).with_overrides({"rl.staleness": 1}))
    assert set(cal.table["kind"]) == {"trainer"}
    assert "decode_mbu" not in cal.knobs and any("staleness" in n for n in cal.notes)


def test_cli_calibrate_from_log(tmp_path, capsys):
    out = tmp_path / "mine.yaml"
    assert main(["calibrate", "--log", str(LOG), "--config", str(JOB), "--out", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["preset"] == str(out) and set(doc["knobs"]) == set(J.DEFAULT_KNOBS) and out.exists()
    assert main(["calibrate", "--log", str(LOG), "--out", str(out)]) == 2
    assert "--config" in capsys.readouterr().err


def test_config_accepts_a_preset_file(tmp_path):
    with pytest.raises(cfgmod.ConfigError, match="hardware"):
        cfgmod.load("tiny-cpu").with_overrides({"hardware": str(tmp_path / "none.yaml")})
