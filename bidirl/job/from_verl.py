"""``bidirl config from-verl``: a veRL job's configuration in, a bidirl job config out, every key accounted for.

A veRL user describes the job they run (its trainer YAML or the ``python3 -m verl.trainer.main_ppo key=value ...``
line of their script); this module maps it onto bidirl's job settings (paper §4's planning input: budget G,
split, workload W, model P, and the RL settings of §2.2) so the planner and the simulator model that job rather
than a guess. Every key the input gives is either **mapped** (to which bidirl key, and how) or **named as not
used** (with the reason, and whether veRL's step time depends on it — then bidirl's prediction does not see it).
Keys the mapping needs and the input leaves out take veRL's defaults (``verl/trainer/config/ppo_trainer.yaml``
and, for the fully-async trainer, ``verl/experimental/fully_async_policy/config/fully_async_ppo_trainer.yaml``
of volcengine/verl @ b178a3cd), and the report says which values came from there.

Two trainers are understood: veRL's colocated (hybrid-engine) trainer ``verl.trainer.main_ppo`` (also the DAPO
recipe's ``recipe.dapo.main_dapo``), modelled by bidirl's ``verl-colocated`` baseline, and the fully-async
trainer (``verl/experimental/fully_async_policy``, docs/advance/fully_async.md), modelled by ``verl-async``: a
rollout pool of ``rollout.nnodes × rollout.n_gpus_per_node`` GPUs beside a trainer pool of ``trainer.*``'s, one
weight sync per ``trigger_parameter_sync_step`` local updates of ``require_batches × ppo_mini_batch_size``
prompts each.

A veRL config does not say which accelerator it runs on, and it names a model by its path: the hardware preset
is an argument, a model path is matched to a model preset by name (``Qwen/Qwen3-8B`` → ``qwen3-8b``), and the
training data's path to a workload preset (``…/gsm8k/train.parquet`` → ``gsm8k``). What cannot be matched is
listed as missing, with how to add it, and the written config names it so that loading it fails by name.
"""

from __future__ import annotations

import fnmatch
import difflib
import math
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any, Optional, Sequence

import yaml

from bidirl.errors import ConfigError
from bidirl.job import presets
from bidirl.job.verl_input import ENTRY_POINTS, Composed, VerlInput, compose, read_inputs

VERL_COMMIT = "volcengine/verl@b178a3cd56f58b2d502255daba591e92833930a7"

A = "actor_rollout_ref.actor"
R = "actor_rollout_ref.rollout"
F = "actor_rollout_ref.ref"
M = "actor_rollout_ref.model"
FULLY_ASYNC, COLOCATED = "fully-async", "colocated"


@dataclass(frozen=True)
class Interp:
    """A veRL default that is an interpolation of another key (``${oc.select:KEY,...}``)."""
    key: str


MISSING = object()   # veRL's ``???``: a value the user must give

#: veRL's defaults of the keys the mapping reads (ppo_trainer.yaml and, for the fully-async trainer,
#: fully_async_ppo_trainer.yaml, at VERL_COMMIT)
VERL_DEFAULTS: dict = {
    "trainer.nnodes": 1, "trainer.n_gpus_per_node": 8, "trainer.total_training_steps": None,
    "trainer.total_epochs": 30,
    "data.train_batch_size": 1024, "data.max_prompt_length": 512, "data.max_response_length": 512,
    "data.train_files": "~/data/rlhf/gsm8k/train.parquet",
    f"{M}.path": "~/models/deepseek-llm-7b-chat", f"{M}.enable_gradient_checkpointing": True,
    f"{M}.lora_rank": 0,
    f"{A}.strategy": "fsdp", f"{A}.ppo_mini_batch_size": 256, f"{A}.ppo_micro_batch_size": None,
    f"{A}.ppo_micro_batch_size_per_gpu": None, f"{A}.use_dynamic_bsz": False,
    f"{A}.ppo_max_token_len_per_gpu": 16384, f"{A}.ppo_epochs": 1, f"{A}.clip_ratio": 0.2,
    f"{A}.clip_ratio_low": 0.2, f"{A}.use_kl_loss": False, f"{A}.kl_loss_coef": 0.001, f"{A}.optim.lr": 1e-6,
    f"{A}.fsdp_config.param_offload": False, f"{A}.fsdp_config.optimizer_offload": False,
    f"{A}.ulysses_sequence_parallel_size": 1, f"{A}.fsdp_config.fsdp_size": -1,
    f"{R}.name": MISSING, f"{R}.n": 1, f"{R}.tensor_model_parallel_size": 2, f"{R}.expert_parallel_size": 1,
    f"{R}.gpu_memory_utilization": 0.5,
    f"{R}.multi_turn.enable": False,
    f"{R}.log_prob_use_dynamic_bsz": Interp(f"{A}.use_dynamic_bsz"),
    f"{R}.log_prob_max_token_len_per_gpu": Interp(f"{A}.ppo_max_token_len_per_gpu"),
    f"{R}.log_prob_micro_batch_size_per_gpu": None,
    f"{F}.log_prob_use_dynamic_bsz": Interp(f"{A}.use_dynamic_bsz"),
    f"{F}.log_prob_max_token_len_per_gpu": Interp(f"{A}.ppo_max_token_len_per_gpu"),
    f"{F}.log_prob_micro_batch_size_per_gpu": None,
    f"{F}.ulysses_sequence_parallel_size": Interp(f"{A}.ulysses_sequence_parallel_size"),
    "actor_rollout_ref.hybrid_engine": True,
    "algorithm.adv_estimator": "gae", "algorithm.use_kl_in_reward": False, "algorithm.kl_ctrl.kl_coef": 0.001,
    "algorithm.rollout_correction.bypass_mode": False, "algorithm.filter_groups.enable": False,
    "critic.enable": None, "reward_model.enable": False,
    "custom_reward_function.path": None, "custom_reward_function.name": "compute_score",
}
FULLY_ASYNC_DEFAULTS: dict = {
    "async_training.staleness_threshold": 0.1, "async_training.trigger_parameter_sync_step": 4,
    "async_training.require_batches": 1, "async_training.partial_rollout": True,
    "async_training.use_rollout_log_probs": True, "async_training.compute_prox_log_prob": False,
    f"{A}.use_rollout_log_probs": Interp("async_training.use_rollout_log_probs"),
    "rollout.nnodes": 1, "rollout.n_gpus_per_node": 8, "rollout.total_rollout_steps": 100,
    "rollout.total_epochs": 10, "rollout.n": 4, "rollout.test_freq": 1, "data.gen_batch_size": 1,
    "actor_rollout_ref.hybrid_engine": False,
}

