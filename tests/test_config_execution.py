"""The execution settings real RL jobs use (issue 37): config keys, defaults and their named errors."""

from __future__ import annotations

import pytest

from bidirl.job import config as C
from tests.test_config import base, raises


def test_defaults_keep_todays_behaviour():
    cfg = C.load(base())
    assert cfg.cluster.rollout_tensor_parallel is None
    assert cfg.rl.max_tokens_per_micro_batch is None and cfg.rl.mini_batch_prompts is None
    assert cfg.rl.updates_per_sync == 1 and cfg.rl.sequence_parallel == 1
    assert not cfg.rl.param_offload and not cfg.rl.optimizer_offload
    assert cfg.rl.fsdp_size is None
    assert cfg.workload.response_length_trend == 0.0
    assert cfg.prompts_per_local_update == 64 and cfg.optimizer_updates_per_step == 1


def test_all_settings_accepted_together():
    cfg = C.load(base(cluster={"gpus": 16, "gpus_per_node": 8, "rollout_tensor_parallel": 4},
                      rl={"max_tokens_per_micro_batch": 8192, "mini_batch_prompts": 8, "updates_per_sync": 4,
                          "param_offload": True, "optimizer_offload": True, "activation_checkpointing": True,
                          "sequence_parallel": 2, "recompute_old_logprob": False},
                      workload={"response_length_trend": 0.01}))
    assert cfg.prompts_per_local_update == 16          # 64 prompts / 4 local updates
    assert cfg.optimizer_updates_per_step == 8          # 64 prompts / 8 per mini-batch
    assert cfg.rl.stages == ("ref_logprob", "actor_update")


@pytest.mark.parametrize("tp, contains", [(0, "must be > 0"), (3, "does not divide cluster.gpus_per_node"),
                                          (16, "does not divide cluster.gpus_per_node")])
def test_rollout_tensor_parallel_layout_rules(tp, contains):
    raises(base(cluster={"rollout_tensor_parallel": tp}), "cluster.rollout_tensor_parallel", contains=contains)


def test_rollout_tensor_parallel_must_divide_the_heads():
    # tiny has 4 attention heads: 8-way tensor parallelism cannot split them
    raises(base(model="tiny", cluster={"rollout_tensor_parallel": 8}), "cluster.rollout_tensor_parallel",
           contains="4 attention heads")


def test_rollout_tensor_parallel_must_divide_a_fixed_rollout_pool():
    raises(base(cluster={"gpus": 4, "gpus_per_node": 8, "placement": "any", "partition": [2, 2],
                         "rollout_tensor_parallel": 4}), "cluster.rollout_tensor_parallel",
           contains="2 GPUs is not a whole number of 4-GPU")


def test_rollout_tensor_parallel_rejects_non_integers():
    raises(base(cluster={"rollout_tensor_parallel": 2.5}), "cluster.rollout_tensor_parallel",
           contains="whole number")


@pytest.mark.parametrize("sp, contains", [(0, "must be > 0"), (3, "gpus_per_node")])
def test_sequence_parallel_rules(sp, contains):
    raises(base(rl={"sequence_parallel": sp}), "rl.sequence_parallel", contains=contains)


def test_sequence_parallel_must_divide_the_heads_and_a_fixed_trainer_pool():
    raises(base(model="tiny", rl={"sequence_parallel": 8}), "rl.sequence_parallel", contains="attention heads")
    raises(base(cluster={"gpus": 6, "gpus_per_node": 8, "placement": "any", "partition": [4, 2]},
                rl={"sequence_parallel": 4}), "rl.sequence_parallel", contains="trainer pool of 2 GPUs")


def test_token_budget_must_hold_the_longest_sample():
    # geo3k prompts reach 1024 tokens: with max_response_len 2048 the longest sample is 3072 tokens
    err = raises(base(rl={"max_tokens_per_micro_batch": 3071}), "rl.max_tokens_per_micro_batch",
                 contains="3072 tokens", fix_contains="at least 3072")
    assert "sequence_parallel" in err.fix
    C.load(base(rl={"max_tokens_per_micro_batch": 3072}))
    # sequence parallelism splits a sample over its group: half the budget per device suffices at degree 2
    C.load(base(rl={"max_tokens_per_micro_batch": 1536, "sequence_parallel": 2}))
    raises(base(rl={"max_tokens_per_micro_batch": 0}), "rl.max_tokens_per_micro_batch", contains="> 0")


