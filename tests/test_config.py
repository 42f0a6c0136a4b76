"""One test per rule of ``bidirl.job.config`` (``_build``/``_coerce`` type rules, ``validate`` cross-field rules).

Every error must be a :class:`ConfigError` that names the offending field and carries a fix the user can act on.
"""

from __future__ import annotations

import json
import math

import pytest

from bidirl.job import config as C
from bidirl.job.config import ConfigError, JobConfig, Partition, SwitchCosts


def base(**sections) -> dict:
    """A small valid job as a dict; ``sections`` replace or extend parts of it."""
    data = {
        "model": "qwen3-vl-4b",
        "hardware": "a6000",
        "cluster": {"gpus": 16, "gpus_per_node": 8, "placement": "node-aligned"},
        "workload": {"dataset": "geo3k", "prompts_per_step": 64, "group_size": 8,
                     "max_response_len": 2048, "steps": 20},
        "rl": {"staleness": 1.0, "partial_rollout": True, "micro_batch_per_device": 4},
        "scheduler": {"policy": "bidirl", "tail_window": 2, "chunks_in_flight": 2},
        "seed": 0,
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return data


def raises(data, field: str, *, contains: str = "", fix_contains: str = "") -> ConfigError:
    """Build ``data`` and check the ConfigError names ``field`` and has a fix that the message includes."""
    with pytest.raises(ConfigError) as info:
        C.load(data)
    err = info.value
    assert err.field == field, f"field {err.field!r} != {field!r} ({err})"
    assert err.fix, f"no fix in {err}"
    assert err.fix in str(err)
    assert str(err).startswith(f"{field}: ") if field else True
    if contains:
        assert contains in str(err), str(err)
    if fix_contains:
        assert fix_contains in err.fix, err.fix
    return err


# --------------------------------------------------------------------------------------------------
# the valid case
# --------------------------------------------------------------------------------------------------

def test_base_is_valid_and_defaults_apply():
    cfg = C.load(base())
    assert isinstance(cfg, JobConfig)
    assert cfg.cluster.partition is None
    assert cfg.rl.reference_model is True           # absent key -> documented default
    assert cfg.scheduler.trainer_on_rollout_pool is None
    assert C.load({}) == JobConfig()                 # an empty mapping is the all-defaults job


def test_load_returns_jobconfig_unchanged():
    cfg = JobConfig()
    assert C.load(cfg) is cfg


@pytest.mark.parametrize("name", ["a6000-default", "h100-default", "tiny-cpu", "tiny-cpu-longtail"])
def test_shipped_example_configs_load_by_name(name):
    cfg = C.load(name)
    assert cfg.cluster.partition is not None
    assert cfg.cluster.partition.rollout + cfg.cluster.partition.trainer == cfg.cluster.gpus


# --------------------------------------------------------------------------------------------------
# _build: unknown keys, sections that are not mappings, missing required keys
# --------------------------------------------------------------------------------------------------

def test_unknown_top_level_key_suggests_close_match():
    raises({**base(), "modle": "qwen3-vl-4b"}, "modle", fix_contains="did you mean 'model'?")


def test_unknown_nested_key_suggests_close_match():
    raises(base(cluster={"gpu": 16}), "cluster.gpu", fix_contains="did you mean 'gpus'?")


def test_unknown_deeply_nested_key_suggests_close_match():
    data = base(scheduler={"trainer_on_rollout_pool": {"c_in": 1.0, "c_out": 1.0, "c_gard": 0.5}})
    raises(data, "scheduler.trainer_on_rollout_pool.c_gard", fix_contains="did you mean 'c_grad'?")


def test_unknown_key_without_close_match_lists_valid_keys():
    err = raises(base(rl={"zzzzzz": 1}), "rl.zzzzzz", fix_contains="valid keys")
    assert "staleness" in err.fix


def test_section_must_be_a_mapping():
    raises(base(cluster=16), "cluster", contains="expected a mapping", fix_contains="gpus")


def test_top_level_must_be_a_mapping():
    with pytest.raises(ConfigError) as info:
        C.from_dict([1, 2])
    assert info.value.field == "(top level)" and info.value.fix


def test_missing_required_key_in_switch_costs():
    data = base(scheduler={"rollout_on_trainer_pool": {"c_in": 1.0}})
    raises(data, "scheduler.rollout_on_trainer_pool.c_out", contains="missing", fix_contains="c_out")


def test_missing_required_key_in_partition():
    raises(base(cluster={"partition": {"rollout": 8}}), "cluster.partition.trainer", contains="missing")


# --------------------------------------------------------------------------------------------------
# _coerce: literals, partitions, booleans, integers, floats, names
# --------------------------------------------------------------------------------------------------

def test_placement_literal_suggests_close_match():
    raises(base(cluster={"placement": "node_aligned"}), "cluster.placement",
           fix_contains="did you mean 'node-aligned'?")


def test_placement_literal_without_close_match_lists_choices():
    raises(base(cluster={"placement": "zzz"}), "cluster.placement", fix_contains="node-aligned")


def test_partition_as_pair_and_as_mapping():
    pair = C.load(base(cluster={"partition": [8, 8]}))
    mapping = C.load(base(cluster={"partition": {"rollout": 8, "trainer": 8}}))
    assert pair == mapping
    assert pair.cluster.partition == Partition(8, 8)
    assert pair.cluster.partition.label() == "8-8"


def test_partition_list_of_wrong_length():
    raises(base(cluster={"partition": [4, 4, 8]}), "cluster.partition", contains="expected a mapping")


def test_partition_null_means_planner_chooses():
    assert C.load(base(cluster={"partition": None})).cluster.partition is None


@pytest.mark.parametrize("value", ["yes", 1, 0, None, "true"])
def test_boolean_field_rejects_non_booleans(value):
    raises(base(rl={"partial_rollout": value}), "rl.partial_rollout", fix_contains="true or false")


@pytest.mark.parametrize("value", [True, False])
def test_integer_field_rejects_booleans(value):
    raises(base(cluster={"gpus": value}), "cluster.gpus", contains="whole number")


@pytest.mark.parametrize("value", [16.5, "16", "sixteen", [16], None])
def test_integer_field_rejects_non_integers(value):
    raises(base(cluster={"gpus": value}), "cluster.gpus", contains="whole number", fix_contains="integer")


def test_integer_field_accepts_integral_float():
    cfg = C.load(base(cluster={"gpus": 16.0}))
    assert cfg.cluster.gpus == 16 and isinstance(cfg.cluster.gpus, int)


@pytest.mark.parametrize("value", ["1", "one", True, math.nan, math.inf, [1.0]])
def test_float_field_rejects_non_numbers(value):
    raises(base(rl={"staleness": value}), "rl.staleness", contains="expected a number")


def test_float_field_accepts_integers():
    cfg = C.load(base(rl={"staleness": 2}))
    assert cfg.rl.staleness == 2.0 and isinstance(cfg.rl.staleness, float)


@pytest.mark.parametrize("value", [5, None, ["qwen3-vl-4b"]])
def test_name_field_rejects_non_text(value):
    raises({**base(), "model": value}, "model", contains="expected a name")


def test_optional_float_accepts_null_and_number():
    assert C.load(base(scheduler={"weight_sync": None})).scheduler.weight_sync is None
    assert C.load(base(scheduler={"weight_sync": 3})).scheduler.weight_sync == 3.0


# --------------------------------------------------------------------------------------------------
# validate: presets
# --------------------------------------------------------------------------------------------------

def test_unknown_model_preset_suggests_close_match():
    raises({**base(), "model": "qwen3-vl-4"}, "model", contains="unknown model preset",
           fix_contains="did you mean")


def test_unknown_hardware_preset_suggests_close_match():
    raises({**base(), "hardware": "a600"}, "hardware", contains="unknown hardware preset",
           fix_contains="did you mean 'a6000'?")


def test_unknown_preset_without_close_match_lists_presets():
    raises({**base(), "hardware": "zzzzzz"}, "hardware", fix_contains="h100")


def test_unknown_dataset_preset_suggests_close_match():
    raises(base(workload={"dataset": "gsm8"}), "workload.dataset", fix_contains="did you mean 'gsm8k'?")


# --------------------------------------------------------------------------------------------------
# validate: cluster
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [0, -8])
def test_gpus_must_be_positive(value):
    raises(base(cluster={"gpus": value, "placement": "any"}), "cluster.gpus", contains="> 0")


