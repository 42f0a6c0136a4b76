"""veRL's synchronous trainer stages on a colocated pool, as its FSDP workers run them (the colocated baseline's
trainer, :mod:`bidirl.sim.colocated`; paper §7.1 "Baselines").

With the settings real jobs use — token-budget micro-batches (``rl.max_tokens_per_micro_batch``, veRL
``use_dynamic_bsz`` + ``ppo_max_token_len_per_gpu``), optimizer mini-batches (``rl.mini_batch_prompts``,
``ppo_mini_batch_size``), Ulysses sequence parallelism (``rl.sequence_parallel``) and parameter / optimizer
offload — veRL's hybrid engine runs a stage like this (veRL ``verl/trainer/ppo/ray_trainer.py``,
``verl/workers/actor/dp_actor.py``, ``verl/utils/seqlen_balancing.py``, ``verl/workers/fsdp_workers.py``):

* **data ranks.** The G GPUs form ``G / k`` data ranks of k = ``sequence_parallel`` GPUs each (a Ulysses group
  computes one sample's tokens together). ``_balance_batch`` deals the step's samples to the ranks with equal
  counts and balanced token sums (here: :func:`bidirl.perf.balance.serpentine` on tokens, the same balancing).
* **mini-batches** (``actor_update`` only). Each rank cuts its samples, in order, into the step's
  ``prompts_per_step / mini_batch_prompts`` mini-batches (``ppo_mini_batch_size · n / ranks`` samples each); one
  optimizer step follows each mini-batch. The log-prob stage runs the rank's samples as one pass.
* **micro-batches.** ``rearrange_micro_batches`` packs a rank's samples of a mini-batch into
  ``⌈tokens / (budget · k)⌉`` micro-batches — the same count on every rank (an all-reduce MAX over the data
  ranks) — balanced by token sums (Karmarkar–Karp there; longest-first into the lightest micro-batch here).
  Without a budget, micro-batches of ``micro_batch_per_device · k`` samples.
* **timing.** FSDP's collectives synchronise the ranks at every micro-batch, so a micro-batch round takes its
  slowest rank: ``Σ_rounds max_rank t_s(b)``, with t_s(b) the appendix's trainer model (:mod:`bidirl.perf.trainer`)
  on a replica of k GPUs, with the shared execution-setting terms of :mod:`bidirl.perf.execution` (activation
  checkpointing's recompute, Ulysses' all-to-alls).
* **offload.** ``param_offload`` loads the FSDP shard of fp32 parameters (``4·N/ρ_t`` bytes per GPU) before each
  stage and offloads it after; ``optimizer_offload`` does the same with the two fp32 Adam moments (``8·N/ρ_t``)
  around the update (``load_fsdp_model_to_gpu`` / ``offload_fsdp_model_to_cpu``, ``load_fsdp_optimizer`` /
  ``offload_fsdp_optimizer``: pageable copies, at the pageable share of the host link that :func:`bidirl.perf.costs.switch_constants` gives).
  ρ_t, the planner's trainer layout, is the FSDP shard group (``rl.fsdp_size``, veRL's ``fsdp_size``, when the
  job sets it).
* **the driver's data path.** Each stage is one worker-group call of the whole step batch: the driver sends every
  data rank its padded piece through Ray's object store and collects the outputs
  (:mod:`bidirl.perf.controller_data`; 0 unless the hardware preset has a ``controller_data_rate``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Optional

import numpy as np

from bidirl.perf.balance import serpentine
from bidirl.perf.costs import switch_constants
from bidirl.perf.trainer import TrainerModel

#: bytes per parameter of the FSDP shard veRL's ``param_offload`` moves: fp32 parameters
#: (veRL keeps FSDP parameters in fp32 and computes in bf16: ``fsdp_workers.py`` ``mixed_precision``)
PARAM_OFFLOAD_BYTES = 4
#: bytes per parameter ``optimizer_offload`` moves: AdamW's two fp32 moments (torch.optim.AdamW state)
OPTIMIZER_OFFLOAD_BYTES = 8


def _bins(tokens: np.ndarray, n: int) -> list:
    """``n`` micro-batches of these samples (indices), longest first into the lightest (veRL balances them by
    token sums with Karmarkar–Karp: ``seqlen_balancing.get_seqlen_balanced_partitions``)."""
    order = np.argsort(-tokens, kind="stable")
    load = np.zeros(n)
    out = [[] for _ in range(n)]
    for i in order.tolist():
        j = int(np.argmin(load))
        out[j].append(i)
        load[j] += tokens[i]
    return [np.array(sorted(b), dtype=np.int64) for b in out]


@dataclass(frozen=True)
class VerlUpdate:
    """The schedule of one step's trainer stages on a colocated pool of ``gpus`` GPUs (module doc)."""
    trainer: TrainerModel        # t_s(b) on a replica of ``sp`` GPUs
    gpus: int
    sp: int
    group_size: int
    prompts_per_step: int
    mini_batch_prompts: Optional[int]
    budget: Optional[int]        # tokens per micro-batch per GPU (× sp per data rank)
    micro_batch_per_device: int
    shard: int                   # ρ_t: GPUs of one FSDP shard group
    param_offload: bool
    optimizer_offload: bool
    pageable_bandwidth: float    # B/s per direction of a pageable host copy
    #: stage -> seconds of the driver's data path for that stage's call over the step batch (fixed by the job)
    controller_seconds: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, cfg, trainer_layout: int) -> "VerlUpdate":
        from bidirl.perf import execution
        from bidirl.perf.params import default_trainer_params
        r, hw, m = cfg.rl, cfg.hardware_spec, cfg.model_spec
        recompute = r.activation_checkpointing is True
        params = default_trainer_params(m, hw, r.sequence_parallel)
        if recompute:
            params = execution.with_recompute(params, m, hw)
        params = execution.with_sequence_parallel(params, m, hw, r.sequence_parallel, r.sequence_parallel, recompute)
        from bidirl.perf.controller_data import call_seconds
        samples = cfg.workload.prompts_per_step * cfg.workload.group_size
        controller = {stage: call_seconds(stage, samples, cfg) for stage in r.stages}
        return cls(TrainerModel(m, hw, layout=r.sequence_parallel, params=params,
                                image_tokens_per_prompt=cfg.workload_stats.image_tokens_per_prompt), cfg.cluster.gpus,
                   r.sequence_parallel, cfg.workload.group_size, cfg.workload.prompts_per_step, r.mini_batch_prompts,
                   r.max_tokens_per_micro_batch, r.micro_batch_per_device, int(trainer_layout), r.param_offload,
                   r.optimizer_offload,
                   float(hw.host_bandwidth) * switch_constants(hw)["pageable_fraction"], controller)

    @property
    def ranks(self) -> int:
        return max(1, self.gpus // self.sp)

    def _micro_rounds(self, per_rank: list, tokens: np.ndarray) -> list:
        """Micro-batch rounds of one pass: a list over rounds of each rank's sample indices."""
        if self.budget is None:
            size = self.micro_batch_per_device * self.sp
            n = max(math.ceil(len(ix) / size) for ix in per_rank)
            return [[ix[k * size:(k + 1) * size] for ix in per_rank] for k in range(n)]
        cap = self.budget * self.sp
        n = max(1, max(math.ceil(tokens[ix].sum() / cap) for ix in per_rank))
        binned = [[ix[b] for b in _bins(tokens[ix], n)] for ix in per_rank]
        return [[b[k] for b in binned] for k in range(n)]

    def passes(self, stage: str, tokens: np.ndarray) -> list:
        """The passes of ``stage`` over the step's samples (tokens per sample, in batch order): one per optimizer
        mini-batch for ``actor_update``, one for a log-prob stage; each a list of micro-batch rounds."""
        rank_of, _ = serpentine(tokens, self.ranks)
        per_rank = [np.flatnonzero(rank_of == j) for j in range(self.ranks)]
        if stage != "actor_update" or not self.mini_batch_prompts:
            return [self._micro_rounds(per_rank, tokens)]
        minis = self.prompts_per_step // self.mini_batch_prompts
        return [self._micro_rounds([np.array_split(ix, minis)[m] for ix in per_rank], tokens)
                for m in range(minis)]

    def round_time(self, stage: str, prompt_lens: np.ndarray, response_lens: np.ndarray, ranks: list) -> float:
        """One micro-batch round: its slowest rank's t_s(b)."""
        return max((self.trainer.microbatch_time(stage, prompt_lens[ix], response_lens[ix]) for ix in ranks
                    if len(ix)), default=0.0)

    def controller_time(self, stage: str) -> float:
        """The driver's data path for ``stage``'s call over the step batch (:mod:`bidirl.perf.controller_data`)."""
        return self.controller_seconds.get(stage, 0.0)

    def param_copy_time(self) -> float:
        """Load and offload of the parameter shard around one stage (0 without ``param_offload``)."""
        if not self.param_offload:
            return 0.0
        return 2 * PARAM_OFFLOAD_BYTES * self.trainer.model.params_total / self.shard / self.pageable_bandwidth

    def optimizer_copy_time(self) -> float:
        """Load and offload of the Adam moments around the update (0 without ``optimizer_offload``)."""
        if not self.optimizer_offload:
            return 0.0
        return 2 * OPTIMIZER_OFFLOAD_BYTES * self.trainer.model.params_total / self.shard / self.pageable_bandwidth

