"""Calibration on measured stage times (paper appendix "Stage-Time Models", §7.4): the shipped CPU profile,
the knob fit, the calibrated hardware preset, and the errors malformed profiles and presets raise.

Unit tests: they read the shipped records (``data/profiles/cpu-tiny``) and never start an engine; the
end-to-end ``bidirl profile`` + ``bidirl calibrate`` run is in ``tests/test_profiling.py`` (integration).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from bidirl.calibrate.from_records import (calibrate_profile, point_observations, predict_points, preset_document,
                                           split_points, write_preset)
from bidirl.calibrate.records import (META_FILE, ROLLOUT_FILE, TRAINER_FILE, Profile, ProfileError, load_profile,
                                      save_profile)
from bidirl.job import presets
from bidirl.perf import RolloutModel, TrainerModel
from bidirl.perf.fit import calibrate_knobs, knob_hardware
from bidirl.perf.params import KNOBS, default_rollout_params, knob_rollout_params

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = presets.data_dir() / "profiles" / "cpu-tiny"
TINY = presets.model("tiny")


@pytest.fixture(scope="module")
def shipped():
    return load_profile(SHIPPED)


@pytest.fixture(scope="module")
def cal(shipped):
    return calibrate_profile(shipped, holdout=0.25, seed=0)


# --------------------------------------------------------------------------------------------------
# the shipped records
# --------------------------------------------------------------------------------------------------

def test_shipped_profile_is_small_complete_and_described(shipped):
    assert sum(p.stat().st_size for p in SHIPPED.iterdir()) < 300_000        # well under 1 MB
    meta = shipped.meta
    assert meta["model"] == "tiny" and meta["hardware"] == "cpu" and meta["grid"]["name"] == "full"
    assert {"vllm", "torch", "transformers", "bidirl"} <= set(meta["engines"])
    assert meta["machine"]["system"] and meta["machine"]["usable_cpus"] >= 1
    reps = meta["grid"]["repeats"]
    n_points = len(meta["grid"]["batches"]) * len(meta["grid"]["prompt_lens"]) * len(meta["grid"]["response_lens"])
    n_points -= len(meta["settings"]["skipped_points"])
    assert len(shipped.rollout) == n_points * reps and len(shipped.trainer) == 3 * n_points * reps
    assert set(shipped.trainer["stage"]) == {"old_logprob", "ref_logprob", "actor_update"}
    assert (shipped.rollout["d"] == 1).all() and (shipped.rollout["requests"] ==
                                                  shipped.rollout["batch"] * shipped.rollout["group_size"]).all()
    text = "".join(p.read_text() for p in SHIPPED.iterdir())
    assert not re.search(r'"/\w', text) and "hostname" not in text      # no absolute paths or host names


def test_more_work_takes_longer_in_the_shipped_records(shipped):
    """A sanity check of the measurements themselves: at every (prompt, response) length, the median rollout
    time grows with the batch, and at every (batch, prompt) with the response length."""
    obs = point_observations(shipped, "rollout")
    for keys, axis in ((["prompt_len", "response_len"], "batch"), (["batch", "prompt_len"], "response_len")):
        for _, sub in obs.groupby(keys):
            t = sub.sort_values(axis)["observed"].to_numpy()
            assert (np.diff(t) > 0).all(), (keys, axis, sub[[axis, "observed"]])


# --------------------------------------------------------------------------------------------------
# calibrate on the shipped records
# --------------------------------------------------------------------------------------------------

def test_split_is_a_seeded_partition_of_the_grid_points(shipped):
    fit, held = split_points(shipped.points(), 0.25, seed=0)
    assert set(fit).isdisjoint(held) and set(fit) | set(held) == set(shipped.points())
    assert len(held) == round(0.25 * len(shipped.points()))
    again = split_points(shipped.points(), 0.25, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip((fit, held), again))
    assert not np.array_equal(held, split_points(shipped.points(), 0.25, seed=1)[1])


@given(n=st.integers(2, 200), holdout=st.floats(0.01, 0.99), seed=st.integers(0, 2**31))
def test_split_holds_out_at_least_one_and_fits_at_least_one(n, holdout, seed):
    points = np.arange(100, 100 + n)
    fit, held = split_points(points, holdout, seed)
    assert len(fit) >= 1 and len(held) >= 1 and len(fit) + len(held) == n
    assert set(fit) | set(held) == set(points)


@pytest.mark.parametrize("bad", [0, 1, 1.5, -0.1, float("nan"), "0.25", True])
def test_split_rejects_bad_holdout(bad):
    with pytest.raises(ValueError, match="holdout must be a fraction"):
        split_points(np.arange(10), bad, 0)


def test_calibration_on_the_shipped_records_reports_held_out_errors(cal):
    e = cal.errors()
    assert set(e["split"]) == {"fit", "held-out"} and set(e["kind"]) == {"rollout", "trainer"}
    t = cal.table
    held = set(t[t["split"] == "held-out"]["point"])
    assert held.isdisjoint(t[t["split"] == "fit"]["point"])
    for kind in ("rollout", "trainer"):
        prior, knobs, fitted = (cal.error(kind, "held-out", p) for p in ("prior", "knobs", "calibrated"))
        # the nominal CPU priors are off by factors; measured calibration brings the error to the noise level
        assert prior["median"] > 50 and fitted["median"] < 10 and fitted["p90"] < 25, (kind, prior, fitted)
        assert knobs["median"] < 15, (kind, knobs)
    # every held-out point is predicted through the preset as loaded (knob-derived priors + stage_params)
    rollout = RolloutModel(TINY, cal.hardware)
    row = t[(t["kind"] == "rollout") & (t["split"] == "held-out")].iloc[0]
    assert row["calibrated"] == pytest.approx(rollout.stage_time(row["prompt_lens"], row["response_lens"], 1, 4))


def test_calibration_is_deterministic(shipped, cal):
    again = calibrate_profile(shipped, holdout=0.25, seed=0)
    assert again.knobs == cal.knobs and again.stage_params == cal.stage_params
    pd.testing.assert_frame_equal(again.errors(), cal.errors())


def _numbers(doc, prefix=""):
    """``{dotted key: number}`` of a nested mapping (the numeric leaves)."""
    out = {}
    for k, v in doc.items():
        if isinstance(v, dict):
            out.update(_numbers(v, f"{prefix}{k}."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"{prefix}{k}"] = v
    return out


def _quoted_errors(source: str) -> list:
    return [float(x) for x in re.findall(r"(?:median|p90) ([\d.]+) %", source)]


def test_shipped_calibrated_preset_is_what_calibrating_the_shipped_records_gives(cal):
    """data/presets/hardware/cpu-calibrated.yaml is regenerated, not edited: `bidirl calibrate
    data/profiles/cpu-tiny --out data/presets/hardware/cpu-calibrated.yaml` gives the same document (up to the
    last digits, which another machine's floating point may change)."""
    shipped = yaml.safe_load((presets.data_dir() / "presets" / "hardware" / "cpu-calibrated.yaml").read_text())
    fresh = json.loads(json.dumps(preset_document(cal)))
    assert set(shipped) == set(fresh) and shipped["sources"][:-1] == fresh["sources"][:-1]
    a, b = _numbers(shipped), _numbers(fresh)
    assert set(a) == set(b) and all(a[k] == pytest.approx(b[k], rel=1e-3) for k in a), (a, b)
    assert "data/profiles/cpu-tiny" in shipped["sources"][-1]
    quoted, computed = _quoted_errors(shipped["sources"][-1]), _quoted_errors(fresh["sources"][-1])
    # quoted with one decimal (±0.05 points) from parameters that agree to 1e-3 relative (above), which moves an
    # error of ≤ 100 % by ≤ 0.1 point: 0.15
    assert len(quoted) == 8 and np.allclose(quoted, computed, atol=0.15)


def test_the_benchmark_page_states_the_measured_errors(cal):
    """benchmarks/calibration_cpu.md quotes the held-out errors of this very calibration."""
    text = (ROOT / "benchmarks" / "calibration_cpu.md").read_text()
    for kind in ("rollout", "trainer"):
        for pred in ("calibrated", "knobs"):
            e = cal.error(kind, "held-out", pred)
            row = re.search(rf"^\| {kind} \| {pred} \| held-out \| ([\d.]+) % \| ([\d.]+) % \|", text, re.M)
            assert row, f"no held-out row for {kind} / {pred} in calibration_cpu.md"
            # the page quotes one decimal: ±0.05 point, + 0.01 for the last digits another machine may change
            assert np.allclose([float(row.group(1)), float(row.group(2))], [e["median"], e["p90"]], atol=0.06)


# --------------------------------------------------------------------------------------------------
# the calibrated preset changes predictions
# --------------------------------------------------------------------------------------------------

def test_calibrated_preset_changes_the_models_defaults():
    cpu, calibrated = presets.hardware("cpu"), presets.hardware("cpu-calibrated")
    entry = calibrated.stage_params["tiny"]
    r = RolloutModel(TINY, calibrated).params
    for field, value in entry["rollout"].items():
        if field != "tp":
            assert getattr(r, field) == value
    t = TrainerModel(TINY, calibrated).params
    assert t.tau == entry["trainer"]["tau"] and t.alpha == entry["trainer"]["alpha"]
    # at every measured point the calibrated preset predicts the measured time far better than the nominal one
    obs = point_observations(load_profile(SHIPPED), "rollout")
    for row in obs.itertuples():
        new_err, old_err = (abs(RolloutModel(TINY, hw).stage_time(row.prompt_lens, row.response_lens, 1, 4)
                                - row.observed) / row.observed for hw in (calibrated, cpu))
        assert new_err < 0.3 and new_err < old_err / 2, row
    obs = point_observations(load_profile(SHIPPED), "trainer")
    for row in obs.itertuples():
        new_err, old_err = (abs(TrainerModel(TINY, hw).chunk_time(row.stage, row.prompt_lens, row.response_lens, 1)
                                - row.observed) / row.observed for hw in (calibrated, cpu))
        assert new_err < 0.3 and new_err < old_err / 5, row
    # a replica of another layout, or another model, gets the calibrated knobs (no stage_params apply)
    other = presets.model("qwen3-vl-2b")
    assert RolloutModel(other, calibrated).params == knob_rollout_params(other, calibrated)
    assert RolloutModel(other, calibrated).params != RolloutModel(other, cpu).params
    assert RolloutModel(TINY, calibrated, tp=2).params == knob_rollout_params(TINY, calibrated, 2)


def test_tiny_cpu_config_uses_the_calibrated_preset():
    from bidirl.job.config import load
    from bidirl.perf.predictor import StagePredictor
    cfg = load("tiny-cpu")
    assert cfg.hardware == "cpu-calibrated"
    pred = StagePredictor.from_config(cfg, 1, 1)
    assert pred.rollout.params == RolloutModel(TINY, presets.hardware("cpu-calibrated")).params


def test_knobs_carry_over_to_other_models():
    """Knob-derived priors of any model follow the preset's knobs (what makes a calibration transferable)."""
    hw = presets.hardware("cpu")
    other = presets.model("qwen3-vl-2b")
    slow = knob_hardware(hw, {"prefill_mfu": hw.prefill_mfu / 2, "decode_token_overhead": 1e-4})
    base, changed = default_rollout_params(other, hw), default_rollout_params(other, slow)
    assert hw.decode_token_overhead == 0.0
    assert changed.alpha_pre == pytest.approx(2 * base.alpha_pre)
    assert changed.beta_tok == pytest.approx(2 * base.beta_tok + 1e-4)
    assert changed.tau_dec == base.tau_dec


# --------------------------------------------------------------------------------------------------
# the knob fit recovers knob-generated times
# --------------------------------------------------------------------------------------------------

def _synthetic(hw, shipped):
    """The shipped grid's points with times computed from ``hw``'s knob-derived models."""
    out = {}
    for kind in ("rollout", "trainer"):
        obs = point_observations(shipped, kind).assign(kind=kind)
        obs["observed"] = predict_points(obs, hw, TINY, shipped.meta)
        out[kind] = obs
    return out


@settings(max_examples=8)
@given(train=st.floats(0.05, 1.0), prefill=st.floats(0.05, 1.0), decode=st.floats(0.05, 1.0),
       kernel=st.floats(1e-5, 2e-3), sched=st.floats(1e-4, 5e-3), token=st.floats(0.0, 2e-4))
def test_knob_fit_recovers_the_predictions_of_knob_generated_records(shipped, train, prefill, decode, kernel,
                                                                     sched, token):
    base = presets.hardware("cpu")
    truth = knob_hardware(base, {"train_mfu": train, "prefill_mfu": prefill, "decode_mbu": decode,
                                 "kernel_overhead_per_layer": kernel, "scheduler_overhead": sched,
                                 "decode_token_overhead": token})
    data = _synthetic(truth, shipped)
    fit = calibrate_knobs(TINY, base, data["rollout"], data["trainer"])
    assert fit.success
    # the knobs are not all identifiable from one model (decode_mbu and scheduler_overhead both set τ_dec),
    # but the predictions they make are
    assert fit.rollout_errors.max() < 1e-4 and fit.trainer_errors.max() < 1e-4, fit.report()
    assert all(0 < fit.knobs[k] <= 1 for k in ("train_mfu", "prefill_mfu", "decode_mbu"))
    assert fit.knobs["train_mfu"] == pytest.approx(train, rel=1e-4)


def test_knob_fit_needs_records():
    with pytest.raises(ValueError, match="rollout_records and/or trainer_records"):
        calibrate_knobs(TINY, presets.hardware("cpu"))


# --------------------------------------------------------------------------------------------------
# malformed profiles: the error names the file, the field and the fix
# --------------------------------------------------------------------------------------------------

@pytest.fixture
def profile_copy(tmp_path):
    folder = tmp_path / "prof"
    shutil.copytree(SHIPPED, folder)
    return folder


def _meta(folder, **changes):
    meta = json.loads((folder / META_FILE).read_text())
    for k, v in changes.items():
        if v is None:
            meta.pop(k)
        else:
            meta[k] = v
    (folder / META_FILE).write_text(json.dumps(meta))


@pytest.mark.parametrize("change, field, fix", [
    ({"model": None}, "model", "re-run `bidirl profile`"),
    ({"format": "something"}, "format", "not a bidirl profile"),
    ({"version": 99}, "version", "re-run `bidirl profile`"),
    ({"hardware": ""}, "hardware", "name the"),
    ({"machine": "a laptop"}, "machine", "re-run `bidirl profile`"),
])
def test_bad_meta_names_file_field_and_fix(profile_copy, change, field, fix):
    _meta(profile_copy, **change)
    with pytest.raises(ProfileError) as info:
        load_profile(profile_copy)
    msg = str(info.value)
    assert "meta.json" in msg and field in msg and fix in msg


def test_missing_files_are_named(profile_copy, tmp_path):
    with pytest.raises(ProfileError, match="no such profile folder"):
        load_profile(tmp_path / "nowhere")
    (profile_copy / TRAINER_FILE).unlink()
    with pytest.raises(ProfileError, match=r"trainer\.csv: missing .* re-run `bidirl profile`"):
        load_profile(profile_copy)
    (profile_copy / META_FILE).write_text("{not json")
    with pytest.raises(ProfileError, match=r"meta\.json: not valid JSON"):
        load_profile(profile_copy)


BAD_CELLS = {
    "observed": ["-1", "0", "nan", "fast"],
    "prompt_len": ["0", "2.5", "x"],
    "response_len": ["-3", ""],
    "requests": ["0"],
    "d": ["0", "1.5"],
    "batch": ["-1"],
}


@settings(max_examples=30)
@given(data=st.data())
def test_any_bad_cell_is_named_by_file_row_and_field(tmp_path_factory, data):
    folder = tmp_path_factory.mktemp("bad")
    shutil.copytree(SHIPPED, folder, dirs_exist_ok=True)
    name = data.draw(st.sampled_from([ROLLOUT_FILE, TRAINER_FILE]))
    column = data.draw(st.sampled_from(sorted(BAD_CELLS)))
    value = data.draw(st.sampled_from(BAD_CELLS[column]))
    df = pd.read_csv(folder / name, dtype=str, keep_default_na=False)
    row = data.draw(st.integers(0, len(df) - 1))
    df.loc[row, column] = value
    df.to_csv(folder / name, index=False)
    with pytest.raises(ProfileError) as info:
        load_profile(folder)
    msg = str(info.value)
    assert name in msg and f"'{column}'" in msg and "must be" in msg
    # the first bad row is this one unless an earlier row of the same column was already bad (it was not)
    assert f"row {row + 1}," in msg


@pytest.mark.parametrize("edit, match", [
    (lambda df: df.drop(columns=["observed"]), r"missing column\(s\) observed"),
    (lambda df: df.assign(stage="backward"), r"field 'stage' is 'backward' — use one of"),
    (lambda df: pd.concat([df, df.iloc[:1]]), r"repeats \(point, rep, stage\)"),
    (lambda df: df.assign(prompt_len=np.where(df.index == 0, 63, df["prompt_len"])), "different shapes"),
    (lambda df: df.iloc[:0], "no records"),
])
def test_bad_trainer_tables_are_rejected(profile_copy, edit, match):
    df = pd.read_csv(profile_copy / TRAINER_FILE)
    edit(df).to_csv(profile_copy / TRAINER_FILE, index=False)
    with pytest.raises(ProfileError, match=match) as info:
        load_profile(profile_copy)
    assert TRAINER_FILE in str(info.value)


def test_a_rollout_unit_is_whole_groups(profile_copy):
    df = pd.read_csv(profile_copy / ROLLOUT_FILE)
    df.loc[3, "requests"] += 1
    df.to_csv(profile_copy / ROLLOUT_FILE, index=False)
    with pytest.raises(ProfileError, match=r"row 4, field 'requests' .* whole prompt groups"):
        load_profile(profile_copy)


def test_save_and_load_round_trip(shipped, tmp_path):
    meta = {k: v for k, v in shipped.meta.items() if k not in ("format", "version")}
    out = save_profile(tmp_path / "p", meta, shipped.rollout, shipped.trainer)
    again = load_profile(out)
    pd.testing.assert_frame_equal(again.rollout.drop(columns=["prompt_lens", "response_lens"]),
                                  shipped.rollout.drop(columns=["prompt_lens", "response_lens"]))
    assert again.meta == shipped.meta
    with pytest.raises(ProfileError, match="missing field"):
        save_profile(tmp_path / "q", {"model": "tiny"}, shipped.rollout, shipped.trainer)


def test_calibrating_profiles_of_several_replicas_is_refused(shipped):
    prof = Profile(shipped.meta, shipped.rollout.assign(d=2), shipped.trainer, None)
    with pytest.raises(ProfileError, match="d = 1"):
        calibrate_profile(prof)


# --------------------------------------------------------------------------------------------------
# malformed presets: the error names the file, the field and the fix
# --------------------------------------------------------------------------------------------------

@pytest.fixture
def user_data(tmp_path, monkeypatch):
    root = tmp_path / "data"
    for part in ("presets", "configs"):
        shutil.copytree(presets.data_dir() / part, root / part)
    monkeypatch.setenv("BIDIRL_DATA", str(root))
    return root / "presets" / "hardware"


def _write_hw(folder, name, **changes):
    doc = yaml.safe_load((folder / "cpu-calibrated.yaml").read_text())
    for key, value in changes.items():
        doc[key] = value
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(doc))