@pytest.mark.parametrize("value", [0, -1])
def test_gpus_per_node_must_be_positive(value):
    raises(base(cluster={"gpus_per_node": value}), "cluster.gpus_per_node", contains="> 0")


def test_node_aligned_budget_must_be_whole_nodes():
    raises(base(cluster={"gpus": 12}), "cluster.gpus", contains="whole number of 8-GPU nodes",
           fix_contains="placement: any")


def test_node_aligned_budget_within_one_node_is_allowed():
    assert C.load(base(cluster={"gpus": 4})).cluster.gpus == 4


def test_any_placement_allows_partial_nodes():
    assert C.load(base(cluster={"gpus": 12, "placement": "any"})).cluster.gpus == 12


def test_partition_must_sum_to_budget():
    raises(base(cluster={"partition": [8, 4]}), "cluster.partition", contains="does not sum to cluster.gpus = 16",
           fix_contains="drop partition")


def test_cpus_per_gpu_is_auto_or_a_positive_number():
    assert C.load(base()).cluster.cpus_per_gpu == "auto"
    assert C.load(base(cluster={"cpus_per_gpu": 6})).cluster.cpus_per_gpu == 6.0
    for value in ("automatic", None, True, [8]):
        raises(base(cluster={"cpus_per_gpu": value}), "cluster.cpus_per_gpu", contains="expected 'auto' or a number",
               fix_contains="'auto'")
    for value in (0, -2):
        raises(base(cluster={"cpus_per_gpu": value}), "cluster.cpus_per_gpu", contains="> 0", fix_contains="auto")
    with pytest.raises(ConfigError, match="cluster.cpus_per_gpu"):          # built directly: the same checks
        JobConfig(cluster=C.ClusterConfig(cpus_per_gpu="8"))


