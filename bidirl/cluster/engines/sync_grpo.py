"""A synchronous, on-policy GRPO loop over one rollout engine and one trainer engine (no Ray, no scheduler).

This is the logical RL computation that the BiDiRL runtime distributes (paper §2.1 and §7.5: scheduling
changes where and when work runs, never which samples and updates GRPO sees). One step:

1. generate ``prompts_per_step`` groups of ``group_size`` responses with the current weights;
2. rewards → group-normalised advantages (``grpo.group_advantages``);
3. ``old_logprob`` (and ``ref_logprob`` when ``kl_coef > 0``) stages on the trainer;
4. ``actor_update``: the batch is cut into chunks of ``chunk_size`` samples in (group, response) order,
   each chunk's gradient uses the step-level normaliser, and the primary trainer sums them in chunk order
   and steps AdamW;
5. weight sync: the trainer's ``state_dict`` is loaded into the rollout engine as the next version.

It serves as the reference the distributed runtime is compared against, and as the smoke test that the
engines learn (mean reward rises on the arithmetic task).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from bidirl.rl import grpo
from bidirl.rl.samples import samples_from_groups
from bidirl.rl.tasks import ArithmeticTask


@dataclass(frozen=True)
class StepStats:
    step: int
    version: int
    reward_mean: float
    response_len_mean: float
    loss: float
    kl: float
    clip_frac: float
    grad_norm: float
    timing_gen: float
    timing_old_logprob: float
    timing_update: float
    timing_sync: float
    samples: int
    tokens: int


def requests_for(task: ArithmeticTask, tokenizer, start: int, prompts: int, group_size: int, max_tokens: int,
                 pool: Optional[int] = None):
    """``GroupRequest``s for problems ``start .. start + prompts - 1`` (group id = problem index).

    With ``pool``, problem indices wrap around modulo ``pool``: training cycles over a fixed prompt set.
    """
    from bidirl.cluster.engines.workers.rollout import GroupRequest

    idx = [(start + j) % pool if pool else start + j for j in range(prompts)]
    problems = [task.problem(i) for i in idx]
    return [GroupRequest(p.index, tuple(tokenizer(p.text)["input_ids"]), group_size, max_tokens, p.answer)
            for p in problems]


def run_grpo(rollout, trainer, task: ArithmeticTask, steps: int, prompts_per_step: int = 8, group_size: int = 8,
             max_tokens: int = 8, chunk_size: int = 16, prompt_pool: Optional[int] = None, progress: bool = False,
             on_step: Optional[Callable[[StepStats], None]] = None) -> list:
    """Run ``steps`` GRPO steps; returns one :class:`StepStats` per step (veRL-style timings in seconds).

    Step ``k`` uses problems ``k·prompts_per_step ...`` of ``task`` (modulo ``prompt_pool`` when given).
    """
    from tqdm.auto import tqdm

    for name, v in (("steps", steps), ("prompts_per_step", prompts_per_step), ("group_size", group_size),
                    ("max_tokens", max_tokens), ("chunk_size", chunk_size)) + \
            ((("prompt_pool", prompt_pool),) if prompt_pool is not None else ()):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"run_grpo: {name} must be a positive integer, got {v!r}")
    if rollout.reward_fn is None:
        raise ValueError("run_grpo: the rollout engine needs a reward_fn (e.g. RolloutEngine(..., reward_fn=task.reward))")
    history = []
    for step in tqdm(range(steps), desc="GRPO", disable=not progress):
        t0 = time.perf_counter()
        groups = rollout.generate(requests_for(task, rollout.tokenizer, step * prompts_per_step, prompts_per_step,
                                               group_size, max_tokens, prompt_pool))
        t_gen = time.perf_counter() - t0
        samples = samples_from_groups(groups)
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        adv = grpo.group_advantages(rewards, group_size=group_size)

        t0 = time.perf_counter()
        old = trainer.logprobs(samples)
        ref = trainer.logprobs(samples, model="reference") if trainer.kl_coef > 0 else None
        t_old = time.perf_counter() - t0

        t0 = time.perf_counter()
        norm = grpo.loss_normalizer([s.response_len for s in samples], trainer.loss_agg)
        grads, stats = [], []
        for a in range(0, len(samples), chunk_size):
            sl = slice(a, a + chunk_size)
            g = trainer.chunk_gradients(samples[sl], adv[sl], old[sl], ref[sl] if ref is not None else None,
                                        normalizer=norm)
            grads.append(g)
            stats.append(g.stats)
        upd = trainer.apply(grads)
        t_upd = time.perf_counter() - t0

        t0 = time.perf_counter()
        rollout.load_weights(trainer.state_dict(), version=upd["version"])
        t_sync = time.perf_counter() - t0

        rec = StepStats(step=step, version=upd["version"], reward_mean=float(rewards.mean()),
                        response_len_mean=float(np.mean([s.response_len for s in samples])),
                        loss=float(sum(s["loss"] for s in stats)), kl=grpo.token_weighted(stats, "kl"),
                        clip_frac=grpo.token_weighted(stats, "clip_frac"),
                        grad_norm=upd["grad_norm"], timing_gen=t_gen, timing_old_logprob=t_old,
                        timing_update=t_upd, timing_sync=t_sync, samples=len(samples),
                        tokens=int(sum(s.response_len + len(s.prompt_ids) for s in samples)))
        history.append(rec)
        if on_step is not None:
            on_step(rec)
    return history
