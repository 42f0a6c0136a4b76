"""The vectorised position-keyed sampler against a plain per-row reference of the same keyed draw.

The reference below is written from the draw's definition (``bidirl.cluster.engines.workers.sampler``'s module
docstring) with Python integers — SplitMix64 step by step, one token at a time, the full output including its
final xor-shift — and torch only for the fp32 ``−log(−log u)`` and the argmax of one row. The sampler must pick
exactly the reference's token for every row (whole batch, subsets of rows, several blocks of rows, temperatures),
leave rows without a seed untouched, and compute the same keys as :func:`position_seed`. The properties the
draw is for (softmax sampling, rows that follow vLLM's reordering, resume invariance in the engine) are tested
in ``tests/test_engines.py``. Unit tests: no engine is started (vLLM is imported for its processor interface).
"""

from __future__ import annotations

import importlib.util
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="the sampler is a vLLM logits processor (pip install -e .[cpu])")

MASK = 2**64 - 1


def ref_key(seed: int, position: int) -> int:
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) % 2**64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 % 2**64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB % 2**64
    return (z ^ (z >> 31)) % 2**63


def ref_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    """Gumbel noise of one position, one token at a time: the v-th SplitMix64 output after the key."""
    key, u = ref_key(seed, position), []
    for v in range(vocab):
        z = (key + (v + 1) * 0x9E3779B97F4A7C15) % 2**64
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 % 2**64
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB % 2**64
        z = z ^ (z >> 31)
        u.append(((z >> 41) + 0.5) / 2**23)            # the top 23 bits; exact in fp32
    return -torch.log(-torch.log(torch.tensor(u, dtype=torch.float32)))


def ref_token(logits_row: torch.Tensor, seed: int, position: int, temperature: float) -> int:
    return int(torch.argmax(logits_row / temperature + ref_noise(seed, position, logits_row.shape[0])))


def _sampler():
    from bidirl.cluster.engines.workers.sampler import PositionKeyedSampler
    return PositionKeyedSampler(None, torch.device("cpu"), False)


def _params(seed=None, temperature=None):
    from bidirl.cluster.engines.workers.sampler import SEED_KEY, TEMPERATURE_KEY
    if seed is None:
        return SimpleNamespace(extra_args=None)
    extra = {SEED_KEY: seed}
    if temperature is not None:
        extra[TEMPERATURE_KEY] = temperature
    return SimpleNamespace(extra_args=extra)


def _batch(rows, seeds, temps, rng):
    """A BatchUpdate adding one request per row (prompt and output lengths drawn from ``rng``)."""
    from vllm.v1.sample.logits_processor import BatchUpdate
    added, where = [], {}
    for row, seed, temp in zip(rows, seeds, temps):
        prompt = [0] * rng.randint(1, 40)
        output = [0] * rng.randint(0, 60)
        added.append((row, _params(seed, temp), prompt, output))
        where[row] = len(prompt) + len(output)
    return BatchUpdate(max(rows) + 1, removed=[], moved=[], added=added), where


def test_vectorised_keys_match_position_seed_and_the_reference():
    from bidirl.cluster.engines.workers.sampler import position_seed, position_seeds

    rng = random.Random(0)
    seeds = [0, 1, 2**31 - 1, 2**63 - 1, 2**63 + 5, 2**64 - 1] + [rng.randrange(2**64) for _ in range(200)]
    positions = [rng.randrange(100_000) for _ in seeds]
    keys = position_seeds(np.array(seeds, dtype=np.uint64), positions)
    assert keys.dtype == np.int64 and (keys >= 0).all()
    assert keys.tolist() == [position_seed(s, p) for s, p in zip(seeds, positions)]
    assert keys.tolist() == [ref_key(s, p) for s, p in zip(seeds, positions)]
    with pytest.raises(ValueError, match="seeds and positions"):
        position_seeds(np.zeros(3, dtype=np.uint64), [1, 2])


def test_noise_of_a_position_is_the_reference_noise():
    from bidirl.cluster.engines.workers.sampler import gumbel_noise

    for seed, position in ((0, 0), (7, 123), (2**40 + 3, 9)):
        got, want = gumbel_noise(seed, position, 700, "cpu"), ref_noise(seed, position, 700)
        # the uniforms are bit-identical; −log(−log u) is fp32 log twice, vectorised here and possibly scalar
        # in the reference (≤ 1 ulp each): |ΔG| ≤ ulp(E)/E + ulp(G) ≤ 2^-23 + ulp(16.7) = 2^-23 + 2^-19 < 2^-18
        torch.testing.assert_close(got, want, atol=2.0**-18, rtol=0)
        assert torch.isfinite(got).all()