@pytest.mark.parametrize("side, pair", [("rollout", [0, 16]), ("trainer", [16, 0]),
                                        ("rollout", [-8, 24]), ("trainer", [24, -8])])
def test_partition_sides_must_be_positive(side, pair):
    raises(base(cluster={"partition": pair}), f"cluster.partition.{side}", contains="> 0")


# --------------------------------------------------------------------------------------------------
# validate: workload, rl, scheduler, seed
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["prompts_per_step", "group_size", "max_response_len", "steps"])
@pytest.mark.parametrize("value", [0, -3])
def test_workload_counts_must_be_positive(key, value):
    raises(base(workload={key: value}), f"workload.{key}", contains="> 0", fix_contains="positive")


def test_staleness_may_be_zero_but_not_negative():
    assert C.load(base(rl={"staleness": 0})).rl.staleness == 0.0
    raises(base(rl={"staleness": -0.5}), "rl.staleness", contains="≥ 0")


@pytest.mark.parametrize("value", [0, -4])
def test_micro_batch_must_be_positive(value):
    raises(base(rl={"micro_batch_per_device": value}), "rl.micro_batch_per_device", contains="> 0")


@pytest.mark.parametrize("key, value, contains", [("lr", 0, "> 0"), ("lr", -1e-3, "> 0"),
                                                   ("clip_eps", 0, "> 0"), ("kl_coef", -0.1, "≥ 0")])
def test_trainer_settings_are_checked(key, value, contains):
    raises(base(rl={key: value}), f"rl.{key}", contains=contains)


def test_a_kl_penalty_needs_the_reference_model():
    assert C.load(base(rl={"kl_coef": 0.01})).rl.kl_coef == 0.01          # reference_model defaults to true
    raises(base(rl={"kl_coef": 0.01, "reference_model": False}), "rl.kl_coef", fix_contains="reference_model")


def test_prompt_pool_is_optional_and_positive():
    assert C.load(base()).workload.prompt_pool is None
    assert C.load(base(workload={"prompt_pool": 16})).workload.prompt_pool == 16
    raises(base(workload={"prompt_pool": 0}), "workload.prompt_pool", contains="> 0")


@pytest.mark.parametrize("policy", C.POLICIES)
def test_every_named_policy_is_accepted(policy):
    assert C.load(base(scheduler={"policy": policy})).scheduler.policy == policy


def test_unknown_policy_suggests_close_match():
    raises(base(scheduler={"policy": "bidrl"}), "scheduler.policy", contains="unknown policy",
           fix_contains="did you mean 'bidirl'?")


def test_a_removed_key_names_its_replacement():
    raises(base(scheduler={"max_chunk": 4}), "scheduler.max_chunk", fix_contains="rl.micro_batch_per_device")


def test_unknown_policy_without_close_match_lists_policies():
    raises(base(scheduler={"policy": "zzzzzz"}), "scheduler.policy", fix_contains="no-borrow")