# --------------------------------------------------------------------------------------------------
# The key table: every veRL key bidirl knows, mapped or not used (reasons shared by groups of keys)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """How a veRL key (``pattern``; ``*`` matches any run of characters, dots included) is treated.

    ``targets``: the bidirl keys it maps to (empty: not used, ``text`` says why); ``timing``: veRL's step time
    depends on it but bidirl does not model it; ``open``: a section whose children the user invents (added with
    ``+``); ``only``: the trainer whose config has the key (``None``: both)."""
    pattern: str
    targets: tuple = ()
    text: str = ""
    timing: bool = False
    open: bool = False
    only: Optional[str] = None
    check: bool = False

    @property
    def mapped(self) -> bool:
        """Used by the conversion: mapped to bidirl keys, or checked (a value bidirl cannot model is refused)."""
        return bool(self.targets) or self.check


def _unused(keys, reason, timing=False, open=False, only=None) -> list:
    return [Rule(k, (), reason, timing, open, only) for k in keys]


def _mapped(key, targets, how, only=None) -> Rule:
    return Rule(key, tuple(targets), how, False, False, only)


def _checked(key, how) -> Rule:
    """A key the conversion reads to check that the job is one bidirl models (maps to no bidirl key)."""
    return Rule(key, (), how, check=True)


BOOK = "run bookkeeping (names, logging, checkpoints, resumption, timeouts): no part of a training step's work"
VAL = "validation runs between training steps; bidirl models the training steps only"
DATA = ("how prompts are read, filtered, tokenised and shuffled: bidirl takes prompt lengths from the workload "
        "preset (workload.dataset)")
SAMPLING = ("sampling settings choose which tokens are drawn, not the work per token; bidirl draws response "
            "lengths from the workload preset")
LOSS = ("a term or form of the policy loss: the same forward and backward work, so the same step time (engine "
        "runs use bidirl's GRPO loss with rl.clip_eps and rl.kl_coef)")
OPTIM = "optimizer schedule: the same optimizer-step work; engine runs use AdamW at rl.lr"
FSDP = ("FSDP sharding and precision detail of veRL's workers; bidirl's trainer model shards over its own layout "
        "(ZeRO-3 over the trainer gang)")
KERNEL = ("kernel and compilation choice: bidirl's stage models are calibrated per hardware preset, not per kernel "
          "(the models count unpadded tokens, as veRL's use_remove_padding does)")
PROFILE = "profiling and tracing switches"
CRITIC = ("critic settings: GRPO-family estimators (algorithm.adv_estimator other than gae) need no critic, and "
          "veRL builds none (verl/trainer/ppo/utils.py need_critic)")
REWARD = "reward-function plumbing: rule-based rewards score on CPU, no GPU stage in veRL or in bidirl's models"
INTERP = "veRL fills it from another key by interpolation; the key it copies is what counts"
ENGINE = "a vLLM engine detail that bidirl's decode model does not represent"
HYDRA = "Hydra's own composition settings"

RULES: list = [
    # --- GPUs, steps ---------------------------------------------------------------------------------------
    _mapped("trainer.n_gpus_per_node", ["cluster.gpus", "cluster.gpus_per_node"],
            "GPUs per node; colocated: cluster.gpus = trainer.nnodes × this; fully-async: the trainer pool's "
            "GPUs (cluster.partition.trainer) = trainer.nnodes × this"),
    _mapped("trainer.nnodes", ["cluster.gpus"], "nodes of the (colocated) job or of the fully-async trainer pool"),
    _mapped("rollout.nnodes", ["cluster.gpus", "cluster.partition"], "rollout pool nodes (fully-async)",
            only=FULLY_ASYNC),
    _mapped("rollout.n_gpus_per_node", ["cluster.gpus", "cluster.partition"],
            "rollout pool GPUs per node (fully-async): cluster.partition.rollout = rollout.nnodes × this",
            only=FULLY_ASYNC),
    _mapped("trainer.total_training_steps", ["workload.steps"], "colocated: the run's training steps"),
    _mapped("rollout.total_rollout_steps", ["workload.steps"],
            "fully-async: prompts the rollouter generates in the run (docs/advance/fully_async.md); "
            "workload.steps = this ÷ prompts per weight sync (at most: veRL also stops after trainer.total_epochs "
            "passes over the data)", only=FULLY_ASYNC),
    *_unused(["trainer.total_epochs"], "the run's length in passes over the data: steps = epochs × rows of "
             "data.train_files ÷ batch, and bidirl does not read the data file (trainer.total_training_steps, "
             "when given, decides it)"),
    *_unused(["rollout.total_epochs"], "declared by fully_async_ppo_trainer.yaml but the rollouter counts "
             "trainer.total_epochs (fully_async_rollouter.py); the run's length is rollout.total_rollout_steps",
             only=FULLY_ASYNC),
    *_unused(["rollout.n"], "declared by fully_async_ppo_trainer.yaml, but the rollouter repeats each prompt "
             "actor_rollout_ref.rollout.n times (fully_async_rollouter.py, detach_utils.py)", only=FULLY_ASYNC),
    *_unused(["rollout.test_freq"], VAL, only=FULLY_ASYNC),
    # --- batch, lengths --------------------------------------------------------------------------------------
    _mapped("data.train_batch_size", ["workload.prompts_per_step"],
            "colocated: prompts per step (one weight version); the fully-async trainer ignores it"),
    _mapped(f"{R}.n", ["workload.group_size"], "responses per prompt (the GRPO group)"),
    _mapped("data.max_response_length", ["workload.max_response_len"], "longest response, tokens"),
    _mapped("data.max_prompt_length", ["workload.max_prompt_len"], "longest prompt, tokens"),
    _mapped("data.train_files", ["workload.dataset", "workload.data_file"],
            "its path names the workload preset (…/gsm8k/… → gsm8k) and, a single .parquet/.jsonl path without "
            "shell variables, becomes workload.data_file (engine runs read veRL's parquet layout)"),
    _mapped(f"{A}.ppo_mini_batch_size", ["rl.mini_batch_prompts", "workload.prompts_per_step"],
            "prompts per optimizer update (veRL multiplies it by rollout.n internally); fully-async: also a "
            "factor of the prompts per weight sync"),
    _mapped(f"{A}.ppo_micro_batch_size_per_gpu", ["rl.micro_batch_per_device"],
            "samples per trainer micro-batch per GPU (when use_dynamic_bsz is off)"),
    _mapped(f"{A}.ppo_micro_batch_size", ["rl.micro_batch_per_device"],
            "veRL's deprecated global micro-batch: ÷ the trainer's GPUs gives samples per GPU"),
    _mapped(f"{A}.use_dynamic_bsz", ["rl.max_tokens_per_micro_batch"],
            "true: micro-batches are packed to a token budget (ppo_max_token_len_per_gpu) instead of counted in "
            "samples"),
    _mapped(f"{A}.ppo_max_token_len_per_gpu", ["rl.max_tokens_per_micro_batch"],
            "the token budget of a micro-batch per GPU with use_dynamic_bsz (veRL packs this × "
            "ulysses_sequence_parallel_size tokens per sequence-parallel group, dp_actor.py: this many per GPU)"),
    *[_mapped(f"{s}.log_prob_use_dynamic_bsz", ["rl.max_tokens_per_micro_batch"],
              "token budgets in the forward-only log-prob stage; bidirl's stages share the update's setting")
      for s in (R, F)],
    *[_mapped(f"{s}.log_prob_max_token_len_per_gpu", ["rl.max_tokens_per_micro_batch"],
              "the forward-only log-prob stage's token budget; bidirl's stages share one budget, the update's")
      for s in (R, F)],
    *[_mapped(f"{s}.log_prob_micro_batch_size_per_gpu", ["rl.micro_batch_per_device"],
              "the forward-only log-prob stage's micro-batch; bidirl's stages share one size, the update's")
      for s in (R, F)],
    *_unused([f"{s}.log_prob_micro_batch_size" for s in (R, F)],
             "veRL's deprecated global log-prob micro-batch; bidirl's stages share the update's micro-batch"),
    # --- fully-async streaming ------------------------------------------------------------------------------
    _mapped("async_training.trigger_parameter_sync_step", ["rl.updates_per_sync", "workload.prompts_per_step"],
            "local updates per weight sync (one bidirl step = one weight version)", only=FULLY_ASYNC),
    _mapped("async_training.require_batches", ["workload.prompts_per_step"],
            "mini-batches per local update: prompts per step = require_batches × ppo_mini_batch_size × "
            "trigger_parameter_sync_step", only=FULLY_ASYNC),
    _mapped("async_training.staleness_threshold", ["rl.staleness"],
            "veRL's bound: at most (1 + s)·B − n_stale samples generated between two syncs, as bidirl's s",
            only=FULLY_ASYNC),
    _mapped("async_training.partial_rollout", ["rl.partial_rollout"],
            "interrupt and resume generations at a sync; veRL applies it only when staleness_threshold > 0",
            only=FULLY_ASYNC),
    _mapped("async_training.use_rollout_log_probs", ["rl.recompute_old_logprob"],
            "true: the rollout's log-probs stand in for old log-probs (no old_logprob stage)", only=FULLY_ASYNC),
    _mapped(f"{A}.use_rollout_log_probs", ["rl.recompute_old_logprob"],
            "the actor's copy of async_training.use_rollout_log_probs (set here, it wins)", only=FULLY_ASYNC),
    _mapped("async_training.compute_prox_log_prob", ["rl.recompute_old_logprob"],
            "true: the trainer recomputes log-probs after all (an old_logprob stage)", only=FULLY_ASYNC),
    *_unused(["async_training.checkpoint_engine.*"], "how weights are broadcast (bucket size, overlap): bidirl "
             "takes the weight-sync time from the hardware preset (or scheduler.weight_sync)", only=FULLY_ASYNC),
    *_unused(["async_training.use_trainer_do_validate"], VAL, only=FULLY_ASYNC),
    *_unused(["data.gen_batch_size"], "prompts per generation batch: the fully-async rollouter streams single "
             "prompts (it must be 1 there); DAPO's dynamic sampling generates this many per round until "
             "data.train_batch_size groups pass its filter (algorithm.filter_groups)", timing=True),
    _mapped("algorithm.rollout_correction.bypass_mode", ["rl.recompute_old_logprob"],
            "true: veRL's bypass mode, the rollout's log-probs stand in for old log-probs"),
    # --- parallelism, memory ----------------------------------------------------------------------------------
    _mapped(f"{R}.tensor_model_parallel_size", ["cluster.rollout_tensor_parallel"],
            "GPUs per vLLM replica (ρ_r)"),
    _mapped(f"{R}.expert_parallel_size", ["cluster.rollout_expert_parallel"],
            "GPUs of a vLLM replica over which an MoE model's experts are sharded (enable_expert_parallel): 1 or "
            "tensor_model_parallel_size × data_parallel_size, data parallel 1 in bidirl"),
    _mapped(f"{A}.ulysses_sequence_parallel_size", ["rl.sequence_parallel"], "Ulysses sequence parallel degree"),
    _mapped(f"{F}.ulysses_sequence_parallel_size", ["rl.sequence_parallel"],
            "the reference's degree; bidirl's trainer stages share one degree, the actor's"),
    _mapped(f"{A}.fsdp_config.param_offload", ["rl.param_offload"], "trainer parameters in host memory"),
    _mapped(f"{A}.fsdp_config.optimizer_offload", ["rl.optimizer_offload"], "optimizer state in host memory"),
    _mapped(f"{A}.fsdp_config.fsdp_size", ["rl.fsdp_size"],
            "GPUs of one FSDP shard group (ρ_t); -1 or the trainer's GPU count: veRL shards over every trainer GPU"),
    _mapped(f"{M}.enable_gradient_checkpointing", ["rl.activation_checkpointing"],
            "recompute blocks in the backward pass"),
    _checked(f"{R}.name", "the rollout engine: bidirl's decode model and engine runs are vLLM's, and "
             "another engine is modelled as vLLM (a warning says so)"),
    _mapped("actor_rollout_ref.hybrid_engine", ["scheduler.policy"],
            "true: rollout and training share the GPUs (colocated); false: the fully-async trainer's split"),
    *_unused([f"{R}.gpu_memory_utilization"],
             "vLLM's share of GPU memory for weights, activations and KV: the KV cache it leaves is measured at "
             "start-up (after a profiling forward pass of max_num_batched_tokens), so it is not derivable from "
             "the config; bidirl's planner sizes cluster.rollout_kv_cache_gib itself (set it to pin one)",
             timing=True),
    *_unused([f"{F}.fsdp_config.param_offload"], "the reference model's weights in host memory between uses: "
             "bidirl has no key for it, and the host→device copy it adds to each ref_logprob stage is not "
             "modelled", timing=True),
    *_unused([f"{A}.fsdp_config.ulysses_sequence_parallel_size", f"{F}.fsdp_config.ulysses_sequence_parallel_size"],
             "the engine config's copy; veRL's FSDP workers read actor.ulysses_sequence_parallel_size"),
    *_unused([f"{A}.fsdp_config.*", f"{F}.fsdp_config.*"], FSDP),
    *_unused([f"{M}.enable_activation_offload"], "activations in host memory during the backward pass: not "
             "modelled (bidirl's memory model keeps them on the GPU)", timing=True),
    # --- model ------------------------------------------------------------------------------------------------
    _mapped(f"{M}.path", ["model"], "matched by its last path part to a model preset (Qwen/Qwen3-8B → qwen3-8b)"),
    _checked(f"{M}.lora_rank", "0 (full fine-tuning) is what bidirl models; LoRA is refused"),
    *_unused([f"{M}.use_remove_padding", f"{M}.use_fused_kernels", f"{M}.use_liger", f"{M}.fused_kernel_options.*",
              f"{A}.use_torch_compile", f"{F}.use_torch_compile", f"{A}.entropy_from_logits_with_chunking",
              f"{A}.entropy_checkpointing", f"{F}.entropy_from_logits_with_chunking", f"{F}.entropy_checkpointing",
              f"{M}.tiled_mlp.*", f"{A}.use_fused_kernels", f"{A}.use_remove_padding"], KERNEL),
    *_unused([f"{M}.override_config.*"], "Hugging Face config overrides (e.g. max_position_embeddings for long "
             "responses); the model preset holds the architecture", open=True),
    *_unused([f"{M}.{k}" for k in ("hf_config_path", "tokenizer_path", "use_shm", "trust_remote_code",
                                    "custom_chat_template", "external_lib", "lora_alpha", "target_modules",
                                    "exclude_modules", "lora_adapter_path")],
             "where and how the model and tokenizer are loaded (LoRA details apply only with lora_rank > 0)"),
    *_unused([f"{M}.mtp.*"], "multi-token prediction (off by default): not modelled", timing=True),
    # --- algorithm, loss, optimizer -------------------------------------------------------------------------
    _mapped(f"{A}.optim.lr", ["rl.lr"], "learning rate"),
    _mapped(f"{A}.clip_ratio_low", ["rl.clip_eps"], "the PPO clip range below 1 (veRL's loss uses it when set, "
            "core_algos.py)"),
    _mapped(f"{A}.clip_ratio", ["rl.clip_eps"], "the PPO clip range, used by veRL only when clip_ratio_low is "
            "null"),
    *_unused([f"{A}.clip_ratio_high"], "the clip range above 1 (DAPO's clip-higher); bidirl's loss clips "
             "symmetrically at rl.clip_eps — the same step time"),
    _mapped(f"{A}.use_kl_loss", ["rl.reference_model", "rl.kl_coef"],
            "a KL-to-reference loss term: needs the reference model (a ref_logprob stage)"),
    _mapped(f"{A}.kl_loss_coef", ["rl.kl_coef"], "β of the KL loss (with use_kl_loss)"),
    _mapped("algorithm.use_kl_in_reward", ["rl.reference_model", "rl.kl_coef"],
            "a KL penalty in the reward: needs the reference model"),
    _mapped("algorithm.kl_ctrl.kl_coef", ["rl.kl_coef"], "β of the in-reward KL (with use_kl_in_reward)"),
    _checked("algorithm.adv_estimator", "critic-free estimators (grpo, rloo, …) are what bidirl models; "
             "gae (a critic) is refused"),
    _checked(f"{A}.ppo_epochs", "passes over each batch; 1 is what bidirl models, more are refused"),
    _checked(f"{A}.strategy", "fsdp or fsdp2, as bidirl's trainer model; megatron is refused"),
    _mapped("custom_reward_function.path", ["rl.reward"], "a veRL compute_score file: engine runs call it "
            "(rl.reward = path:name)"),
    _mapped("custom_reward_function.name", ["rl.reward"], "the function in custom_reward_function.path"),
    *_unused([f"{A}.{k}" for k in ("entropy_coeff", "loss_agg_mode", "clip_ratio_c", "kl_loss_type", "tau_pos",
                                   "tau_neg", "loss_scale_factor", "calculate_entropy", "use_prefix_grouper",
                                   "grad_clip", "calculate_sum_pi_squared", "sum_pi_squared_checkpointing",
                                   "freeze_vision_tower")] + [f"{A}.policy_loss.*"], LOSS),
    *_unused([f"{A}.optim.*"], OPTIM),
    *_unused([f"{A}.{k}" for k in ("shuffle", "data_loader_seed")] + [f"{A}.checkpoint.*", f"{A}.router_replay.*",
                                                                    f"{F}.router_replay.*"],
             "data order within a step and checkpoint contents: no change to the step's work"),
    *_unused([f"{A}.rollout_n", f"{F}.rollout_n", f"{F}.strategy", f"{R}.prompt_length", f"{R}.response_length"],
             INTERP),
    *_unused(["algorithm.kl_ctrl.*", "algorithm.kl_penalty", "algorithm.gamma", "algorithm.lam",
              "algorithm.norm_adv_by_std_in_grpo", "algorithm.use_pf_ppo", "algorithm.pf_ppo.*",
              "algorithm.rollout_correction.*", "algorithm._target_"], LOSS),
    *_unused(["algorithm.filter_groups.*"], "DAPO's dynamic sampling: groups whose rewards all agree are dropped "
             "and more prompts generated until data.train_batch_size groups remain — bidirl generates exactly "
             "workload.prompts_per_step groups per step, so with it enabled veRL generates more per step than "
             "modelled", timing=True),
    # --- rollout engine ---------------------------------------------------------------------------------------
    *_unused([f"{R}.{k}" for k in ("temperature", "top_k", "top_p", "do_sample", "logprobs_mode", "ignore_eos",
                                   "calculate_log_probs", "over_sample_rate")], SAMPLING),
    *_unused([f"{R}.val_kwargs.*"], VAL),
    *_unused([f"{R}.{k}" for k in ("mode", "dtype", "enforce_eager", "cudagraph_capture_sizes",
                                   "free_cache_engine", "data_parallel_size",
                                   "pipeline_model_parallel_size", "max_num_batched_tokens", "max_model_len",
                                   "max_num_seqs", "enable_chunked_prefill", "enable_prefix_caching",
                                   "scheduling_policy", "load_format", "disable_log_stats",
                                   "multi_stage_wake_up", "layered_summon", "quantization",
                                   "quantization_config_file", "skip_tokenizer_init", "enable_rollout_routing_replay",
                                   "skip_rollout", "skip_dump_dir", "mtp")] + [f"{R}.agent.*", f"{R}.trace.*",
                                                                              f"{R}.checkpoint_engine.*",
                                                                              f"{R}.prometheus.*"],
             ENGINE, timing=True),
    *_unused([f"{R}.engine_kwargs.*"], ENGINE, timing=True, open=True),
    _checked(f"{R}.multi_turn.enable", "false (single-turn generation) is what bidirl models; "
             "multi-turn tool use is refused"),
    *_unused([f"{R}.multi_turn.*"], "multi-turn settings, which apply only with multi_turn.enable"),
    # --- data --------------------------------------------------------------------------------------------------
    *_unused(["data.val_files", "data.val_batch_size", "data.val_max_samples", "data.validation_shuffle"], VAL),
    *_unused([f"data.{k}" for k in ("tokenizer", "use_shm", "train_max_samples", "prompt_key", "reward_fn_key",
                                    "tool_config_path", "return_raw_input_ids", "return_raw_chat",
                                    "return_full_prompt", "shuffle", "seed", "dataloader_num_workers",
                                    "image_patch_size", "filter_overlong_prompts", "filter_overlong_prompts_workers",
                                    "truncation", "image_key", "video_key", "trust_remote_code",
                                    "return_multi_modal_inputs")]
             + ["data.custom_cls.*", "data.sampler.*", "data.datagen.*"], DATA),
    *_unused(["data.apply_chat_template_kwargs.*"], DATA, open=True),
    # --- critic, reward ---------------------------------------------------------------------------------------
    _checked("critic.enable", "null or false (no critic) is what bidirl models"),
    *_unused(["critic.*"], CRITIC),
    _checked("reward_model.enable", "false (rule-based rewards) is what bidirl models; a reward model "
             "(a GPU stage) is refused"),
    *_unused(["reward_model.reward_kwargs.*", "reward.reward_kwargs.*"], REWARD, open=True),
    *_unused(["reward_model.*", "reward_manager.*", "reward.*"], REWARD),
    # --- bookkeeping ------------------------------------------------------------------------------------------
    *_unused([f"trainer.{k}" for k in ("project_name", "experiment_name", "logger", "log_val_generations",
                                       "rollout_data_dir", "validation_data_dir", "save_freq", "esi_redundant_time",
                                       "resume_mode", "resume_from_path", "default_hdfs_dir",
                                       "del_local_ckpt_after_load", "default_local_dir", "max_actor_ckpt_to_keep",
                                       "max_critic_ckpt_to_keep", "ray_wait_register_center_timeout", "device",
                                       "use_legacy_worker_impl")] + ["actor_rollout_ref.nccl_timeout"], BOOK),
    *_unused(["trainer.val_before_train", "trainer.val_only", "trainer.test_freq"], VAL),
    *_unused(["trainer.critic_warmup"], "steps that train only the critic: GRPO-family jobs have none"),
    *_unused(["trainer.balance_batch"], "balances tokens across data-parallel ranks; bidirl's trainer model "
             "spreads a step's tokens evenly over the trainer's devices already"),
    *_unused(["*.profiler.*", "global_profiler.*"], PROFILE),
    *_unused(["ray_kwargs.*", "transfer_queue.*"], "Ray start-up and data-transfer plumbing"),
    *_unused(["hydra.*", "defaults"], HYDRA),
    *_unused(["*._target_"], "the Python class veRL builds the section into"),
]
_EXACT = {r.pattern: r for r in RULES if "*" not in r.pattern}
_GLOBS = [r for r in RULES if "*" in r.pattern]


def rule_for(key: str, kind: str) -> Optional[Rule]:
    """The rule of a veRL key for a trainer kind (``None``: bidirl does not know the key)."""
    rule = _EXACT.get(key)
    if rule is None:
        rule = next((r for r in _GLOBS if fnmatch.fnmatchcase(key, r.pattern)), None)
    if rule is not None and rule.only not in (None, kind):
        return None
    return rule


def _defaults(kind: str) -> dict:
    return {**VERL_DEFAULTS, **(FULLY_ASYNC_DEFAULTS if kind == FULLY_ASYNC else {})}


def _suggest(key: str, kind: str) -> str:
    known = [k for k, r in _EXACT.items() if r.only in (None, kind)]
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    return f"did you mean '{close[0]}'? " if close else ""


# --------------------------------------------------------------------------------------------------
# The conversion
# --------------------------------------------------------------------------------------------------

@dataclass
class Conversion:
    """The bidirl config (a dict for ``bidirl.job.config.load``) and the account of every key.

    ``mapped``/``not_used``: one row per veRL key the input gave (``origin`` "input") or whose veRL default the
    mapping used (``origin`` "veRL default"); ``derived``: bidirl keys set from the trainer kind or from bidirl's
    defaults rather than from a key; ``missing``: what the config cannot say (hardware, a preset), with the fix;
    ``warnings``: settings whose effect on the step time bidirl does not model."""
    config: dict
    trainer: str
    entry: Optional[str]
    sources: tuple
    mapped: list = field(default_factory=list)
    not_used: list = field(default_factory=list)
    derived: list = field(default_factory=list)
    missing: list = field(default_factory=list)
    warnings: list = field(default_factory=list)

    def load_error(self) -> Optional[str]:
        """``None`` if the config loads and validates (``bidirl.job.config.load``), else the error."""
        from bidirl.job.config import load
        try:
            load(self.config)
        except ConfigError as exc:
            return str(exc)
        return None

    def summary(self) -> dict:
        error = self.load_error()
        return {"config": self.config, "trainer": self.trainer, "entry": self.entry, "sources": list(self.sources),
                "mapped": self.mapped, "not_used": self.not_used, "derived": self.derived, "missing": self.missing,
                "warnings": self.warnings, "loads": error is None, "load_error": error,
                "counts": {"mapped": sum(r["origin"] == "input" for r in self.mapped),
                           "defaults_used": sum(r["origin"] != "input" for r in self.mapped),
                           "not_used": len(self.not_used), "missing": len(self.missing)}}

    def to_yaml(self) -> str:
        head = [f"# bidirl job config converted from veRL ({self.trainer} trainer"
                f"{', ' + self.entry if self.entry else ''}) by `bidirl config from-verl`"]
        head += [f"# source: {s}" for s in self.sources if s != "argument"]
        head += [f"# MISSING {m['key']}: {m['problem']} — {m['fix']}" for m in self.missing]
        return "\n".join(head) + "\n" + yaml.safe_dump(self.config, sort_keys=False)


class _Reader:
    """Reads composed veRL values (or veRL's defaults), type-checked, and records every read as a mapped row."""

    def __init__(self, composed: Composed, kind: str):
        self.c, self.kind, self.defaults = composed, kind, _defaults(kind)
        self.rows: dict = {}

    def has(self, key: str) -> bool:
        return key in self.c.values

    def raw(self, key: str) -> Any:
        if key in self.c.deleted:
            raise ConfigError(key, f"was deleted with ~{key} ({self.c.deleted[key]}), and bidirl's mapping needs it",
                              f"drop the ~{key} override or set {key}=VALUE")
        if key in self.c.values:
            return self.c.values[key]
        value = self.defaults.get(key)
        while isinstance(value, Interp):
            value = self.c.values[value.key] if value.key in self.c.values else self.defaults.get(value.key)
        if value is MISSING:
            raise ConfigError(key, "has no default in veRL's config (???) and the input does not set it",
                              f"add {key}=VALUE (veRL refuses to start without it)")
        return value

    def take(self, key: str, kind: type, *, nullable: bool = False, how: str = "", targets: tuple = ()) -> Any:
        value = self.raw(key)
        value = _typed(key, value, kind, nullable)
        rule = _EXACT[key]
        origin = "input" if key in self.c.values else "veRL default"
        self.rows[key] = {"key": key, "value": value, "origin": origin, "bidirl": list(targets or rule.targets),
                          "how": how or rule.text}
        return value

    def note(self, key: str, how: str, targets: tuple = ()) -> None:
        """Say how a taken key ended up (replaces its how)."""
        if key in self.rows:
            self.rows[key]["how"] = how
            if targets:
                self.rows[key]["bidirl"] = list(targets)


def _typed(key: str, value: Any, kind: type, nullable: bool) -> Any:
    shell = isinstance(value, str) and "$" in value
    hint = (" — a shell variable was left unsubstituted: run the script's assignments first, or write the value"
            if shell else "")
    if value is None:
        if nullable:
            return None
        raise ConfigError(key, "is null, and the mapping needs a value", f"set {key}=VALUE")
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"expected true or false, got {value!r}", "write true or false" + hint)
        return value
    if kind is int:
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
            raise ConfigError(key, f"expected a whole number, got {value!r}", "write an integer such as 8" + hint)
        return int(value)
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(key, f"expected a number, got {value!r}", "write a number such as 1e-6" + hint)
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"expected text, got {value!r}", "write it as text")
        return value
    if kind is object:
        return value
    raise TypeError(kind)  # a bug in this module


