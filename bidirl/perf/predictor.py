"""The stage-time predictor: what every driver and the coordinator ask of the appendix's models (§5.1).

As Vidur keeps its execution-time predictor apart from schedulers and the event loop, one object answers the
questions the control plane asks — how long a trainer chunk takes on a gang of ``d`` replicas, how long ``d``
rollout replicas need for a set of requests (M_r), how long the optimizer step and a weight sync take — and
gives the continuous-batching replica model (:mod:`bidirl.perf.engine`) its per-iteration cost terms, so
prediction, simulation and emulation share one model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bidirl.perf.engine import EngineCosts
from bidirl.perf.flops import prefill_flops
from bidirl.perf.rollout import RolloutModel
from bidirl.perf.trainer import TrainerModel

MAX_SEQS = 256   # vLLM's default max_num_seqs: the engine model and M_r share the same concurrency cap
#: bytes moved per parameter by one AdamW step over fp32 master weights (read/write weights, m, v; read grads)
OPTIMIZER_BYTES_PER_PARAM = 16
#: achieved share of the memory bandwidth in the optimizer's element-wise kernels
OPTIMIZER_BANDWIDTH_SHARE = 0.5


def optimizer_time(model, hardware, gpus: int) -> float:
    """One AdamW step over fp32 master weights sharded on ``gpus`` GPUs (memory-bound: ~16 B per parameter)."""
    return (model.params_total * OPTIMIZER_BYTES_PER_PARAM
            / (hardware.memory_bandwidth * OPTIMIZER_BANDWIDTH_SHARE) / max(1, int(gpus)))


@dataclass
class StagePredictor:
    rollout: RolloutModel
    trainer: TrainerModel
    group_size: int

    @classmethod
    def from_config(cls, cfg, rollout_layout: int, trainer_layout: int) -> "StagePredictor":
        m, hw = cfg.model_spec, cfg.hardware_spec
        return cls(RolloutModel(m, hw, tp=rollout_layout, max_seqs=MAX_SEQS),
                   TrainerModel(m, hw, layout=trainer_layout), cfg.workload.group_size)

    def __post_init__(self):
        self._chunk_cache: dict = {}

    def chunk_time(self, stage, prompt_lens, response_lens, d) -> float:
        """M_t of one chunk (memoised: the scheduler re-evaluates the same chunks while it plans)."""
        key = (stage, d, tuple(prompt_lens), tuple(response_lens))
        t = self._chunk_cache.get(key)
        if t is None:
            if len(self._chunk_cache) > 200_000:
                self._chunk_cache.clear()
            t = self._chunk_cache[key] = float(self.trainer.chunk_time(
                stage, np.asarray(prompt_lens), np.asarray(response_lens), d))
        return t

    def rollout_time(self, prompt_lens, response_lens, d) -> float:
        """M_r of a request set on ``d`` replicas (whole groups dealt when it is made of whole groups)."""
        if len(response_lens) == 0:
            return 0.0
        whole = len(response_lens) % self.group_size == 0
        return float(self.rollout.stage_time(np.asarray(prompt_lens), np.asarray(response_lens), d,
                                             group_size=self.group_size if whole else 1))

    def optimizer_time(self, trainer_gpus: int) -> float:
        return optimizer_time(self.trainer.model, self.trainer.hardware, trainer_gpus)

    def engine_costs(self) -> EngineCosts:
        p = self.rollout.params
        spec = self.rollout.model
        return EngineCosts(tau_pre=p.tau_pre, alpha_pre=p.alpha_pre, tau_dec=p.tau_dec, beta_tok=p.beta_tok,
                           beta_hist=p.beta_hist,
                           prefill_flops=lambda prompts: prefill_flops(spec, prompts),
                           kv_tokens=int(self.rollout.kv_budget_bytes // self.rollout.kv_bytes_per_token),
                           max_seqs=self.rollout.max_seqs or MAX_SEQS)
