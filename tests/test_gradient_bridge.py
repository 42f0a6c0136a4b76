"""Auxiliary gradients once per window, shard to shard (issue #23, ``bidirl.cluster.engines.bridge``).

Integration test (``-m integration``): four processes. Ranks 0–1 are a primary gang (FSDP2 over gloo, one process
group), ranks 2–3 an auxiliary gang (its own group); a bridge group of all four joins them. A step has four
update chunks of two samples (one per rank): the primary gang accumulates chunks 0 and 3, the auxiliary gang a
window of k = 2 chunks (1 and 2) into its own sharded ``p.grad``; when the window ends each auxiliary rank sends
the primary rank holding the same shard exactly that shard — one transfer per rank pair — and the primary steps.
The same primary processes also run the no-borrow update (all four chunks on the primary gang, summed in chunk
order, the ordered-merge rule) on a second engine.

Tolerances (fp32, u = 2**-24), derived: the chunk gradients are the same computation on the same data in both
runs (same layout, one thread each), so the summed gradients differ only by the order of four additions:
(g0 + g3) + (g1 + g2) against ((g0 + g1) + g2) + g3, each within γ₃·Σ|gᵢ| of the exact sum (γ₃ = 3u/(1 − 3u),
Higham, *Accuracy and Stability*, §4.2), so ≤ 2·γ₃·Σ|gᵢ| apart per entry. The first AdamW step (no clipping, no
weight decay) moves a weight by lr·f(g), f(g) = g/(|g| + ε) (m̂ = g, v̂ = g²; Kingma & Ba Algorithm 1): where
|g| > δ the two f values differ by ≤ δ·ε/(|g| − δ + ε)² (f' = ε/(|g| + ε)²), elsewhere by ≤ 2; each side's own
AdamW arithmetic (a handful of roundings, ≤ 8u·lr) and the rounding of the new weight (u·|w|) come on top.
"""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch

pytestmark = pytest.mark.integration

CHUNKS = ((0, 2), (2, 4), (4, 6), (6, 8))
PRIMARY_CHUNKS, WINDOW = (0, 3), (1, 2)
LR = 1e-3
U = 2.0 ** -24
GAMMA3 = 3 * U / (1 - 3 * U)
EPS = 1e-8                          # AdamW's default ε, as the engine uses it


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(paths, timeout=600.0):
    deadline = time.time() + timeout
    while not all(os.path.exists(p) for p in paths):
        if time.time() > deadline:
            raise TimeoutError(f"peers did not write {paths}")
        time.sleep(0.05)


def _share(engine, samples, adv, a, b, rank):
    from bidirl.cluster.engines.trainer import rank_shares
    mine = rank_shares(list(range(a, b)), 1, 2)[rank]
    chunk = [samples[k] for k in mine]
    return chunk, adv[mine], engine.logprobs(chunk)