@pytest.mark.parametrize("changes, field", [
    ({"train_mfu": 1.5}, "train_mfu"),
    ({"prefill_mfu": 0}, "prefill_mfu"),
    ({"decode_mbu": -0.2}, "decode_mbu"),
    ({"scheduler_overhead": -1e-3}, "scheduler_overhead"),
    ({"kernel_overhead_per_layer": float("inf")}, "kernel_overhead_per_layer"),
    ({"decode_token_overhead": "fast"}, "decode_token_overhead"),
    ({"stage_params": {"tiny": {"rollout": {"tau_pre": 1e-3}}}}, "stage_params.tiny.rollout.tp"),
    ({"stage_params": {"tiny": {"rollout": {"tp": 1, "tau_prefill": 1e-3}}}}, "stage_params.tiny.rollout"),
    ({"stage_params": {"tiny": {"rollout": {"tp": 1, "beta_tok": -1.0}}}}, "stage_params.tiny.rollout.beta_tok"),
    ({"stage_params": {"tiny": {"rollout": {"tp": 1, "r": 0.5}}}}, "stage_params.tiny.rollout.r"),
    ({"stage_params": {"tiny": {"trainer": {"layout": 0, "tau": 1e-3}}}}, "stage_params.tiny.trainer.layout"),
    ({"stage_params": {"tiny": {"trainer": {"layout": 1, "tau": {"backward": 1e-3}}}}},
     "stage_params.tiny.trainer.tau"),
    ({"stage_params": {"tiny": {"decoder": {}}}}, "stage_params.tiny"),
    ({"stage_params": ["tiny"]}, "stage_params"),
])
def test_bad_preset_values_name_file_field_and_fix(user_data, changes, field):
    _write_hw(user_data, "broken", **changes)
    presets._load.cache_clear()
    with pytest.raises(presets.PresetError) as info:
        presets.hardware("broken")
    assert "broken.yaml" in str(info.value) and field in str(info.value)
    assert "bidirl calibrate" in info.value.fix and "broken.yaml" in info.value.fix


