"""The step's gradient summed in unit order (issue 42; ``trainer/ordered_sum.py``): the same weights bit for bit
whichever engine computed each chunk and in whatever order the chunks arrived — and, as the guard, not so when
chunks add in the order they finish (the path without positions), so the equality below is not vacuous.

Exact equality is the claim (fp32 addition is deterministic; only its order can change a sum), so no tolerance."""

from __future__ import annotations

import pytest
import torch

from bidirl.rl import grpo

from test_trainer_device_paths import _engine, _samples

CUTS = ((0, 3), (3, 5), (5, 8), (8, 12))          # four chunks of the step's 12 samples: (first unit, end)


@pytest.fixture(scope="module")
def step(model_dir):
    samples = _samples(model_dir, 12)
    adv = grpo.group_advantages([s.reward for s in samples], group_size=2).float()
    norm = grpo.loss_normalizer([s.response_len for s in samples])
    old = _engine(model_dir).logprobs(samples)
    return samples, adv, old, norm


def _chunk(engine, step, k, position=True, **kw):
    samples, adv, old, norm = step
    x, y = CUTS[k]
    return engine.chunk_gradients(samples[x:y], adv[x:y], old[x:y], normalizer=norm, accumulate=True, chunk_id=k,
                                  position=(x, y - x) if position else None, **kw)


def _weights(engine) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in engine.params])


def test_in_order_out_of_order_and_borrowed_chunks_give_the_same_weights_bit_for_bit(model_dir, step):
    from bidirl.core.protocol import AUXILIARY
    straight = _engine(model_dir)
    for k in range(4):
        _chunk(straight, step, k)
    assert straight.order.upto == 12 and not straight.order.held
    straight.apply()

    shuffled = _engine(model_dir)              # chunks 2, 3 arrive before 1: held, then added in order
    for k in (0, 2, 3, 1):
        _chunk(shuffled, step, k)
    assert shuffled.order.peak == 2 and shuffled.order.upto == 12
    shuffled.apply()
    assert torch.equal(_weights(shuffled), _weights(straight))

    # chunks 1 and 3 computed by an auxiliary engine, handed over as a window of chunks kept apart
    primary, aux = _engine(model_dir), _engine(model_dir, role=AUXILIARY)
    for k in (1, 3):
        _chunk(aux, step, k)
    pieces = aux.order.pieces()
    assert [first for first, *_ in pieces] == [3, 8] and all(p.grad is None for p in aux.params)
    for k in (0, 2):
        _chunk(primary, step, k)
    primary.windows["w"] = [(first, units, cid, flat) for first, units, cid, flat in pieces]
    primary.apply(windows={"w": [1, 3]})
    assert torch.equal(_weights(primary), _weights(straight))


def test_without_positions_the_finish_order_changes_the_bits(model_dir, step):
    """The guard: the same four chunks added in the order 3, 2, 1, 0 (finish order, no positions) differ from the
    in-order sum in the last bits — the 1e-6 drift of an s = 0 resume."""
    a, b = _engine(model_dir), _engine(model_dir)
    for k in range(4):
        _chunk(a, step, k, position=False)
    for k in (3, 2, 1, 0):
        _chunk(b, step, k, position=False)
    ga = torch.cat([p.grad.reshape(-1) for p in a.params])
    gb = torch.cat([p.grad.reshape(-1) for p in b.params])
    assert not torch.equal(ga, gb)


def test_a_chunk_twice_or_a_gap_is_refused(model_dir, step):
    e = _engine(model_dir)
    _chunk(e, step, 0)
    _chunk(e, step, 2)
    with pytest.raises(RuntimeError, match="counts once"):
        e.order.hold(5, 3, None, 9)
    with pytest.raises(RuntimeError, match="gap before unit"):
        e.apply()