def _positive(key: str, value: int, allow_zero: bool = False) -> int:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(key, f"must be {'≥ 0' if allow_zero else '> 0'}, got {value}", "give a positive value")
    return value


def trainer_kind(source: VerlInput) -> str:
    """colocated or fully-async: from the script's entry module, else from the keys (``async_training.*`` or a
    separate rollout pool mean fully-async)."""
    if source.entry is not None:
        if source.entry in ENTRY_POINTS:
            return ENTRY_POINTS[source.entry]
        raise ConfigError("", f"the command runs {source.entry}, a veRL trainer bidirl does not convert",
                          f"convert a command of {', '.join(ENTRY_POINTS)} (one-step-off and other recipes: "
                          "not yet)")
    keys = [o.key for o in source.overrides]
    if any(k.startswith(("async_training.", "rollout.")) for k in keys):
        return FULLY_ASYNC
    return COLOCATED


def _match_preset(kind: str, candidates: Sequence[str]) -> Optional[str]:
    """The preset named by a candidate (a path part or file stem): equal to the preset's name, or starting with it
    followed by ``-``/``_``/``.`` (``dapo-math-17k`` → ``dapo-math``); the longest name wins."""
    best = None
    for name in presets.names(kind):
        for c in candidates:
            if c == name or (c.startswith(name) and c[len(name)] in "-_."):
                if best is None or len(name) > len(best):
                    best = name
    return best


