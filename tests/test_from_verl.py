"""``bidirl config from-verl`` (issue 37, item 2): veRL's own example configs convert with every key mapped or named
as not used, the settings real jobs use are mapped, the result loads as a bidirl job, and bad input gets a named
error (Hydra's rules for ``+``, ``++`` and ``~`` included)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from bidirl import cli
from bidirl.errors import ConfigError
from bidirl.job import presets
from bidirl.job.config import load
from bidirl.job.from_verl import RULES, convert, key_table, rule_for
from bidirl.job.verl_input import VerlInput, parse_override, read_inputs

DATA = Path(__file__).resolve().parent / "data" / "verl_configs"
FIXTURES = sorted(p.name for p in DATA.iterdir())
A, R, F, M = ("actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.ref",
              "actor_rollout_ref.model")

#: keys the issue requires mapped, never "not used", wherever an input sets them
MUST_MAP = (f"{R}.tensor_model_parallel_size", f"{A}.use_dynamic_bsz", f"{A}.ppo_max_token_len_per_gpu",
            f"{R}.log_prob_max_token_len_per_gpu", f"{F}.log_prob_max_token_len_per_gpu",
            f"{R}.log_prob_use_dynamic_bsz", f"{F}.log_prob_use_dynamic_bsz",
            "async_training.require_batches", "async_training.trigger_parameter_sync_step",
            "async_training.staleness_threshold", "async_training.partial_rollout",
            f"{A}.fsdp_config.param_offload", f"{A}.fsdp_config.optimizer_offload", f"{A}.fsdp_config.fsdp_size",
            f"{M}.enable_gradient_checkpointing", f"{A}.ulysses_sequence_parallel_size", f"{R}.n",
            f"{A}.ppo_mini_batch_size", f"{A}.ppo_micro_batch_size_per_gpu", "data.max_response_length",
            "data.max_prompt_length", "trainer.n_gpus_per_node", "trainer.nnodes", "rollout.n_gpus_per_node",
            "rollout.nnodes", "rollout.total_rollout_steps", "trainer.total_training_steps", f"{A}.optim.lr",
            "algorithm.kl_ctrl.kl_coef", f"{A}.use_kl_loss", f"{A}.kl_loss_coef", f"{A}.clip_ratio_low",
            f"{R}.name", f"{M}.path", "async_training.use_rollout_log_probs")


def conv(*items, **kw):
    kw.setdefault("hardware", "h100")
    return convert([str(DATA / i) if (DATA / i).exists() else i for i in items], **kw)


def input_keys(name):
    return {o.key for o in read_inputs([str(DATA / name)]).overrides}


def loadable(name):
    """--model/--dataset for fixtures whose presets are not shipped (none when they are)."""
    c = conv(name)
    missing = {m["key"] for m in c.missing}
    return {"model": "qwen3-8b" if "model" in missing else None,
            "dataset": "gsm8k" if "workload.dataset" in missing else None}


# --------------------------------------------------------------------------------------------------
# every key accounted for
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FIXTURES)
def test_every_fixture_key_is_mapped_or_named_with_a_reason(name):
    c = conv(name)
    mapped = [r["key"] for r in c.mapped if r["origin"] == "input"]
    unused = [r["key"] for r in c.not_used if r["origin"] == "input"]
    assert len(mapped) == len(set(mapped)) and len(unused) == len(set(unused))
    assert not set(mapped) & set(unused)
    assert set(mapped) | set(unused) == input_keys(name)
    assert all(r["how"] and r["bidirl"] is not None for r in c.mapped)
    assert all(r["reason"] for r in c.not_used)


@pytest.mark.parametrize("name", FIXTURES)
def test_the_required_keys_are_mapped_never_not_used(name):
    c = conv(name)
    given_keys = input_keys(name)
    mapped = {r["key"] for r in c.mapped if r["origin"] == "input"}
    required = MUST_MAP + (("data.train_batch_size",) if c.trainer == "colocated" else ())
    for key in required:
        if key in given_keys:
            assert key in mapped, f"{name}: {key} is not mapped"


def test_the_rule_table_maps_every_required_key():
    table = {k: target for k, target, _ in key_table()}
    for key in MUST_MAP:
        assert table[key] != "not used", key
    assert table["data.train_batch_size"] == "workload.prompts_per_step"
    assert len({r.pattern for r in RULES}) == len(RULES), "a veRL key has two rules"


def test_the_fully_async_batch_size_is_named_not_used_where_verl_ignores_it():
    c = conv("fully_async_dapo_7b_math_16_16.sh")
    row = next(r for r in c.not_used if r["key"] == "data.train_batch_size")
    assert "not effective in the fully-async trainer" in row["reason"]


# --------------------------------------------------------------------------------------------------
# the values
# --------------------------------------------------------------------------------------------------

def test_colocated_grpo_example():
    c = conv("grpo_qwen3-8b_gsm8k.sh")
    assert c.trainer == "colocated" and c.entry == "verl.trainer.main_ppo" and not c.missing
    assert c.config["model"] == "qwen3-8b" and c.config["workload"]["dataset"] == "gsm8k"
    assert c.config["cluster"] == {"gpus": 8, "gpus_per_node": 8, "rollout_tensor_parallel": 2}
    w, rl = c.config["workload"], c.config["rl"]
    assert (w["prompts_per_step"], w["group_size"], w["max_response_len"], w["max_prompt_len"]) == (1024, 5, 1024, 512)
    assert w["steps"] == 20 and any(d["bidirl"] == "workload.steps" for d in c.derived)   # epochs: not derivable
    assert rl["micro_batch_per_device"] == 32 and "max_tokens_per_micro_batch" not in rl
    assert (rl["mini_batch_prompts"], rl["updates_per_sync"], rl["staleness"], rl["partial_rollout"]) == (256, 1, 0.0,
                                                                                                           False)
    assert rl["reference_model"] and rl["kl_coef"] == 0.001 and rl["recompute_old_logprob"]
    assert c.config["scheduler"]["policy"] == "verl-colocated"
    budget = next(r for r in c.mapped if r["key"] == f"{A}.ppo_max_token_len_per_gpu")
    assert (budget["value"], budget["origin"]) == (16384, "veRL default")   # ppo_trainer.yaml's default


def test_token_budget_example_and_its_engine_warning():
    c = conv("grpo_qwen2-7b_seq_balance.sh")
    assert c.config["rl"]["max_tokens_per_micro_batch"] == 24000
    assert "micro_batch_per_device" not in c.config["rl"]
    assert any("sglang" in w for w in c.warnings)
    assert c.config["model"] == "qwen2-7b-instruct" and [m["key"] for m in c.missing] == ["model"]


def test_dapo_colocated_examples():
    c = conv("dapo_qwen2.5-7b-math.sh")
    w, rl = c.config["workload"], c.config["rl"]
    assert c.config["cluster"]["gpus"] == 64 and c.config["cluster"]["rollout_tensor_parallel"] == 4
    assert (w["prompts_per_step"], w["group_size"], w["max_response_len"], w["steps"]) == (512, 16, 8192, 200)
    assert (rl["max_tokens_per_micro_batch"], rl["sequence_parallel"], rl["param_offload"],
            rl["optimizer_offload"]) == (20480, 4, True, True)
    assert not rl["reference_model"] and rl["kl_coef"] == 0.0 and rl["clip_eps"] == 0.2
    recipe = conv("dapo_qwen2.5-32b_recipe.sh")
    assert recipe.entry == "recipe.dapo.main_dapo" and recipe.config["cluster"]["gpus"] == 128
    assert any(w.startswith("algorithm.filter_groups.enable") for w in recipe.warnings)


def test_fully_async_example():
    c = conv("fully_async_dapo_7b_math_16_16.sh")
    assert c.trainer == "fully-async"
    assert c.config["cluster"] == {"gpus": 32, "gpus_per_node": 8, "partition": {"rollout": 16, "trainer": 16},
                                   "rollout_tensor_parallel": 4}
    w, rl = c.config["workload"], c.config["rl"]
    # require_batches 4 × ppo_mini_batch_size 32 × trigger_parameter_sync_step 4; 512 · 400 prompts ÷ 512
    assert (w["prompts_per_step"], w["steps"], w["group_size"], w["max_response_len"]) == (512, 400, 16, 28672)
    assert (rl["updates_per_sync"], rl["mini_batch_prompts"], rl["staleness"], rl["partial_rollout"]) == (4, 32, 0.1,
                                                                                                          True)
    assert rl["recompute_old_logprob"] is False            # use_rollout_log_probs: the bypass
    assert (rl["max_tokens_per_micro_batch"], rl["sequence_parallel"]) == (61440, 4)
    assert c.config["scheduler"]["policy"] == "verl-async"
    assert rl["fsdp_size"] == 8                            # fsdp_config.fsdp_size 8 of the 16 trainer GPUs


def test_fsdp_size_maps_to_the_shard_group_or_to_the_planners_choice():
    """A shard group smaller than the trainer's GPUs is rl.fsdp_size; -1 (veRL's default) and a group as large as
    the trainer leave it empty, with the reason in the key table."""
    assert conv("fully_async_dapo_7b_math_16_16.sh", f"{A}.fsdp_config.fsdp_size=2").config["rl"]["fsdp_size"] == 2
    for whole in ("-1", "16", "32"):
        c = conv("fully_async_dapo_7b_math_16_16.sh", f"{A}.fsdp_config.fsdp_size={whole}")
        assert c.config["rl"]["fsdp_size"] is None
        row = next(r for r in c.mapped if r["key"] == f"{A}.fsdp_config.fsdp_size")
        assert row["bidirl"] == ["rl.fsdp_size"] and "all 16 trainer GPUs" in row["how"]
    # colocated 64 GPUs with fsdp_size 32: a 32-GPU shard group, replicated twice
    assert conv("dapo_qwen2.5-7b-math.sh").config["rl"]["fsdp_size"] == 32


def test_a_yaml_and_the_overrides_it_writes_down_convert_alike():
    """The 64-64 YAML fixture is the 16-16 script with 8 + 8 nodes and staleness 0.5."""
    from_yaml = conv("fully_async_dapo_7b_math_64_64.yaml")
    from_script = conv("fully_async_dapo_7b_math_16_16.sh", "trainer.nnodes=8", "rollout.nnodes=8",
                       "async_training.staleness_threshold=0.5")
    assert from_yaml.config == from_script.config
    assert from_yaml.config["cluster"]["partition"] == {"rollout": 64, "trainer": 64}


def test_partial_rollout_follows_verl_only_with_staleness():
    c = conv("fully_async_dapo_7b_math_16_16.sh", "async_training.staleness_threshold=0")
    assert c.config["rl"]["partial_rollout"] is False and c.config["rl"]["staleness"] == 0.0


def test_recompute_comes_back_with_prox_log_probs_and_bypass_mode_turns_it_off():
    assert conv("fully_async_dapo_7b_math_16_16.sh",
                "async_training.compute_prox_log_prob=True").config["rl"]["recompute_old_logprob"] is True
    assert conv("grpo_qwen3-8b_gsm8k.sh",
                "algorithm.rollout_correction.bypass_mode=True").config["rl"]["recompute_old_logprob"] is False


def test_kl_in_reward_maps_its_coefficient():
    c = conv("dapo_qwen2.5-7b-math.sh", "algorithm.use_kl_in_reward=True", "algorithm.kl_ctrl.kl_coef=0.002")
    assert c.config["rl"]["reference_model"] and c.config["rl"]["kl_coef"] == 0.002


def test_models_and_datasets_match_presets_by_name():
    c = conv("dapo_qwen2.5-7b-math.sh")
    shipped = "qwen2.5-math-7b" in presets.names("models")
    assert c.config["model"] == "qwen2.5-math-7b"
    assert ("model" in {m["key"] for m in c.missing}) is not shipped
    named = next(m for m in c.missing if m["key"] == "model") if not shipped else None
    if named:
        assert "data/presets/models/qwen2.5-math-7b.yaml" in named["fix"]
    assert c.config["workload"]["dataset"] == ("dapo-math" if "dapo-math" in presets.names("workloads") else None)
    assert conv("dapo_qwen2.5-7b-math.sh", model="qwen3-8b", dataset="gsm8k").config["model"] == "qwen3-8b"


def test_missing_hardware_is_named():
    c = convert([str(DATA / "grpo_qwen3-8b_gsm8k.sh")])
    assert [m["key"] for m in c.missing] == ["hardware"] and c.config["hardware"] is None
    assert "hardware" in c.load_error()


# --------------------------------------------------------------------------------------------------
# into bidirl
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FIXTURES)
def test_every_fixture_loads_as_a_bidirl_job(name, tmp_path):
    c = conv(name, **loadable(name))
    assert c.load_error() is None
    path = tmp_path / "job.yaml"
    path.write_text(c.to_yaml())
    job = load(str(path))
    assert job.cluster.rollout_tensor_parallel == c.config["cluster"]["rollout_tensor_parallel"]
    assert job.workload.prompts_per_step == c.config["workload"]["prompts_per_step"]
    assert job.rl.updates_per_sync == c.config["rl"]["updates_per_sync"]
    assert job.rl.mini_batch_prompts == c.config["rl"]["mini_batch_prompts"]
    assert job.rl.max_tokens_per_micro_batch == c.config["rl"].get("max_tokens_per_micro_batch")
    assert job.rl.sequence_parallel == c.config["rl"]["sequence_parallel"]
    assert (job.rl.param_offload, job.rl.optimizer_offload) == (c.config["rl"]["param_offload"],
                                                                c.config["rl"]["optimizer_offload"])
    assert job.rl.activation_checkpointing == c.config["rl"]["activation_checkpointing"]


def test_the_colocated_example_loads_without_substitutes():
    job = load(conv("grpo_qwen3-8b_gsm8k.sh").config)
    assert (job.model, job.hardware, job.cluster.rollout_tensor_parallel, job.rl.micro_batch_per_device) == (
        "qwen3-8b", "h100", 2, 32)


# --------------------------------------------------------------------------------------------------
# Hydra's override rules and named errors
# --------------------------------------------------------------------------------------------------

def error(*items, **kw) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        conv(*items, **kw)
    return info.value


def test_an_unknown_key_is_refused_with_a_suggestion():
    e = error("grpo_qwen3-8b_gsm8k.sh", f"{R}.tensor_model_paralel_size=4")
    assert e.field == f"{R}.tensor_model_paralel_size" and "tensor_model_parallel_size" in e.fix
    assert "+" in e.fix                                     # Hydra's hint: add new keys with +


def test_plus_adds_only_new_keys_and_double_plus_sets_either_way():
    e = error("grpo_qwen3-8b_gsm8k.sh", f"+{R}.n=8")
    assert e.field == f"{R}.n" and "already" in e.problem
    assert conv("grpo_qwen3-8b_gsm8k.sh", f"++{R}.n=8").config["workload"]["group_size"] == 8
    c = conv("grpo_qwen3-8b_gsm8k.sh", "+my_team.note=hello")
    row = next(r for r in c.not_used if r["key"] == "my_team.note")
    assert "added with +" in row["reason"]
    e = error("grpo_qwen3-8b_gsm8k.sh", f"{M}.override_config.rope_theta=1e6")
    assert "+" in e.fix                                     # an empty user section: only + reaches it


def test_tilde_deletes_and_the_mapping_names_a_deleted_key_it_needs():
    c = conv("grpo_qwen3-8b_gsm8k.sh", "~trainer.project_name")
    assert any(r["key"] == "trainer.project_name" and r["origin"].startswith("deleted") for r in c.not_used)
    e = error("grpo_qwen3-8b_gsm8k.sh", "~trainer.nnodes")
    assert e.field == "trainer.nnodes" and "deleted" in e.problem
    e = error("grpo_qwen3-8b_gsm8k.sh", "~trainer.nnodes=2")     # the script sets 1
    assert "holds 1" in e.problem
    e = error("grpo_qwen3-8b_gsm8k.sh", "~trainer.no_such_key")
    assert e.field == "trainer.no_such_key"


@pytest.mark.parametrize("bad, field, words", [
    (f"{R}.n=five", f"{R}.n", "whole number"),
    (f"{R}.n=${{n_resp_per_prompt}}", f"{R}.n", "shell variable"),
    (f"{A}.fsdp_config.param_offload=maybe", f"{A}.fsdp_config.param_offload", "true or false"),
    (f"{A}.optim.lr=fast", f"{A}.optim.lr", "number"),
    (f"{R}.tensor_model_parallel_size=3", f"{R}.tensor_model_parallel_size", "does not divide"),
    (f"{R}.n=0", f"{R}.n", "> 0"),
    (f"{A}.fsdp_config.fsdp_size=0", f"{A}.fsdp_config.fsdp_size", "-1 or a positive"),
    (f"{A}.fsdp_config.fsdp_size=3", f"{A}.fsdp_config.fsdp_size", "does not divide"),
    ("algorithm.adv_estimator=gae", "algorithm.adv_estimator", "critic"),
    ("critic.enable=True", "critic.enable", "critic"),
    ("reward_model.enable=True", "reward_model.enable", "reward model"),
    (f"{A}.ppo_epochs=2", f"{A}.ppo_epochs", "one pass"),
    (f"{M}.lora_rank=16", f"{M}.lora_rank", "LoRA"),
    (f"{A}.strategy=megatron", f"{A}.strategy", "FSDP"),
    (f"{R}.multi_turn.enable=True", f"{R}.multi_turn.enable", "multi-turn"),
    (f"{A}.ppo_mini_batch_size=2048", f"{A}.ppo_mini_batch_size", "exceed"),
    ("actor_rollout_ref.hybrid_engine=False", "actor_rollout_ref.hybrid_engine", "colocated"),
])
def test_bad_values_get_named_errors(bad, field, words):
    e = error("grpo_qwen3-8b_gsm8k.sh", bad)
    assert e.field == field and words in str(e), str(e)


@pytest.mark.parametrize("bad", ["actor..n=1", "=3", "n-resp=3", ".a=1", "a.=1", "+=1"])
def test_a_key_that_does_not_parse_is_named(bad):
    with pytest.raises(ConfigError, match="not a dotted path|not an override"):
        parse_override(bad)


def test_other_malformed_inputs(tmp_path):
    assert "neither a file nor" in str(error("no_such_file.sh"))
    assert "list or dict" in str(error("grpo_qwen3-8b_gsm8k.sh", "trainer.logger=[console,"))
    assert error("grpo_qwen3-8b_gsm8k.sh", hardware="tpu-v9").field == "--hardware"
    assert error("grpo_qwen3-8b_gsm8k.sh", model="no-such-model").field == "--model"
    e = error(f"{M}.path=Qwen/Qwen3-8B", "algorithm.adv_estimator=grpo", f"{A}.use_dynamic_bsz=true")
    assert e.field == f"{R}.name" and "???" in e.problem        # veRL's mandatory value
    e = error(f"{M}.path=Qwen/Qwen3-8B", f"{R}.name=vllm")
    assert e.field == "algorithm.adv_estimator"                 # veRL's default is gae, with a critic
    e = error("fully_async_dapo_7b_math_16_16.sh", "rollout.n_gpus_per_node=4")
    assert e.field == "rollout.n_gpus_per_node"
    e = error("fully_async_dapo_7b_math_16_16.sh", "rollout.total_rollout_steps=100")
    assert e.field == "rollout.total_rollout_steps"
    e = error("grpo_qwen3-8b_gsm8k.sh", "rollout.nnodes=2")        # a fully-async key in a colocated command
    assert e.field == "rollout.nnodes"
    script = tmp_path / "one_step_off.sh"
    script.write_text("python3 -m verl.experimental.one_step_off_policy.main_ppo data.train_batch_size=8\n")
    assert "does not convert" in str(error(str(script)))
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    assert "mapping" in str(error(str(listing)))
    typo = tmp_path / "typo.yaml"
    typo.write_text("actor_rollout_ref:\n  rollout:\n    tensor_model_paralel_size: 2\n")
    assert error(str(typo)).field == f"{R}.tensor_model_paralel_size"
    quote = tmp_path / "quote.sh"
    quote.write_text("python3 -m verl.trainer.main_ppo trainer.project_name='open\n")
    assert "quote" in str(error(str(quote)))


def test_shell_words_and_values_parse_as_hydra_reads_them():
    assert parse_override("a.b=1e-6").value == 1e-6
    assert parse_override("a.b=True").value is True and parse_override("a.b=FALSE").value is False
    assert parse_override("a.b=null").value is None and parse_override("a.b='12'").value == "12"
    assert parse_override("a.b=['console','wandb']").value == ["console", "wandb"]
    assert parse_override("~a.b").op == "delete" and parse_override("++a.b=1").op == "force"


# --------------------------------------------------------------------------------------------------
# properties: the order of distinct overrides does not matter; of one key, the last wins
# --------------------------------------------------------------------------------------------------

_BASE = read_inputs([str(DATA / "fully_async_dapo_7b_math_16_16.sh")])


@settings(max_examples=25, deadline=None)
@given(st.permutations(range(len(_BASE.overrides))))
def test_the_order_of_distinct_overrides_does_not_change_the_result(order):
    shuffled = VerlInput(tuple(_BASE.overrides[i] for i in order), _BASE.entry, _BASE.sources)
    a, b = convert(_BASE, hardware="h100"), convert(shuffled, hardware="h100")
    assert a.config == b.config
    assert {r["key"]: r["value"] for r in a.mapped} == {r["key"]: r["value"] for r in b.mapped}
    assert {r["key"] for r in a.not_used} == {r["key"] for r in b.not_used}


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 64), min_size=1, max_size=5))
def test_of_several_overrides_of_one_key_the_last_wins(values):
    extra = tuple(parse_override(f"{R}.n={v}") for v in values)
    c = convert(VerlInput(_BASE.overrides + extra, _BASE.entry, _BASE.sources), hardware="h100")
    assert c.config["workload"]["group_size"] == values[-1]


def test_rules_are_found_for_every_kind_they_name():
    assert rule_for("async_training.require_batches", "colocated") is None
    assert rule_for("async_training.require_batches", "fully-async").mapped
    assert rule_for(f"{R}.val_kwargs.top_p", "colocated").targets == ()


# --------------------------------------------------------------------------------------------------
# the command line
# --------------------------------------------------------------------------------------------------

def test_cli_json_and_out(capsys, tmp_path):
    out = tmp_path / "job.yaml"
    code = cli.main(["config", "from-verl", str(DATA / "grpo_qwen3-8b_gsm8k.sh"), "--hardware", "h100", "--json",
                     "--out", str(out)])
    stdout, _ = capsys.readouterr()
    assert code == 0
    data = json.loads(stdout)
    assert {"config", "trainer", "mapped", "not_used", "derived", "missing", "warnings", "loads",
            "load_error", "counts", "out"} <= set(data)
    assert data["loads"] and data["out"] == str(out)
    assert yaml.safe_load(out.read_text()) == data["config"]
    assert load(str(out)).cluster.rollout_tensor_parallel == 2


def test_cli_table_names_what_is_missing(capsys):
    code = cli.main(["config", "from-verl", str(DATA / "dapo_qwen2.5-7b-math.sh")])
    stdout, _ = capsys.readouterr()
    assert code == 0
    assert "missing: hardware" in stdout and "not used (" in stdout and "does not load yet" in stdout


def test_cli_errors_exit_2(capsys):
    code = cli.main(["config", "from-verl", str(DATA / "grpo_qwen3-8b_gsm8k.sh"), "algorithm.adv_estimator=gae"])
    _, stderr = capsys.readouterr()
    assert code == 2 and stderr.startswith("error: algorithm.adv_estimator")


def test_lenient_names_keys_of_other_verl_releases_instead_of_refusing_them():
    """Scripts written for older veRL releases set keys this release lacks (``actor.use_gpg_loss``) or add with ``+``
    keys it now declares (``+trainer.val_before_train``): refused as Hydra would, named with --lenient."""
    items = ("grpo_qwen3-8b_gsm8k.sh", f"{A}.use_gpg_loss=True", "+trainer.val_before_train=False")
    assert "--lenient" in error(*items[:2]).fix
    assert "--lenient" in error(items[0], items[2]).fix
    c = conv(*items, lenient=True)
    row = next(r for r in c.not_used if r["key"] == f"{A}.use_gpg_loss")
    assert "does not declare" in row["reason"]
    assert any("use_gpg_loss" in w for w in c.warnings) and any("val_before_train" in w for w in c.warnings)
    assert c.config == conv(items[0]).config


def test_a_hugging_face_cache_path_names_its_model():
    c = conv("grpo_qwen3-8b_gsm8k.sh",
             f"{M}.path=/cache/huggingface/hub/models--Qwen--Qwen3-8B/snapshots/0123456789abcdef0123456789abcdef01234567")
    assert c.config["model"] == "qwen3-8b" and not c.missing