@pytest.mark.parametrize("key", ["chunks_in_flight", "tail_window"])
@pytest.mark.parametrize("value", [0, -1])
def test_scheduler_counts_must_be_positive(key, value):
    raises(base(scheduler={key: value}), f"scheduler.{key}", contains="> 0")


@pytest.mark.parametrize("direction", ["trainer_on_rollout_pool", "rollout_on_trainer_pool"])
@pytest.mark.parametrize("key", ["c_in", "c_out", "c_grad"])
def test_switch_costs_must_not_be_negative(direction, key):
    costs = {"c_in": 1.0, "c_out": 1.0, "c_grad": 0.0, key: -0.1}
    raises(base(scheduler={direction: costs}), f"scheduler.{direction}.{key}", contains="≥ 0")


def test_switch_costs_may_be_zero_and_override_the_preset():
    cfg = C.load(base(scheduler={"trainer_on_rollout_pool": {"c_in": 0, "c_out": 0}}))
    assert cfg.switch_costs("trainer_on_rollout_pool") == SwitchCosts(0.0, 0.0, 0.0)


def test_weight_sync_must_not_be_negative():
    raises(base(scheduler={"weight_sync": -1}), "scheduler.weight_sync", contains="≥ 0")


def test_seed_must_not_be_negative():
    raises({**base(), "seed": -1}, "seed", contains="≥ 0", fix_contains="non-negative")


def test_dataclass_construction_is_validated_too():
    with pytest.raises(ConfigError) as info:
        JobConfig(cluster=C.ClusterConfig(gpus=16, partition=Partition(4, 4)))
    assert info.value.field == "cluster.partition"


# --------------------------------------------------------------------------------------------------
# files: missing, bad YAML, not a mapping, JSON
# --------------------------------------------------------------------------------------------------

def test_missing_file_names_examples(tmp_path):
    with pytest.raises(ConfigError) as info:
        C.load(tmp_path / "nope.yaml")
    err = info.value
    assert "does not exist" in str(err)
    assert "a6000-default" in err.fix and err.fix in str(err)