def convert(source: "VerlInput | Sequence[str]", *, hardware: Optional[str] = None, model: Optional[str] = None,
            dataset: Optional[str] = None, lenient: bool = False) -> Conversion:
    """Map a veRL configuration (read with :func:`bidirl.job.verl_input.read_inputs`, or the items to read) onto a
    bidirl job config. ``hardware``: the hardware preset (a veRL config does not name its accelerator);
    ``model``/``dataset``: presets to use in place of the ones matched from the model and data paths;
    ``lenient``: keys unknown to veRL at :data:`VERL_COMMIT` (and ``+`` on keys it declares), as scripts of other
    veRL releases have, are named not used with a warning instead of refused."""
    if not isinstance(source, VerlInput):
        source = read_inputs(list(source))
    kind = trainer_kind(source)
    defaults = _defaults(kind)

    def open_child(key):
        rule = rule_for(key, kind)
        return rule is not None and rule.open

    composed = compose(source.overrides, exists=lambda k: rule_for(k, kind) is not None,
                       declared=lambda k: k in defaults or (k in _EXACT and rule_for(k, kind) is not None),
                       open_child=open_child, default=lambda k: defaults.get(k), suggest=lambda k: _suggest(k, kind),
                       lenient=lenient, version=VERL_COMMIT[:len("volcengine/verl@") + 8])
    r = _Reader(composed, kind)
    out = Conversion(config={}, trainer=kind, entry=source.entry, sources=source.sources,
                     warnings=list(composed.warnings))
    _refuse_unmodelled(r)

    # --- GPUs ---------------------------------------------------------------------------------------------
    per_node = _positive("trainer.n_gpus_per_node", r.take("trainer.n_gpus_per_node", int))
    trainer_gpus = _positive("trainer.nnodes", r.take("trainer.nnodes", int)) * per_node
    cluster: dict = {}
    if kind == FULLY_ASYNC:
        rollout_per_node = _positive("rollout.n_gpus_per_node", r.take("rollout.n_gpus_per_node", int))
        rollout_gpus = _positive("rollout.nnodes", r.take("rollout.nnodes", int)) * rollout_per_node
        if rollout_per_node != per_node:
            raise ConfigError("rollout.n_gpus_per_node", f"is {rollout_per_node} but trainer.n_gpus_per_node is "
                              f"{per_node}; a bidirl cluster has one cluster.gpus_per_node",
                              "convert with equal GPUs per node in both pools")
        cluster.update(gpus=rollout_gpus + trainer_gpus, gpus_per_node=per_node,
                       partition={"rollout": rollout_gpus, "trainer": trainer_gpus})
        r.note("trainer.n_gpus_per_node", f"trainer pool: {r.raw('trainer.nnodes')} × {per_node} = {trainer_gpus} "
               "GPUs (cluster.partition.trainer); cluster.gpus_per_node", ("cluster.gpus_per_node",
                                                                             "cluster.partition"))
        r.note("trainer.nnodes", f"trainer pool nodes: {trainer_gpus} trainer GPUs", ("cluster.partition",
                                                                                      "cluster.gpus"))
    else:
        cluster.update(gpus=trainer_gpus, gpus_per_node=per_node)
        r.note("trainer.n_gpus_per_node", f"cluster.gpus = trainer.nnodes × {per_node} = {trainer_gpus}; "
               "cluster.gpus_per_node")
        r.note("trainer.nnodes", f"cluster.gpus = {r.raw('trainer.nnodes')} × trainer.n_gpus_per_node")
    tp = _positive(f"{R}.tensor_model_parallel_size", r.take(f"{R}.tensor_model_parallel_size", int))
    cluster["rollout_tensor_parallel"] = tp
    rollout_pool = cluster["partition"]["rollout"] if kind == FULLY_ASYNC else trainer_gpus
    if rollout_pool % tp:
        raise ConfigError(f"{R}.tensor_model_parallel_size", f"{tp} does not divide the {rollout_pool} rollout GPUs",
                          "veRL builds whole replicas of tensor_model_parallel_size GPUs: use a divisor")
    ep = _positive(f"{R}.expert_parallel_size", r.take(f"{R}.expert_parallel_size", int))
    if ep > 1:
        if ep != tp:
            raise ConfigError(f"{R}.expert_parallel_size", f"{ep} is not tensor_model_parallel_size {tp} × "
                              "data_parallel_size 1 (veRL's RolloutConfig requires the product; bidirl's rollout "
                              "replica is one tensor-parallel engine)",
                              f"use 1 or {tp} (data-parallel rollout engines are not modelled)")
        cluster["rollout_expert_parallel"] = ep

    # --- workload -----------------------------------------------------------------------------------------
    workload: dict = {}
    mini = _positive(f"{A}.ppo_mini_batch_size", r.take(f"{A}.ppo_mini_batch_size", int))
    if kind == FULLY_ASYNC:
        trigger = _positive("async_training.trigger_parameter_sync_step",
                            r.take("async_training.trigger_parameter_sync_step", int))
        require = _positive("async_training.require_batches", r.take("async_training.require_batches", int))
        prompts = require * mini * trigger
        r.note("async_training.require_batches", f"prompts per local update = require_batches {require} × "
               f"ppo_mini_batch_size {mini} = {require * mini}")
        r.note("async_training.trigger_parameter_sync_step",
               f"rl.updates_per_sync = {trigger}; prompts per step = {require} × {mini} × {trigger} = {prompts}")
        r.note(f"{A}.ppo_mini_batch_size", f"rl.mini_batch_prompts = {mini}; a factor of the prompts per step")
        if r.has("data.train_batch_size"):
            out.not_used.append(_unused_row(r, "data.train_batch_size", "not effective in the fully-async trainer "
                                            "(docs/advance/fully_async.md): prompts per step = require_batches × "
                                            "ppo_mini_batch_size × trigger_parameter_sync_step", False))
    else:
        prompts = _positive("data.train_batch_size", r.take("data.train_batch_size", int))
        trigger = 1
        if mini > prompts:
            raise ConfigError(f"{A}.ppo_mini_batch_size", f"{mini} prompts exceed data.train_batch_size {prompts}",
                              "veRL refuses it: use a mini-batch no larger than the batch")
        r.note(f"{A}.ppo_mini_batch_size", f"rl.mini_batch_prompts = {mini} ({math.ceil(prompts / mini)} optimizer "
               "updates per step)", ("rl.mini_batch_prompts",))
        r.note("data.train_batch_size", f"workload.prompts_per_step = {prompts}")
    workload["prompts_per_step"] = prompts
    workload["group_size"] = _positive(f"{R}.n", r.take(f"{R}.n", int))
    workload["max_response_len"] = _positive("data.max_response_length", r.take("data.max_response_length", int))
    workload["max_prompt_len"] = _positive("data.max_prompt_length", r.take("data.max_prompt_length", int))
    _map_data(r, out, workload, dataset)
    _map_steps(r, out, kind, workload, prompts)

    # --- rl ----------------------------------------------------------------------------------------------
    rl: dict = {}
    if kind == FULLY_ASYNC:
        s = r.take("async_training.staleness_threshold", float)
        if s < 0:
            raise ConfigError("async_training.staleness_threshold", f"must be ≥ 0, got {s:g}", "use 0 or more")
        partial = r.take("async_training.partial_rollout", bool)
        rl["staleness"] = s
        rl["partial_rollout"] = bool(partial and s > 0)
        if partial and s == 0:
            r.note("async_training.partial_rollout", "true, but veRL applies it only when staleness_threshold > 0 "
                   "(docs/advance/fully_async.md): rl.partial_rollout = false")
        use_rollout = (r.take(f"{A}.use_rollout_log_probs", bool) if r.has(f"{A}.use_rollout_log_probs")
                       else r.take("async_training.use_rollout_log_probs", bool))
        prox = r.take("async_training.compute_prox_log_prob", bool)
        bypass = r.take("algorithm.rollout_correction.bypass_mode", bool)
        rl["recompute_old_logprob"] = bool(prox or not (use_rollout or bypass))
        result = (f"rl.recompute_old_logprob = compute_prox_log_prob or not (use_rollout_log_probs or bypass_mode) "
                  f"= {rl['recompute_old_logprob']}")
        for key in ("async_training.use_rollout_log_probs", f"{A}.use_rollout_log_probs",
                    "async_training.compute_prox_log_prob", "algorithm.rollout_correction.bypass_mode"):
            if key in r.rows:
                r.note(key, f"{r.rows[key]['value']}: {result}")
        rl["updates_per_sync"] = trigger
    else:
        bypass = r.take("algorithm.rollout_correction.bypass_mode", bool)
        rl["staleness"] = 0.0
        rl["partial_rollout"] = False
        rl["recompute_old_logprob"] = not bypass
        r.note("algorithm.rollout_correction.bypass_mode", f"{bypass}: rl.recompute_old_logprob = not bypass_mode = "
               f"{not bypass}")
        rl["updates_per_sync"] = 1
        out.derived += [
            {"bidirl": "rl.staleness", "value": 0.0, "from": "the colocated trainer is synchronous: each step "
             "generates with the weights the previous update produced"},
            {"bidirl": "rl.partial_rollout", "value": False, "from": "the colocated trainer finishes every "
             "generation before it trains"},
            {"bidirl": "rl.updates_per_sync", "value": 1, "from": "the colocated trainer syncs weights once per "
             "step, after all its mini-batch updates"}]
    rl["mini_batch_prompts"] = mini
    _map_kl(r, rl)
    _map_micro_batches(r, out, rl, trainer_gpus)
    rl["lr"] = r.take(f"{A}.optim.lr", float)
    low = r.take(f"{A}.clip_ratio_low", float, nullable=True) if (r.has(f"{A}.clip_ratio_low") or
                                                                 not r.has(f"{A}.clip_ratio")) else None
    if low is None:
        rl["clip_eps"] = r.take(f"{A}.clip_ratio", float)
    else:
        rl["clip_eps"] = low
        if r.has(f"{A}.clip_ratio"):
            out.not_used.append(_unused_row(r, f"{A}.clip_ratio", "veRL's loss uses clip_ratio_low when it is set "
                                            f"(it is: {low:g}; core_algos.py)", False))
    rl["activation_checkpointing"] = r.take(f"{M}.enable_gradient_checkpointing", bool)
    fsdp = r.take(f"{A}.fsdp_config.fsdp_size", int)
    if fsdp == 0 or fsdp < -1:
        raise ConfigError(f"{A}.fsdp_config.fsdp_size", f"is {fsdp}; veRL takes -1 (shard over every trainer GPU) or "
                          "a positive shard-group size", "use -1 or a positive number of GPUs")
    if fsdp == -1 or fsdp >= trainer_gpus:
        rl["fsdp_size"] = None
        r.note(f"{A}.fsdp_config.fsdp_size", f"{fsdp}: veRL shards over all {trainer_gpus} trainer GPUs; "
               "rl.fsdp_size stays empty, so the planner picks the smallest shard group that fits (a whole-pool "
               "group would tie the trainer replica to one pool's size)")
    else:
        if trainer_gpus % fsdp:
            raise ConfigError(f"{A}.fsdp_config.fsdp_size", f"{fsdp} does not divide the {trainer_gpus} trainer GPUs",
                              "veRL builds whole (replicate, shard) meshes: use a divisor of the trainer's GPUs")
        rl["fsdp_size"] = fsdp
    rl["param_offload"] = r.take(f"{A}.fsdp_config.param_offload", bool)
    rl["optimizer_offload"] = r.take(f"{A}.fsdp_config.optimizer_offload", bool)
    sp = _positive(f"{A}.ulysses_sequence_parallel_size", r.take(f"{A}.ulysses_sequence_parallel_size", int))
    ref_sp = r.take(f"{F}.ulysses_sequence_parallel_size", int)
    if ref_sp != sp and rl["reference_model"]:
        out.warnings.append(f"{F}.ulysses_sequence_parallel_size = {ref_sp} differs from the actor's {sp}: bidirl's "
                            f"trainer stages share one degree, rl.sequence_parallel = {sp}")
    rl["sequence_parallel"] = sp
    _map_reward(r, rl)

    # --- engine, policy, model, hardware --------------------------------------------------------------------
    name = r.take(f"{R}.name", str)
    if name != "vllm":
        out.warnings.append(f"{R}.name = {name}: bidirl's decode model and engine runs are vLLM's; the job is "
                            f"modelled as if it ran vLLM")
    policy = "verl-async" if kind == FULLY_ASYNC else "verl-colocated"
    hybrid = r.take("actor_rollout_ref.hybrid_engine", bool)
    if hybrid != (kind == COLOCATED):
        raise ConfigError("actor_rollout_ref.hybrid_engine", f"is {hybrid} but the {kind} trainer needs "
                          f"{kind == COLOCATED}", f"set actor_rollout_ref.hybrid_engine={kind == COLOCATED}")
    r.note(f"{R}.name", f"{name}: scheduler.policy {policy} (bidirl's model of veRL's {kind} trainer)")
    r.note("actor_rollout_ref.hybrid_engine", f"{hybrid}: the {kind} trainer, scheduler.policy {policy}")
    out.derived.append({"bidirl": "scheduler.policy", "value": policy, "from": f"veRL's {kind} trainer "
                        f"({source.entry or 'from its keys'}); simulate --policy bidirl to compare BiDiRL"})
    model_name = _map_model(r, out, model)
    hw = hardware
    if hw is None:
        out.missing.append({"key": "hardware", "problem": "a veRL config does not name its accelerator",
                            "fix": f"pass --hardware with a preset ({', '.join(presets.names('hardware'))}) or a "
                                   "preset file"})
    else:
        try:
            presets.hardware(hw)
        except presets.PresetError as exc:
            raise ConfigError("--hardware", str(exc), exc.fix) from None
        out.derived.append({"bidirl": "hardware", "value": hw, "from": "--hardware"})
    _kv_bound(r, out, hw, model_name, tp)

    order = ("dataset", "prompts_per_step", "group_size", "max_response_len", "steps", "data_file", "max_prompt_len")
    workload = {k: workload[k] for k in order if k in workload}
    out.config = {"model": model_name, "hardware": hw,
                  "cluster": cluster, "workload": workload, "rl": rl, "scheduler": {"policy": policy}}
    _account(r, out, composed, kind)
    return out


