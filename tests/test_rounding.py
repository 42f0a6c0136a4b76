"""``rounding.same_weights`` tells rounding from a wrong gradient: the check every recovery, borrowing and gang
test uses to say "two runs of one job ended at the same weights" (``tests/rounding.py`` derives its bounds).

On the tiny model with the unsharded trainer (no Ray): three GRPO steps of four update chunks each, applied in
chunk order and in another order, pass; the same steps with one chunk lost, one doubled or one trained on other
samples fail — each by a wide margin, so the check can fail and does for what it is there to catch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import rounding
from bidirl.rl import grpo
from bidirl.rl.samples import Sample
from bidirl.rl.tasks import ArithmeticTask

LR, STEPS, CHUNKS = 1e-3, 3, 4


def _samples(n: int, seed: int) -> list:
    """``n`` responses to the arithmetic task, half right and half wrong (rewards 1 and 0), groups of two."""
    from bidirl.rl import tiny_model
    tok = tiny_model.build_tokenizer()
    rng = np.random.default_rng(seed)
    out = []
    for i, p in enumerate(ArithmeticTask(seed=seed).prompts(n)):
        answer = p.answer if i % 2 == 0 else str(int(p.answer) + 1 + int(rng.integers(5)))
        out.append(Sample(i // 2, i % 2, tuple(tok(p.text)["input_ids"]), tuple(tok(answer)["input_ids"]), (),
                          float(i % 2 == 0), 0))
    return out


def _train(model_dir, plan) -> dict:
    """Three steps; ``plan(step, chunks)`` returns the chunk gradients to apply, in the order to add them."""
    from bidirl.cluster.engines.workers.trainer import TrainerEngine
    engine = TrainerEngine(model_dir, lr=LR, seed=0)
    for step in range(STEPS):
        samples = _samples(4 * CHUNKS, seed=step)
        adv = grpo.group_advantages([s.reward for s in samples], group_size=2).float()
        old = engine.logprobs(samples)
        norm = grpo.loss_normalizer([s.response_len for s in samples])
        size = len(samples) // CHUNKS
        chunks = [engine.chunk_gradients(samples[i:i + size], adv[i:i + size], old[i:i + size], normalizer=norm)
                  for i in range(0, len(samples), size)]
        foreign = _samples(size, seed=100 + step)
        other = engine.chunk_gradients(foreign, grpo.group_advantages([s.reward for s in foreign], 2).float(),
                                       engine.logprobs(foreign), normalizer=norm)
        engine.apply([c.flat for c in plan(step, chunks, other)])
    return engine.state_dict()


@pytest.fixture(scope="module")
def in_order(model_dir):
    return _train(model_dir, lambda step, chunks, other: chunks)


def test_chunks_summed_in_another_order_are_the_same_weights(model_dir, in_order):
    reordered = _train(model_dir, lambda step, chunks, other: [chunks[i] for i in (2, 0, 3, 1)])
    gap = rounding.same_weights(in_order, reordered, LR, STEPS)
    assert gap.ok, str(gap)


@pytest.mark.parametrize("wrong", ["lost", "doubled", "foreign"])
def test_a_lost_doubled_or_foreign_chunk_is_not(model_dir, in_order, wrong):
    def plan(step, chunks, other):
        if step != 1:                             # the fault lands mid-run, as a chaos kill does
            return chunks
        return {"lost": chunks[:2] + chunks[3:], "doubled": chunks + [chunks[1]],
                "foreign": chunks[:2] + [other] + chunks[3:]}[wrong]
    gap = rounding.same_weights(in_order, _train(model_dir, plan), LR, STEPS)
    assert not gap.ok, str(gap)
    # by a wide margin: a wrong chunk moves a sizeable share of the weights, not a few more than rounding does
    assert gap.moved > 5 * gap.moved_bound, str(gap)
