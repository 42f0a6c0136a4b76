"""Two runs of one job compared weight by weight, none exempt (``tests/rounding.py`` derives the bounds).

``rounding.exact_weights``: runs that execute the same arithmetic (the reproducible mode, on by default at s = 0:
every end-of-run comparison of the engine tests) are equal bit for bit; one chunk lost at step 1 is not.

``rounding.same_step``: runs whose arithmetic differs (chunks summed in another order) compared one step from one
state — each step taken by a second engine from the first one's weights and AdamW state — hold every weight within
the bound of one step from that state (``rounding.adamw_step_gap``); a chunk lost, doubled or of other samples at
step 1 puts nearly every weight beyond it by orders of magnitude. A property test holds torch's own AdamW (clipped
or not, gradients within δ, some exactly zero or within rounding of it) to the bound.
"""

from __future__ import annotations

import copy

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
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
        chunks, other = _step_chunks(engine, step)
        engine.apply([c.flat for c in plan(step, chunks, other)])
    return engine.state_dict()


def _step_chunks(engine, step: int) -> tuple:
    """Step ``step``'s chunk gradients on ``engine`` (CHUNKS equal chunks of its seeded samples, in order), and one
    chunk of other samples (a foreign chunk) of the same size and normalizer."""
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
    return chunks, other


@pytest.fixture(scope="module")
def in_order(model_dir):
    return _train(model_dir, lambda step, chunks, other: chunks)


@pytest.mark.parametrize("wrong", ["lost", "doubled", "foreign"])
def test_the_same_sums_in_the_same_order_are_equal_bit_for_bit_and_a_wrong_chunk_is_not(model_dir, in_order, wrong):
    """``rounding.exact_weights``, the check of the reproducible mode's end-of-run comparisons (bound 0 for every
    weight): a second run adding the same chunks in the same order is equal in every bit; one chunk lost, doubled or
    of other samples at step 1 changes most tensors."""
    assert rounding.exact_weights(in_order, _train(model_dir, lambda step, chunks, other: chunks)) == []

    def plan(step, chunks, other):
        if step != 1:                             # the fault lands mid-run, as a chaos kill does
            return chunks
        return {"lost": chunks[:2] + chunks[3:], "doubled": chunks + [chunks[1]],
                "foreign": chunks[:2] + [other] + chunks[3:]}[wrong]
    assert len(rounding.exact_weights(in_order, _train(model_dir, plan))) > len(in_order) // 2


# --------------------------------------------------------------------------------------------------------------
# One step from one state, weight by weight (rounding.same_step): no weight exempt
# --------------------------------------------------------------------------------------------------------------

def _flat_state(engine) -> tuple:
    """``{name: weights}``, and the AdamW moments and step count in parameter order (zeros before the first)."""
    names = [n for n, _ in engine.model.named_parameters()]
    weights = {n: p.detach().clone() for n, p in zip(names, engine.params)}
    moments = []
    for p in engine.params:
        s = engine.optimizer.state.get(p, {})
        moments.append((s.get("exp_avg", torch.zeros_like(p)).detach().clone(),
                        s.get("exp_avg_sq", torch.zeros_like(p)).detach().clone(), int(s.get("step", 0))))
    return weights, moments


#: the second engine's chunks per step (``step, chunks, extra``: the in-order chunks and one of other samples)
PLANS = {"reordered": lambda step, c, x: [c[i] for i in (2, 0, 3, 1)],
         # each fault lands mid-run (step 1), as a chaos kill does
         "lost": lambda step, c, x: c if step != 1 else c[:2] + c[3:],
         "doubled": lambda step, c, x: c if step != 1 else c + [c[1]],
         "foreign": lambda step, c, x: c if step != 1 else c[:2] + [x] + c[3:]}