def _unused_row(r: _Reader, key: str, reason: str, timing: bool) -> dict:
    r.rows.pop(key, None)
    return {"key": key, "value": r.c.values.get(key), "origin": "input", "reason": reason, "timing": timing}


def _refuse_unmodelled(r: _Reader) -> None:
    """Settings that change the job's structure beyond bidirl's models: refused by name."""
    adv = r.take("algorithm.adv_estimator", str)
    critic = r.take("critic.enable", bool, nullable=True)
    if adv == "gae" or critic:
        where = "critic.enable" if critic else "algorithm.adv_estimator"
        raise ConfigError(where, f"{'critic.enable is true' if critic else 'gae'}: the job trains a critic, which "
                          "bidirl does not model", "convert a critic-free job (algorithm.adv_estimator=grpo, as "
                          "veRL's GRPO and DAPO examples set)")
    if r.take("reward_model.enable", bool):
        raise ConfigError("reward_model.enable", "true: a reward model scores responses on GPUs, a stage bidirl does "
                          "not model", "convert a job with rule-based rewards (reward_model.enable=false)")
    if r.take(f"{A}.ppo_epochs", int) != 1:
        raise ConfigError(f"{A}.ppo_epochs", f"is {r.raw(f'{A}.ppo_epochs')}: bidirl models one pass over each batch",
                          "convert with ppo_epochs=1")
    if r.take(f"{M}.lora_rank", int) > 0:
        raise ConfigError(f"{M}.lora_rank", "LoRA training: bidirl models full fine-tuning (its trainer memory and "
                          "time)", "convert with lora_rank=0")
    if r.take(f"{R}.multi_turn.enable", bool):
        raise ConfigError(f"{R}.multi_turn.enable", "multi-turn tool use: bidirl models single-turn generation",
                          "convert a single-turn job")
    strategy = r.take(f"{A}.strategy", str)
    if strategy not in ("fsdp", "fsdp2"):
        raise ConfigError(f"{A}.strategy", f"{strategy!r}: bidirl's trainer model is FSDP",
                          "convert an FSDP job (strategy fsdp or fsdp2)")