def test_bad_yaml_is_reported_with_a_fix(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: qwen3-vl-4b\ncluster: {gpus: 16\n")
    with pytest.raises(ConfigError) as info:
        C.load(path)
    assert "not valid YAML" in str(info.value)
    assert "fix the syntax" in info.value.fix


def test_yaml_that_is_not_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- model\n- cluster\n")
    with pytest.raises(ConfigError) as info:
        C.load(path)
    assert "must hold a mapping" in str(info.value) and "model:" in info.value.fix


def test_errors_inside_files_name_the_field(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("cluster:\n  gpus: 16\n  gpus_pernode: 8\n")
    with pytest.raises(ConfigError) as info:
        C.load(path)
    assert info.value.field == "cluster.gpus_pernode"
    assert "did you mean 'gpus_per_node'?" in info.value.fix


def test_json_file_loads(tmp_path):
    path = tmp_path / "job.json"
    path.write_text(json.dumps(base(cluster={"partition": [8, 8]})))
    assert C.load(path).cluster.partition == Partition(8, 8)


# --------------------------------------------------------------------------------------------------
# with_overrides and round trips
# --------------------------------------------------------------------------------------------------

def test_overrides_apply_dotted_keys_and_leave_the_original_alone():
    cfg = C.load("a6000-default")
    new = cfg.with_overrides({"rl.staleness": 2, "cluster.partition": [4, 12], "model": "qwen3-vl-2b",
                              "workload.max_response_len": 4096})
    assert new.rl.staleness == 2.0
    assert new.cluster.partition == Partition(4, 12)
    assert new.model == "qwen3-vl-2b" and new.workload.max_response_len == 4096
    assert cfg.rl.staleness == 1.0 and cfg.cluster.partition == Partition(8, 8)


def test_override_can_drop_the_partition():
    assert C.load("a6000-default").with_overrides({"cluster.partition": None}).cluster.partition is None


def test_override_fills_an_empty_optional_section():
    cfg = JobConfig().with_overrides({"scheduler.rollout_on_trainer_pool.c_in": 2.0,
                                      "scheduler.rollout_on_trainer_pool.c_out": 3.0})
    assert cfg.scheduler.rollout_on_trainer_pool == SwitchCosts(2.0, 3.0, 0.0)


def test_override_of_a_partial_optional_section_names_the_section():
    with pytest.raises(ConfigError) as info:
        JobConfig().with_overrides({"scheduler.rollout_on_trainer_pool.c_in": 2.0})
    assert info.value.field == "scheduler.rollout_on_trainer_pool.c_out" and info.value.fix


def test_override_with_unknown_key_suggests_close_match():
    with pytest.raises(ConfigError) as info:
        JobConfig().with_overrides({"rl.stalenes": 2})
    assert info.value.field == "rl.stalenes"
    assert "did you mean 'staleness'?" in info.value.fix


def test_override_with_bad_value_is_validated():
    with pytest.raises(ConfigError) as info:
        C.load("a6000-default").with_overrides({"cluster.gpus": 32})
    assert info.value.field == "cluster.partition"      # 8 + 8 no longer sums to 32
    with pytest.raises(ConfigError) as info:
        JobConfig().with_overrides({"scheduler.policy": "verl"})
    assert info.value.field == "scheduler.policy"


@pytest.mark.parametrize("name", ["a6000-default", "h100-default", "tiny-cpu", "tiny-cpu-longtail"])
def test_round_trip_through_yaml_file(tmp_path, name):
    cfg = C.load(name)
    path = tmp_path / "job.yaml"
    path.write_text(cfg.to_yaml())
    assert C.load(path) == cfg


def test_round_trip_with_every_optional_set(tmp_path):
    cfg = JobConfig().with_overrides({
        "cluster.partition": [6, 10],
        "scheduler.trainer_on_rollout_pool": {"c_in": 1.5, "c_out": 0.5, "c_grad": 0.25},
        "scheduler.rollout_on_trainer_pool": {"c_in": 2.0, "c_out": 1.0},
        "scheduler.weight_sync": 0.75, "rl.staleness": 0.5, "seed": 7,
    })
    path = tmp_path / "job.yaml"
    path.write_text(cfg.to_yaml())
    again = C.load(path)
    assert again == cfg
    assert C.from_dict(cfg.to_dict()) == cfg


def test_override_through_a_value_names_the_value():
    with pytest.raises(ConfigError) as info:
        C.load("a6000-default").with_overrides({"rl.staleness.x": 1})
    assert info.value.field == "rl.staleness" and info.value.fix


def test_directly_built_config_is_type_checked():
    from bidirl.job.config import ClusterConfig, JobConfig
    with pytest.raises(ConfigError) as info:
        JobConfig(cluster=ClusterConfig(gpus="16"))
    assert info.value.field == "cluster.gpus"


def test_missing_path_with_a_folder_does_not_fall_back_to_an_example(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        C.load(str(tmp_path / "nowhere" / "tiny-cpu.yaml"))


# --------------------------------------------------------------------------------------------------
# engine-run inputs: the data file and the reward function
# --------------------------------------------------------------------------------------------------

def test_data_file_and_reward_default_to_the_built_in_task():
    cfg = C.load(base())
    assert cfg.workload.data_file is None and cfg.rl.reward == "exact"


@pytest.mark.parametrize("reward", ["exact", "last_number", "boxed", "my_rewards:score", "rewards/gsm8k.py",
                                    "rewards/gsm8k.py:compute_score"])
def test_reward_specs_are_accepted_without_touching_the_file_system(reward):
    assert C.load(base(rl={"reward": reward})).rl.reward == reward


@pytest.mark.parametrize("reward,contains", [("exat", "did you mean 'exact'?"), ("gsm8k", "not a built-in reward"),
                                             ("mod:", "not a Python function name"), ("", "expected a reward name")])
def test_a_bad_reward_spec_names_the_field_and_the_forms(reward, contains):
    raises(base(rl={"reward": reward}), "rl.reward", contains=contains, fix_contains="module:function")


def test_a_reward_must_be_text():
    raises(base(rl={"reward": 1}), "rl.reward", contains="expected a name")


@pytest.mark.parametrize("path", ["data/train.parquet", "/abs/train.jsonl"])
def test_data_files_are_parquet_or_jsonl(path):
    assert C.load(base(workload={"data_file": path})).workload.data_file == path


@pytest.mark.parametrize("path", ["train.csv", "train.json", " "])
def test_other_data_files_are_refused(path):
    raises(base(workload={"data_file": path}), "workload.data_file", contains="is not a .parquet or .jsonl file",
           fix_contains="veRL's layout")


# --------------------------------------------------------------------------------------------------
# workload.response_lengths and workload.forced_lengths (the long-tail CPU job)
# --------------------------------------------------------------------------------------------------

def test_response_lengths_and_forced_lengths_default_to_the_preset_and_off():
    cfg = C.load(base())
    assert cfg.workload.response_lengths is None and cfg.workload.forced_lengths is False
    assert cfg.workload_stats == C.presets.workload("geo3k")


def test_response_lengths_replace_the_presets_response_distribution_only():
    cfg = C.load(base(workload={"dataset": "arithmetic", "max_response_len": 56,
                                "response_lengths": {"mean": 20, "cv": 1.2}, "forced_lengths": True}))
    preset, stats = C.presets.workload("arithmetic"), cfg.workload_stats
    assert cfg.workload.response_lengths == C.ResponseLengths(mean=20.0, cv=1.2)
    assert cfg.workload.forced_lengths is True
    assert stats.response_mean_fraction == pytest.approx(20 / 56) and stats.response_cv == 1.2
    assert stats.step_noise == preset.step_noise                  # empty: the preset's
    assert (stats.prompt_mean, stats.prompt_min, stats.prompt_max) == (preset.prompt_mean, preset.prompt_min,
                                                                      preset.prompt_max)
    assert stats.name == preset.name
    assert "workload.response_lengths" in stats.sources[-1]
    own_noise = C.load(base(workload={"response_lengths": {"mean": 500, "cv": 1, "step_noise": 0.3}}))
    assert own_noise.workload_stats.step_noise == 0.3


def test_response_lengths_round_trip_through_yaml(tmp_path):
    cfg = C.load(base(workload={"response_lengths": {"mean": 300, "cv": 0.8, "step_noise": 0.1},
                                "forced_lengths": True}))
    path = tmp_path / "job.yaml"
    path.write_text(cfg.to_yaml())
    assert C.load(path) == cfg
    assert cfg.with_overrides({"workload.response_lengths.cv": 2.0}).workload.response_lengths.cv == 2.0


@pytest.mark.parametrize("mean", [0, 0.5, 2049, -3])
def test_a_response_mean_outside_one_to_max_response_len_is_refused(mean):
    raises(base(workload={"response_lengths": {"mean": mean, "cv": 1.0}}), "workload.response_lengths.mean",
           contains="must lie in [1, workload.max_response_len = 2048]", fix_contains="raise workload.max_response_len")


@pytest.mark.parametrize("key", ["cv", "step_noise"])
def test_negative_response_spreads_are_refused(key):
    lengths = {"mean": 100, "cv": 1.0, key: -0.1}
    raises(base(workload={"response_lengths": lengths}), f"workload.response_lengths.{key}", contains="≥ 0")


def test_response_lengths_need_a_mean_and_a_cv():
    raises(base(workload={"response_lengths": {"mean": 100}}), "workload.response_lengths.cv",
           contains="missing required key", fix_contains="add 'cv'")


def test_an_unknown_response_lengths_key_gets_a_suggestion():
    raises(base(workload={"response_lengths": {"mean": 100, "cv": 1.0, "step_nosie": 0.1}}),
           "workload.response_lengths.step_nosie", contains="unknown key", fix_contains="did you mean 'step_noise'?")


@pytest.mark.parametrize("value,contains", [("lognormal", "expected a mapping"), (20, "expected a mapping")])
def test_response_lengths_must_be_a_section(value, contains):
    raises(base(workload={"response_lengths": value}), "workload.response_lengths", contains=contains,
           fix_contains="mean")


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_forced_lengths_is_true_or_false(value):
    raises(base(workload={"forced_lengths": value}), "workload.forced_lengths", contains="expected true or false")


def test_response_lengths_built_directly_are_checked_too():
    with pytest.raises(ConfigError) as info:
        JobConfig(workload=C.WorkloadConfig(max_response_len=64, response_lengths=C.ResponseLengths(mean=65, cv=1)))
    assert info.value.field == "workload.response_lengths.mean"


def test_activation_checkpointing_is_a_trainer_setting():
    assert C.load(base()).rl.activation_checkpointing is None          # on for CUDA trainers, off on CPU
    assert C.load(base(rl={"activation_checkpointing": True})).rl.activation_checkpointing is True
    raises(base(rl={"activation_checkpointing": "often"}), "rl.activation_checkpointing")