def test_updates_per_sync_must_split_the_step():
    raises(base(rl={"updates_per_sync": 5}), "rl.updates_per_sync", contains="do not split", fix_contains="4")
    raises(base(rl={"updates_per_sync": 0}), "rl.updates_per_sync", contains="> 0")


def test_mini_batch_must_divide_a_local_update():
    raises(base(rl={"mini_batch_prompts": 5}), "rl.mini_batch_prompts", contains="64 prompts of a local update")
    # 64 prompts in 4 local updates of 16: a mini-batch of 32 spans two of them
    raises(base(rl={"mini_batch_prompts": 32, "updates_per_sync": 4}), "rl.mini_batch_prompts",
           contains="16 prompts")
    raises(base(rl={"mini_batch_prompts": 0}), "rl.mini_batch_prompts", contains="> 0")


@pytest.mark.parametrize("size, contains, fix", [(0, "must be > 0", None),
                                                (3, "not a trainer layout of 16 GPUs", "1, 2, 4, 8, 16"),
                                                (12, "not a trainer layout", "leave it empty"),
                                                (2.5, "whole number", None)])
def test_fsdp_size_must_be_a_trainer_layout(size, contains, fix):
    raises(base(rl={"fsdp_size": size}), "rl.fsdp_size", contains=contains, fix_contains=fix or "")
    for ok in (1, 2, 4, 8, 16):
        assert C.load(base(rl={"fsdp_size": ok})).rl.fsdp_size == ok


def test_fsdp_size_must_divide_a_fixed_pool():
    raises(base(cluster={"gpus": 12, "gpus_per_node": 8, "placement": "any", "partition": [8, 4]},
                rl={"fsdp_size": 8}), "rl.fsdp_size", contains="trainer pool of 4 GPUs")


@pytest.mark.parametrize("key", ["param_offload", "optimizer_offload"])
def test_offload_flags_are_booleans(key):
    raises(base(rl={key: "yes"}), f"rl.{key}", contains="true or false")


def test_length_trend_is_a_number():
    raises(base(workload={"response_length_trend": "grows"}), "workload.response_length_trend",
           contains="expected a number")
    assert C.load(base(workload={"response_length_trend": -0.02})).workload.response_length_trend == -0.02


def test_settings_built_from_dataclasses_get_the_same_checks():
    with pytest.raises(C.ConfigError, match="rl.updates_per_sync"):
        C.JobConfig(rl=C.RLConfig(updates_per_sync=3))


@pytest.mark.parametrize("key, value, why", [("cluster.rollout_tensor_parallel", 2, "one worker per engine"),
                                             ("rl.sequence_parallel", 2, "Ulysses"),
                                             ("rl.fsdp_size", 2, "shard-group size")])
def test_engine_runs_refuse_settings_they_do_not_carry_out(key, value, why):
    cfg = C.load(base()).with_overrides({key: value})
    with pytest.raises(C.ConfigError) as info:
        C.check_engine_run(cfg)
    assert info.value.field == key and "--emulate" in info.value.fix and why in str(info.value)
    C.check_engine_run(C.load(base()))              # the defaults run


@pytest.mark.parametrize("overrides", [{"rl.max_tokens_per_micro_batch": 8192}, {"rl.param_offload": True},
                                       {"rl.optimizer_offload": True}, {"rl.recompute_old_logprob": False},
                                       {"rl.mini_batch_prompts": 16}, {"rl.updates_per_sync": 2}])
def test_engine_runs_take_the_settings_the_engines_carry_out(overrides):
    """Token-budget micro-batches and offload run in the trainer engine, bypass in the engine driver, optimizer
    mini-batches and streaming consumption in the chunk queue and the trainer gangs."""
    C.check_engine_run(C.load(base()).with_overrides(overrides))


def test_the_run_api_refuses_them_before_ray_starts(monkeypatch):
    """``bidirl.cluster.run.run`` (the library's entry, not only the CLI) refuses by name before it touches Ray."""
    import ray

    from bidirl.cluster.run import run
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init called before the refusal"))
    with pytest.raises(C.ConfigError) as info:
        run(C.load(base()).with_overrides({"rl.sequence_parallel": 2}))
    assert info.value.field == "rl.sequence_parallel" and "--emulate" in info.value.fix


def test_cli_run_refuses_them_before_anything_starts(tmp_path, capsys):
    from bidirl.cli import main
    job = tmp_path / "job.yaml"
    job.write_text(C.load("tiny-cpu").with_overrides({"rl.sequence_parallel": 2}).to_yaml())
    assert main(["run", str(job), "--steps", "1", "--out", str(tmp_path / "out")]) == 2
    assert "rl.sequence_parallel" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