def _map_data(r: _Reader, out: Conversion, workload: dict, dataset: Optional[str]) -> None:
    files = r.take("data.train_files", object)
    paths = files if isinstance(files, list) else [files]
    parts = [p.lower() for f in paths if isinstance(f, str) for p in PurePosixPath(f).parts]
    stems = [PurePosixPath(f).stem.lower() for f in paths if isinstance(f, str)]
    matched = _match_preset("workloads", parts + stems)
    if dataset is not None:
        try:
            presets.workload(dataset)
        except presets.PresetError as exc:
            raise ConfigError("--dataset", str(exc), exc.fix) from None
        workload["dataset"] = dataset
        out.derived.append({"bidirl": "workload.dataset", "value": dataset, "from": "--dataset"})
        r.note("data.train_files", f"the workload preset is --dataset {dataset} (the path names "
               f"{matched or 'none'}); " + _data_file_how(files, workload),
               ("workload.data_file",) if "data_file" in workload else ("workload.dataset",))
    elif matched:
        workload["dataset"] = matched
        r.note("data.train_files", f"names the workload preset {matched}; " + _data_file_how(files, workload))
    else:
        workload["dataset"] = None
        out.missing.append({"key": "workload.dataset", "problem": f"no workload preset matches data.train_files "
                            f"{files!r} (presets: {', '.join(presets.names('workloads'))}); a veRL config does not "
                            "say how long the responses are",
                            "fix": "pass --dataset PRESET, or add data/presets/workloads/<name>.yaml with the prompt "
                                   "and response length statistics of your run (its response_length/mean and "
                                   "prompt_length/mean metrics; see data/presets/workloads/gsm8k.yaml)"})
        r.note("data.train_files", "names no workload preset (missing: workload.dataset); "
               + _data_file_how(files, workload))