def _worker(proc, addrs, model_dir, out):
    from test_trainer_fsdp import _advantages, _samples

    from bidirl.cluster.engines.bridge import pair_ranks
    from bidirl.cluster.engines.trainer import TrainerEngine
    from bidirl.rl import grpo

    primary = proc < 2
    rank = proc if primary else proc - 2
    samples = _samples(model_dir)
    adv = _advantages(samples)
    norm = grpo.loss_normalizer([s.response_len for s in samples])
    kw = dict(lr=LR, seed=0, threads=1, max_grad_norm=None)
    eng = TrainerEngine(model_dir, role="primary" if primary else "auxiliary", **kw)
    eng.init_process_group(rank, 2, addrs["primary" if primary else "auxiliary"])
    torch.save(eng.shard_signature(), os.path.join(out, f"sig{proc}.pt"))
    _wait_for([os.path.join(out, f"sig{p}.pt") for p in range(4)])
    sigs = [torch.load(os.path.join(out, f"sig{p}.pt")) for p in range(4)]
    pairs = pair_ranks(sigs[:2], sigs[2:])                      # {aux rank: [primary ranks]}
    eng.join_bridge(proc, 4, addrs["bridge"])
    result = {"pairs": pairs}
    for c in (PRIMARY_CHUNKS if primary else WINDOW):
        eng.chunk_gradients(*_share(eng, samples, adv, *CHUNKS[c], rank), normalizer=norm, accumulate=True, chunk_id=c)
    if not primary:
        result["sent"] = eng.send_window([p for p in pairs.get(rank, [])], chunk_ids=WINDOW)
        result["bridge_sent"] = eng.bridge.sent
    else:
        src = next(a for a, ps in pairs.items() if rank in ps)
        result["received"] = eng.receive_window(2 + src, WINDOW)
        result["bridge_received"] = eng.bridge.received
        borrowed = torch.cat([p.grad.to_local().reshape(-1) for p in eng.params])
        result["accumulated"] = list(eng.accumulated)
        # the no-borrow update: the same primary gang computes every chunk, summed in chunk order
        ref = TrainerEngine(model_dir, **kw)
        ref.init_process_group(rank, 2, addrs["primary"])
        vectors = [ref.chunk_gradients(*_share(ref, samples, adv, a, b, rank), normalizer=norm).flat for a, b in CHUNKS]
        in_order = vectors[0].clone()
        for v in vectors[1:]:
            in_order += v
        delta = 2 * GAMMA3 * torch.stack(vectors).abs().sum(0)
        result["grad_excess"] = float(((borrowed - in_order).abs() - delta).max())
        result["grad_scale"] = float(in_order.abs().max())
        eng.apply()
        ref.apply(vectors)
        w = torch.cat([p.to_local().detach().reshape(-1) for p in eng.params])
        w_ref = torch.cat([p.to_local().detach().reshape(-1) for p in ref.params])
        g = in_order.abs()
        same_sign = g > delta
        df = torch.where(same_sign, delta * EPS / (g - delta + EPS).clamp_min(EPS) ** 2, torch.full_like(g, 2.0))
        bound = LR * (df.clamp_max(2.0) + 2 * 8 * U) + 2 * U * w_ref.abs()
        result["weight_excess"] = float(((w - w_ref).abs() - bound).max())
        result["weight_moved"] = float((w - w_ref).abs().max())
        ref.destroy_process_group()
    torch.save(result, os.path.join(out, f"result{proc}.pt"))
    eng.destroy_process_group()


def _spawn_entry(proc, addrs, model_dir, out, tests_dir):
    import sys
    sys.path.insert(0, tests_dir)
    _worker(proc, addrs, model_dir, out)


def test_auxiliary_window_merges_shard_to_shard_and_matches_no_borrow(model_dir, tmp_path):
    import torch.multiprocessing as mp
    addrs = {k: f"127.0.0.1:{_port()}" for k in ("primary", "auxiliary", "bridge")}
    mp.spawn(_spawn_entry, args=(addrs, str(model_dir), str(tmp_path), os.path.dirname(__file__)), nprocs=4,
             join=True)
    res = [torch.load(tmp_path / f"result{p}.pt") for p in range(4)]
    assert res[0]["pairs"] == {0: [0], 1: [1]}, "identical layouts pair rank i with rank i"
    for aux in res[2:]:
        assert aux["sent"]["chunks"] == list(WINDOW) and aux["sent"]["transfers"] == 1 == aux["bridge_sent"]
        assert aux["sent"]["bytes"] > 0
    for pri in res[:2]:
        assert pri["bridge_received"] == 1, "one transfer per rank pair and window"
        assert sorted(pri["accumulated"]) == [0, 1, 2, 3]
        assert pri["grad_scale"] > 0
        assert pri["grad_excess"] <= 0, "the merged gradient is the no-borrow gradient up to summation order"
        assert pri["weight_excess"] <= 0, "the update is the no-borrow update up to rounding"
