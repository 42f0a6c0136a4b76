"""Bad input to a real (engine) run is rejected before anything starts: no Ray, no engines (unit tests)."""

import pytest

from bidirl import config as cfgmod
from bidirl.cluster.engines.driver import EngineDriver


def test_engine_runs_need_the_built_in_task():
    cfg = cfgmod.load("tiny-cpu").with_overrides({"workload.dataset": "gsm8k"})
    with pytest.raises(cfgmod.ConfigError) as info:
        EngineDriver(cfg, "bidirl", 1, 0)
    assert info.value.field == "workload.dataset" and "arithmetic" in info.value.fix


def test_engine_runs_of_a_preset_model_need_its_weights():
    with pytest.raises(cfgmod.ConfigError) as info:
        EngineDriver(cfgmod.load("a6000-default").with_overrides({"workload.dataset": "arithmetic"}), "bidirl", 1, 0)
    assert info.value.field == "model" and "model_dir" in info.value.fix


def test_generation_slices_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="step_seconds"):
        EngineDriver(cfgmod.load("tiny-cpu"), "bidirl", 1, 0, model_dir=str(tmp_path), step_seconds=0)


def test_unknown_policy_names_the_field():
    from bidirl.cluster.run import run
    with pytest.raises(cfgmod.ConfigError) as info:
        run("tiny-cpu", "bidirll", steps=1)
    assert info.value.field == "scheduler.policy" and "bidirl" in str(info.value)


def test_a_model_folder_without_a_checkpoint_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"model_dir .* holds no config.json"):
        EngineDriver(cfgmod.load("tiny-cpu"), "bidirl", 1, 0, model_dir=str(tmp_path))
