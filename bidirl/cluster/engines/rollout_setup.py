"""What every rollouter of an engine run starts with, resolved once from the plan before any actor starts.

A rollout replica (paper §2.1) is one vLLM engine; its settings follow the planner's envelope and memory
model (§4.1) instead of fixed numbers:

* **KV cache** — :func:`bidirl.job.planner.rollout_kv_budget`: ``cluster.rollout_kv_cache_gib`` or the memory
  model's budget for both roles of one GPU (§3.2: the rollouter awake beside the trainer rank that shares its
  GPU), the batch and the lengths, checked to hold one sequence of prompt + ``max_response_len`` tokens. The
  KV bytes per token come from the checkpoint's config at the engine's dtype (bf16 on CUDA, fp32 on CPU).
* **Tensor parallelism** — ``plan.envelope.rollout_layout`` (ρ_r). Engine runs place each rollouter on one GPU
  slot (its Ray actor holds half of one placement-group bundle), and vLLM's in-process CPU engine runs one
  worker (``distributed_executor_backend="uni"``), so ρ_r > 1 is a :class:`ConfigError` naming why; every
  shipped model and GPU preset plans ρ_r = 1.
* **CUDA graphs** on CUDA (``enforce_eager`` only on CPU, where vLLM would compile with inductor instead and
  there are no graphs to capture); **prefix caching** on (a group's responses share their prompt; the engine
  resets the cache whenever cached blocks stop being valid: after a weight load and after its KV storage is
  restored).
* On CUDA, ``memory_bytes`` = rollout weights + activation reserve + KV cache: vLLM's start-up check asks for
  that much free memory rather than 90 % of the device, which a trainer rank on the same GPU may hold part of.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from bidirl.cluster.engines.workers.rollout_weights import SLEEP_LEVEL
from bidirl.errors import ConfigError


@dataclass(frozen=True)
class RolloutSetup:
    """The rollouters' engine settings (module docstring); ``kv`` is a :class:`bidirl.job.planner.KVBudget`."""
    device: str
    dtype: str
    tensor_parallel_size: int
    enforce_eager: bool
    enable_prefix_caching: bool
    max_model_len: int
    max_num_seqs: int
    kv: object
    memory_bytes: Optional[int] = None

    @classmethod
    def resolve(cls, plan, model_dir: str, max_prompt_len: int, gpu: bool, windows: int = 1) -> "RolloutSetup":
        """The settings of ``plan``'s rollouters for the checkpoint in ``model_dir``, prompts of at most
        ``max_prompt_len`` tokens, on CUDA (``gpu``) or CPU, with ``windows`` auxiliary windows per step on the
        primary trainer (0 under a policy without Trainer-on-RolloutPool). Raises :class:`ConfigError` (module
        docstring), :class:`~bidirl.job.planner.DeviceMemoryError` when the trainer's slot does not fit."""
        from bidirl.job import planner
        from bidirl.perf import memory
        from bidirl.perf.predictor import MAX_SEQS
        from bidirl.rl.model_folder import causal_lm_config, kv_cache_shape

        cfg = plan.config
        tp = int(plan.envelope.rollout_layout)
        if tp > 1:
            m, hw, w = cfg.model_spec, cfg.hardware_spec, cfg.workload
            need = memory.rollout_need(m, hw, 1, w.group_size, cfg.workload_stats.prompt_max + w.max_response_len)
            where = ("vLLM's in-process CPU engine runs one worker" if not gpu else
                     "engine runs place each rollouter on one GPU (its Ray actor holds half of one bundle)")
            raise ConfigError("hardware", f"the planner sizes a rollout replica of {m.name} at {tp} GPUs (ρ_r, §4.1): "
                              f"on one GPU it needs {need.total / planner.GiB:.1f} GiB, {hw.name} has "
                              f"{need.usable / planner.GiB:.1f} GiB usable; {where}, so ρ_r > 1 cannot run",
                              "use a hardware preset with more memory per GPU or a smaller model (the planner then "
                              "picks ρ_r = 1)")
        device, dtype, dtype_bytes = ("cuda", "bfloat16", 2) if gpu else ("cpu", "float32", 4)
        shape = kv_cache_shape(causal_lm_config(model_dir, "EngineDriver.model_dir"))
        kv = planner.rollout_kv_budget(plan, device=device, kv_shape=shape, dtype_bytes=dtype_bytes,
                                       max_prompt_len=max_prompt_len, max_seqs=MAX_SEQS, windows=windows)
        footprint = None
        if gpu:
            footprint = int(kv.terms["rollout_weights"] + kv.terms["activation_reserve"]) + kv.bytes
        return cls(device=device, dtype=dtype, tensor_parallel_size=tp, enforce_eager=not gpu,
                   enable_prefix_caching=True, max_model_len=int(max_prompt_len) + cfg.workload.max_response_len,
                   max_num_seqs=MAX_SEQS, kv=kv, memory_bytes=footprint)

    def engine_kwargs(self) -> dict:
        """``RolloutEngine`` keyword arguments for these settings."""
        return dict(max_model_len=self.max_model_len, kv_cache_gib=self.kv.bytes / 2**30, device=self.device,
                    dtype=self.dtype, tensor_parallel_size=self.tensor_parallel_size,
                    enforce_eager=self.enforce_eager, enable_prefix_caching=self.enable_prefix_caching,
                    max_num_seqs=self.max_num_seqs, memory_bytes=self.memory_bytes)

    def shape(self) -> dict:
        """What kept workers must have been started with (``EngineDriver.worker_shape``)."""
        return dict(max_model_len=self.max_model_len, kv_cache_bytes=self.kv.bytes, rollout_device=self.device,
                    rollout_dtype=self.dtype, tensor_parallel_size=self.tensor_parallel_size,
                    enforce_eager=self.enforce_eager, prefix_caching=self.enable_prefix_caching,
                    max_num_seqs=self.max_num_seqs, memory_bytes=self.memory_bytes)

    def summary(self) -> dict:
        """The run summary's ``rollout_engine`` entry: the settings, the KV budget and the switch-out sleep."""
        return dict(self.shape(), kv_cache=self.kv.to_dict(), cuda_graphs=not self.enforce_eager,
                    switch_out=(f"vLLM sleep level {SLEEP_LEVEL}" if self.device == "cuda" else
                                "KV cache storage freed (vLLM has no sleep mode on CPU)"))