def test_bad_preset_in_a_config_is_a_config_error_naming_hardware(user_data):
    from bidirl.job.config import ConfigError, load
    _write_hw(user_data, "broken", train_mfu=2.0)
    presets._load.cache_clear()
    with pytest.raises(ConfigError) as info:
        load("tiny-cpu").with_overrides({"hardware": "broken"})
    assert info.value.field == "hardware" and "train_mfu" in str(info.value)


def test_per_stage_and_uniform_trainer_overrides(user_data):
    _write_hw(user_data, "uniform", stage_params={"tiny": {"trainer": {"layout": 1, "tau": 0.01,
                                                                       "alpha": {"actor_update": 2e-11}}}})
    presets._load.cache_clear()
    hw = presets.hardware("uniform")
    params = TrainerModel(TINY, hw).params
    knob_only = TrainerModel(TINY, knob_hardware(hw, {})).params
    assert set(params.tau.values()) == {0.01}
    assert params.alpha["actor_update"] == 2e-11 and params.alpha["old_logprob"] == knob_only.alpha["old_logprob"]
    assert TrainerModel(TINY, hw, layout=2).params.tau == TrainerModel(TINY, knob_hardware(hw, {}), layout=2).params.tau


def test_write_preset_refuses_other_suffixes_and_loads_back(cal, tmp_path):
    with pytest.raises(ValueError, match=r"\.yaml file named after the preset"):
        write_preset(cal, tmp_path / "x.yml")
    path = write_preset(cal, tmp_path / "my-cpu.yaml")
    hw = presets.load_hardware_file(path)
    assert hw.name == "my-cpu" and hw.knobs() == {**presets.hardware("cpu").knobs(), **cal.knobs}
    assert hw.stage_params == cal.hardware.stage_params
    assert dataclasses.replace(hw, name="cpu", sources=(), stage_params={}, **presets.hardware("cpu").knobs()) == \
        dataclasses.replace(presets.hardware("cpu"), sources=())      # the datasheet numbers are the base's
    assert hw.sources[:-1] == presets.hardware("cpu").sources and "bidirl calibrate" in hw.sources[-1]


def test_knobs_are_the_documented_ones():
    assert set(KNOBS) == {"train_mfu", "prefill_mfu", "decode_mbu", "kernel_overhead_per_layer",
                          "scheduler_overhead", "decode_token_overhead"}
    assert presets.hardware("a6000").knobs()["scheduler_overhead"] == 1e-3      # the documented default