@pytest.mark.parametrize("layout", ["all rows", "some rows unseeded", "a later block of rows"])
def test_sampler_picks_the_reference_token_for_every_row(layout):
    rng = random.Random({"all rows": 1, "some rows unseeded": 2, "a later block of rows": 3}[layout])
    torch.manual_seed(rng.randrange(2**31))
    n_rows, vocab = 48, 333
    # logits of an LM's scale (a few nats apart), so the noise decides among several tokens per row
    logits = torch.randn(n_rows, vocab) * 3.0
    if layout == "all rows":
        rows = list(range(n_rows))
    elif layout == "some rows unseeded":
        rows = sorted(rng.sample(range(n_rows), 30))
    else:
        rows = list(range(16, n_rows))
    seeds = [rng.randrange(2**32) for _ in rows]
    temps = [rng.choice([None, 1.0, 0.7, 1.3, 0.25]) for _ in rows]
    proc = _sampler()
    update, position = _batch(rows, seeds, temps, rng)
    unseeded = [r for r in range(n_rows) if r not in rows]
    if unseeded:      # rows of requests without a seed: in the batch, left to vLLM
        from vllm.v1.sample.logits_processor import BatchUpdate
        update = BatchUpdate(n_rows, removed=[], moved=[],
                             added=list(update.added) + [(r, _params(), [1], []) for r in unseeded])
    proc.update_state(update)
    out = proc.apply(logits.clone())
    for row, seed, temp in zip(rows, seeds, temps):
        token = ref_token(logits[row], seed, position[row], 1.0 if temp is None else temp)
        assert torch.isinf(out[row]).sum() == vocab - 1 and out[row, token] == 0.0, (row, token)
    for row in unseeded:
        assert torch.equal(out[row], logits[row])


def test_blocks_of_rows_give_the_tokens_of_one_block():
    from bidirl.cluster.engines.workers.sampler import keyed_argmax, position_seeds

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(37, 256, generator=g) * 2.0
    keys = torch.from_numpy(position_seeds(np.arange(37, dtype=np.uint64) * 1000, np.arange(37) + 5))
    temps = torch.rand(37, generator=g) + 0.5
    whole = keyed_argmax(logits, keys, temps, block_elements=37 * 256)
    for block in (1, 5 * 256, 256 * 36 + 17):            # one row, five rows, a block that does not fill a row
        assert torch.equal(keyed_argmax(logits, keys, temps, block_elements=block), whole)
    expected = [ref_token(logits[i], i * 1000, i + 5, float(temps[i])) for i in range(37)]
    assert whole.tolist() == expected
    rows = torch.tensor([3, 0, 9])
    assert keyed_argmax(logits, keys[:3], temps[:3], rows=rows).tolist() == [
        ref_token(logits[r], i * 1000, i + 5, float(temps[i])) for i, r in enumerate(rows.tolist())]


def test_position_moves_with_the_live_output_list():
    """Each step the key uses len(prompt) + len(output so far); nothing else changes between steps."""
    from vllm.v1.sample.logits_processor import BatchUpdate

    proc = _sampler()
    outs = [[], [5, 5]]
    proc.update_state(BatchUpdate(2, removed=[], moved=[], added=[(0, _params(11), [1, 2, 3], outs[0]),
                                                                     (1, _params(12, 0.5), [1], outs[1])]))
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(5))
    for step in range(4):
        picked = proc.apply(logits.clone()).argmax(dim=1).tolist()
        assert picked == [ref_token(logits[0], 11, 3 + step, 1.0), ref_token(logits[1], 12, 3 + step, 0.5)]
        for o, t in zip(outs, picked):
            o.append(t)


def test_bad_sampling_params_name_the_field():
    from bidirl.cluster.engines.workers.sampler import SEED_KEY, TEMPERATURE_KEY, PositionKeyedSampler

    for bad in (-1, 2**64, 1.5, True, "3"):
        with pytest.raises(ValueError, match=SEED_KEY):
            PositionKeyedSampler.validate_params(_params(bad))
    for bad in (0.0, -1.0, float("nan"), float("inf"), "1", None):
        with pytest.raises(ValueError, match=TEMPERATURE_KEY):
            PositionKeyedSampler.validate_params(SimpleNamespace(extra_args={SEED_KEY: 3, TEMPERATURE_KEY: bad}))
    PositionKeyedSampler.validate_params(_params(2**64 - 1, 2))
    PositionKeyedSampler.validate_params(_params())


def test_keyed_argmax_rejects_mismatched_inputs():
    from bidirl.cluster.engines.workers.sampler import keyed_argmax

    logits, keys = torch.zeros(4, 8), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="keys"):
        keyed_argmax(logits, keys.int())
    with pytest.raises(ValueError, match="logits"):
        keyed_argmax(logits[0], keys)
    with pytest.raises(ValueError, match="temperatures"):
        keyed_argmax(logits, keys, torch.ones(3))
    with pytest.raises(ValueError, match="rows"):
        keyed_argmax(logits, keys, rows=torch.arange(3))
    with pytest.raises(ValueError, match="5 keys for 4 logits rows"):
        keyed_argmax(logits, torch.zeros(5, dtype=torch.int64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_draws_the_cpu_tokens_without_a_host_sync():
    from vllm.v1.sample.logits_processor import BatchUpdate

    from bidirl.cluster.engines.workers.sampler import PositionKeyedSampler, gumbel_noise

    # uniforms are bit-identical; G differs by the two devices' fp32 log accuracy (same bound as above)
    torch.testing.assert_close(gumbel_noise(3, 9, 4096, "cuda").cpu(), gumbel_noise(3, 9, 4096, "cpu"),
                               atol=2.0**-18, rtol=0)
    logits = torch.randn(64, 4096, generator=torch.Generator().manual_seed(6)) * 3.0
    picks = {}
    for device in ("cpu", "cuda"):
        proc = PositionKeyedSampler(None, torch.device(device), device == "cuda")
        proc.update_state(BatchUpdate(64, removed=[], moved=[], added=[
            (r, _params(1000 + r, 0.8), [0] * (r % 7 + 1), [0] * (r % 5)) for r in range(64)]))
        x = logits.to(device)
        proc.apply(x.clone())                     # first call: lanes and pinned staging allocated
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            picks[device] = proc.apply(x).argmax(dim=1)
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(picks["cuda"].cpu(), picks["cpu"])