def _data_file_how(files: Any, workload: dict) -> str:
    ok = (isinstance(files, str) and "$" not in files and not files.startswith("~")
          and files.endswith((".parquet", ".jsonl")))
    if ok:
        workload["data_file"] = files
        return f"workload.data_file = {files}"
    return ("not workload.data_file: " + ("a shell variable or ~ stays unexpanded" if isinstance(files, str)
                                          else "several files") + " (engine runs only)")


def _map_steps(r: _Reader, out: Conversion, kind: str, workload: dict, prompts: int) -> None:
    if kind == FULLY_ASYNC:
        if r.has("trainer.total_training_steps"):
            out.not_used.append(_unused_row(r, "trainer.total_training_steps", "the fully-async trainer's run "
                                            "length is rollout.total_rollout_steps (prompts)", False))
        total = _positive("rollout.total_rollout_steps", r.take("rollout.total_rollout_steps", int))
        steps = total // prompts
        if steps < 1:
            raise ConfigError("rollout.total_rollout_steps", f"{total} prompts are fewer than one weight sync's "
                              f"{prompts}", "raise rollout.total_rollout_steps (it counts prompts)")
        workload["steps"] = steps
        r.note("rollout.total_rollout_steps", f"workload.steps = ⌊{total} ÷ {prompts}⌋ = {steps} (at most: veRL also "
               "stops after trainer.total_epochs passes over the data)")
        return
    steps = r.take("trainer.total_training_steps", int, nullable=True)
    if steps is not None:
        workload["steps"] = _positive("trainer.total_training_steps", steps)
        return
    r.rows.pop("trainer.total_training_steps", None)
    workload["steps"] = 20
    out.derived.append({"bidirl": "workload.steps", "value": 20, "from": "bidirl's default number of simulated "
                        "steps: veRL runs trainer.total_epochs × ⌈rows of data.train_files ÷ data.train_batch_size⌉ "
                        "steps, and bidirl does not read the data file (set trainer.total_training_steps or "
                        "workload.steps)"})