@pytest.fixture(scope="module")
def one_state_gaps(model_dir) -> dict:
    """Three steps of ``_train``'s job. Before each, for every plan of :data:`PLANS`, a second engine takes the
    first one's weights and AdamW state and applies the plan's chunks; the first applies them in order; the two
    are compared weight by weight against the bound of one step from that state (``rounding.adamw_step_gap``,
    the in-order chunks' summation gap). Returns ``{plan: [rounding.StepGap per step]}``."""
    from bidirl.cluster.engines.workers.trainer import TrainerEngine
    ref, other = TrainerEngine(model_dir, lr=LR, seed=0), TrainerEngine(model_dir, lr=LR, seed=0)
    gaps = {name: [] for name in PLANS}
    for step in range(STEPS):
        step_chunks, foreign = _step_chunks(ref, step)
        chunks, extra = [c.flat for c in step_chunks], foreign.flat
        weights, optimizer = ref.state_dict(), copy.deepcopy(ref.optimizer.state_dict())
        _, moments = _flat_state(ref)
        ref.apply(list(chunks))
        after, _ = _flat_state(ref)
        grad, gap = sum(chunks[1:], chunks[0].clone()), rounding.summation_gap(chunks)
        bound, offset = {}, 0
        for (name, w), (m, v, t) in zip(after.items(), moments):
            n = w.numel()
            bound[name] = rounding.adamw_step_gap(grad[offset:offset + n], gap[offset:offset + n], m.reshape(-1),
                                                  v.reshape(-1), t + 1, w.reshape(-1), LR, ref.betas,
                                                  max_grad_norm=ref.max_grad_norm).view(w.shape)
            offset += n
        for name, plan in PLANS.items():
            other.load_state_dict(weights)
            other.optimizer.load_state_dict(copy.deepcopy(optimizer))     # no moment shared with ref's
            other.apply(plan(step, chunks, extra))
            gaps[name].append(rounding.same_step(after, _flat_state(other)[0], bound))
    return gaps


def test_one_step_from_one_state_holds_every_weight_within_its_bound(model_dir, one_state_gaps):
    from bidirl.cluster.engines.workers.trainer import TrainerEngine
    numel = TrainerEngine(model_dir).numel
    for step, gap in enumerate(one_state_gaps["reordered"]):
        assert gap.ok, (step, str(gap))
        assert gap.compared == numel             # every weight compared: none exempt


@pytest.mark.parametrize("wrong", ["lost", "doubled", "foreign"])
def test_one_step_with_a_lost_doubled_or_foreign_chunk_is_beyond_the_bound(one_state_gaps, wrong):
    gaps = one_state_gaps[wrong]
    assert gaps[0].ok and gaps[2].ok, [str(g) for g in gaps]        # the other steps start from the same state
    # by a wide margin: a wrong chunk moves most weights far beyond what rounding can
    assert not gaps[1].ok and gaps[1].over > 0.1 * gaps[1].compared and gaps[1].worst > 1e3, str(gaps[1])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step=st.integers(1, 50), scale=st.floats(1e-9, 1e2), rel=st.floats(0.0, 1e-3), seed=st.integers(0, 2**16),
       clip=st.sampled_from([None, 1.0, 1e-3]))
def test_the_step_bound_holds_torchs_adamw_on_gradients_within_delta(step, scale, rel, seed, clip):
    """``rounding.adamw_step_gap`` against torch's AdamW itself: one state (moments of ``step − 1`` steps of a
    gradient's scale), two gradients within δ of each other (noise of relative ``rel``, a few exact zeros and
    elements within δ of zero among them), both clipped and stepped in fp32; every weight within its bound."""
    gen = torch.Generator().manual_seed(seed)
    n = 4096
    g = torch.randn(n, generator=gen) * scale
    g[:8] = 0.0
    g[8:16] = scale * rel * torch.randn(8, generator=gen)
    delta = (g.abs() * rel).double() + scale * 1e-7
    g2 = g + (torch.rand(n, generator=gen) * 2 - 1) * delta.float() * 0.999
    m = torch.randn(n, generator=gen) * scale * 0.5
    v = (torch.randn(n, generator=gen) * scale) ** 2 * (1 - 0.999 ** (step - 1))
    w0 = torch.randn(n, generator=gen)
    out = []
    for grad in (g, g2):
        p = torch.nn.Parameter(w0.clone())
        opt = torch.optim.AdamW([p], lr=LR, weight_decay=0.0)
        if step > 1:
            opt.state[p] = {"step": torch.tensor(float(step - 1)), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
        p.grad = grad.clone()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([p], clip)
        opt.step()
        out.append(p.detach())
    bound = rounding.adamw_step_gap(g, delta, m if step > 1 else torch.zeros(n), v if step > 1 else torch.zeros(n),
                                    step, out[0], LR, max_grad_norm=clip)
    gap = rounding.same_step({"w": out[0]}, {"w": out[1]}, {"w": bound})
    assert gap.ok, str(gap)