def _map_micro_batches(r: _Reader, out: Conversion, rl: dict, trainer_gpus: int) -> None:
    dynamic = r.take(f"{A}.use_dynamic_bsz", bool)
    budget = _positive(f"{A}.ppo_max_token_len_per_gpu", r.take(f"{A}.ppo_max_token_len_per_gpu", int))
    if dynamic:
        rl["max_tokens_per_micro_batch"] = budget
        r.note(f"{A}.use_dynamic_bsz", "true: rl.max_tokens_per_micro_batch (token-budget micro-batches)")
        r.note(f"{A}.ppo_max_token_len_per_gpu", f"rl.max_tokens_per_micro_batch = {budget} (veRL packs "
               f"{budget} × ulysses_sequence_parallel_size tokens per sequence-parallel group, dp_actor.py: "
               f"{budget} per GPU)")
    else:
        r.note(f"{A}.use_dynamic_bsz", "false: micro-batches counted in samples (rl.micro_batch_per_device)",
               ("rl.micro_batch_per_device",))
        r.note(f"{A}.ppo_max_token_len_per_gpu", "applies only with use_dynamic_bsz, which is off: "
               "rl.max_tokens_per_micro_batch stays empty")
        per_gpu = r.take(f"{A}.ppo_micro_batch_size_per_gpu", int, nullable=True)
        if per_gpu is None and r.has(f"{A}.ppo_micro_batch_size"):
            total = _positive(f"{A}.ppo_micro_batch_size", r.take(f"{A}.ppo_micro_batch_size", int))
            per_gpu = max(1, total // trainer_gpus)
            r.note(f"{A}.ppo_micro_batch_size", f"rl.micro_batch_per_device = max(1, {total} ÷ {trainer_gpus} "
                   f"trainer GPUs) = {per_gpu}")
        if per_gpu is None:
            raise ConfigError(f"{A}.ppo_micro_batch_size_per_gpu", "is not set and use_dynamic_bsz is off",
                              "veRL refuses this too: set ppo_micro_batch_size_per_gpu or use_dynamic_bsz=true")
        rl["micro_batch_per_device"] = _positive(f"{A}.ppo_micro_batch_size_per_gpu", per_gpu)
    for stage in (R, F):
        s_dyn = r.take(f"{stage}.log_prob_use_dynamic_bsz", bool)
        s_budget = r.take(f"{stage}.log_prob_max_token_len_per_gpu", int)
        s_micro = r.take(f"{stage}.log_prob_micro_batch_size_per_gpu", int, nullable=True)
        label = "rollout (old log-prob)" if stage == R else "reference"
        if s_dyn != dynamic:
            out.warnings.append(f"{stage}.log_prob_use_dynamic_bsz = {s_dyn} but the actor's use_dynamic_bsz = "
                                f"{dynamic}: bidirl's {label} stage follows the actor's micro-batching")
        if dynamic and s_dyn:
            r.note(f"{stage}.log_prob_max_token_len_per_gpu",
                   f"{s_budget} tokens; bidirl's {label} stage packs to the update's "
                   f"rl.max_tokens_per_micro_batch = {budget}"
                   + (f" (veRL's forward-only budget is {s_budget / budget:g}× larger: bidirl runs that stage in "
                      f"more, smaller micro-batches)" if s_budget != budget else ""))
        else:
            r.note(f"{stage}.log_prob_max_token_len_per_gpu", f"applies only with log_prob_use_dynamic_bsz and the "
                   f"actor's use_dynamic_bsz; here the {label} stage is counted in samples")
        if not dynamic and s_micro is not None and s_micro != rl.get("micro_batch_per_device"):
            out.warnings.append(f"{stage}.log_prob_micro_batch_size_per_gpu = {s_micro} differs from the update's "
                                f"{rl['micro_batch_per_device']}: bidirl's {label} stage uses the update's")
        r.note(f"{stage}.log_prob_micro_batch_size_per_gpu",
               f"{s_micro}: bidirl's {label} stage uses the update's micro-batch "
               f"({'the token budget' if dynamic else rl.get('micro_batch_per_device')})")
        r.note(f"{stage}.log_prob_use_dynamic_bsz", f"{s_dyn}: bidirl's {label} stage follows the update "
               f"({'token budget' if dynamic else 'samples'})")


def _map_kl(r: _Reader, rl: dict) -> None:
    kl_loss = r.take(f"{A}.use_kl_loss", bool)
    kl_reward = r.take("algorithm.use_kl_in_reward", bool)
    loss_coef = r.take(f"{A}.kl_loss_coef", float)
    reward_coef = r.take("algorithm.kl_ctrl.kl_coef", float)
    rl["reference_model"] = bool(kl_loss or kl_reward)
    coef = (loss_coef if kl_loss else 0.0) + (reward_coef if kl_reward else 0.0)
    rl["kl_coef"] = coef
    r.note(f"{A}.use_kl_loss", f"{kl_loss}: rl.reference_model = use_kl_loss or use_kl_in_reward = "
           f"{rl['reference_model']} (verl/trainer/ppo/utils.py need_reference_policy)")
    r.note("algorithm.use_kl_in_reward", f"{kl_reward}: rl.reference_model = {rl['reference_model']}")
    r.note(f"{A}.kl_loss_coef", f"rl.kl_coef += {loss_coef:g}" if kl_loss else
           f"{loss_coef:g}, but use_kl_loss is false: it does not enter rl.kl_coef")
    r.note("algorithm.kl_ctrl.kl_coef", f"rl.kl_coef += {reward_coef:g} (bidirl applies β in the loss)" if kl_reward
           else f"{reward_coef:g}, but use_kl_in_reward is false: it does not enter rl.kl_coef")
    r.note("algorithm.adv_estimator", f"{r.raw('algorithm.adv_estimator')}: critic-free, as bidirl models")


def _map_reward(r: _Reader, rl: dict) -> None:
    path = r.take("custom_reward_function.path", str, nullable=True)
    if path is None:
        r.rows.pop("custom_reward_function.path", None)
        r.rows.pop("custom_reward_function.name", None)
        if r.has("custom_reward_function.name"):
            r.rows["custom_reward_function.name"] = {
                "key": "custom_reward_function.name", "value": r.c.values["custom_reward_function.name"],
                "origin": "input", "bidirl": ["rl.reward"], "how": "no custom_reward_function.path: rl.reward keeps "
                "bidirl's default scorer"}
        return
    name = r.take("custom_reward_function.name", str)
    rl["reward"] = f"{path}:{name}"


def _model_name(path: str) -> str:
    """The model's name in its path: the last part, or in a Hugging Face cache path
    (``…/models--Qwen--Qwen2-7B-Instruct/snapshots/<commit>``) the name in the ``models--`` part."""
    parts = PurePosixPath(path.rstrip("/")).parts
    for part in reversed(parts):
        if part.startswith("models--"):
            return part.split("--")[-1]
    return parts[-1] if parts else path


def _map_model(r: _Reader, out: Conversion, given: Optional[str]) -> str:
    path = r.take(f"{M}.path", str)
    base = _model_name(path)
    candidates = [base.lower(), base.lower().replace("_", "-")]
    matched = next((c for c in candidates if c in presets.names("models")), None)
    if given is not None:
        try:
            presets.model(given)
        except presets.PresetError as exc:
            raise ConfigError("--model", str(exc), exc.fix) from None
        r.note(f"{M}.path", f"{base}: --model {given} names the model preset", ("model",))
        out.derived.append({"bidirl": "model", "value": given, "from": "--model"})
        return given
    if matched:
        r.note(f"{M}.path", f"{base} → model preset {matched}")
        return matched
    name = candidates[0]
    r.note(f"{M}.path", f"{base} → model: {name}, a preset not (yet) shipped (missing)")
    out.missing.append({"key": "model", "problem": f"no model preset named {name!r} (from {path!r}; presets: "
                        f"{', '.join(presets.names('models'))})",
                        "fix": f"add data/presets/models/{name}.yaml with the architecture from the model's "
                               "config.json (layers, hidden, intermediate, heads, kv_heads, head_dim, vocab, "
                               "tie_word_embeddings, params_total, params_nonembedding) and its sources, as "
                               "data/presets/models/qwen3-8b.yaml does, or pass --model PRESET"})
    return name


def _kv_bound(r: _Reader, out: Conversion, hw: Optional[str], model_name: str, tp: int) -> None:
    """``gpu_memory_utilization``: named not used; with known presets its reason gives the KV upper bound
    util × memory − weights ÷ ρ_r (vLLM also takes its activation peak and non-torch memory from that share)."""
    key = f"{R}.gpu_memory_utilization"
    util = r.take(key, float)
    r.rows.pop(key, None)
    rule = _EXACT[key]
    reason = rule.text
    bound = None
    if hw is not None and model_name in presets.names("models"):
        spec, m = presets.hardware(hw), presets.model(model_name)
        bound = (util * spec.memory_bytes - m.weight_bytes / tp) / 2 ** 30
        reason += (f"; its KV cache is at most {util:g} × {spec.memory_bytes / 2 ** 30:g} GiB − "
                   f"{m.weight_bytes / 2 ** 30:.1f} GiB of weights ÷ {tp} = {bound:.1f} GiB per GPU")
    out.not_used.append({"key": key, "value": util, "origin": "input" if r.has(key) else "veRL default",
                         "reason": reason, "timing": True})


def _account(r: _Reader, out: Conversion, composed: Composed, kind: str) -> None:
    """One row per input key: mapped (the reader's rows) or not used (its rule's reason)."""
    unused_keys = {row["key"] for row in out.not_used}
    for key, value in composed.values.items():
        if key in r.rows or key in unused_keys:
            continue
        rule = rule_for(key, kind)
        if rule is None:                        # added with + (or --lenient) and unknown to bidirl
            out.not_used.append({"key": key, "value": value, "origin": "input", "timing": False,
                                 "reason": f"a key veRL's trainer config at {VERL_COMMIT[:24]} does not declare "
                                           f"(added with +, or from another veRL release); {_suggest(key, kind)}"
                                           "bidirl has no model of it"})
        elif rule.mapped:
            raise AssertionError(f"mapped key {key} was not read by the conversion")   # a bug in this module
        else:
            out.not_used.append({"key": key, "value": value, "origin": "input", "reason": rule.text,
                                 "timing": rule.timing})
            if rule.timing and _changes_default(key, value):
                out.warnings.append(f"{key} = {value!r}: {rule.text}")
    for key, where in composed.deleted.items():
        if key not in r.rows:
            out.not_used.append({"key": key, "value": None, "origin": f"deleted ({where})", "timing": False,
                                 "reason": f"deleted with ~{key}"})
    out.mapped = list(r.rows.values())


def _changes_default(key: str, value: Any) -> bool:
    """Timing-relevant unused keys warn only when they turn something on (filter groups, offload ...)."""
    if key.endswith(("filter_groups.enable", "param_offload", "enable_activation_offload")):
        return value is True
    return key.endswith("gen_batch_size") and value not in (None, 1)


def key_table() -> list:
    """The mapping table (README, docs): ``(veRL key, bidirl keys or "not used", how / why)`` per rule."""
    return [(rule.pattern, ", ".join(rule.targets) or ("checked" if rule.check else "not used"), rule.text)
            for rule in RULES]
