"""Auxiliary gradients once per window, shard to shard (issue #23, ``bidirl.cluster.engines.workers.bridge``).

Integration test (``-m integration``): four processes. Ranks 0–1 are a primary gang (FSDP2 over gloo, one process
group), ranks 2–3 an auxiliary gang (its own group). A step has four update chunks of two samples (one per rank):
the primary gang accumulates chunks 0 and 3, the auxiliary gang a window of k = 2 chunks (1 and 2) into its own
sharded ``p.grad``; when the window ends each auxiliary rank sends the primary rank holding the same shard exactly
that shard — one transfer per rank pair, over a rendezvous this test opens as the engine driver does, in buckets
smaller than the shard — and the primary steps. The same primary processes also run the no-borrow update (all
four chunks on the primary gang, summed in chunk order, the ordered-merge rule) on a second engine.

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
import time

import pytest
import torch

from gang_rendezvous import join_gang, listening_store

pytestmark = pytest.mark.integration

CHUNKS = ((0, 2), (2, 4), (4, 6), (6, 8))
PRIMARY_CHUNKS, WINDOW = (0, 3), (1, 2)
LR = 1e-3
U = 2.0 ** -24
GAMMA3 = 3 * U / (1 - 3 * U)
EPS = 1e-8                          # AdamW's default ε, as the engine uses it
BUCKET_BYTES = 64 * 1024            # far below a rank's shard (≈ 0.8 MB of the tiny model): several buckets


def _wait_for(paths, timeout=600.0):
    deadline = time.time() + timeout
    while not all(os.path.exists(p) for p in paths):
        if time.time() > deadline:
            raise TimeoutError(f"peers did not write {paths}")
        time.sleep(0.05)


def _save(obj, path) -> None:
    """Write ``path`` whole or not at all (a peer polls for it and reads it as soon as it exists)."""
    tmp = f"{path}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _share(engine, samples, adv, a, b, rank):
    from bidirl.cluster.engines.workers.trainer import rank_shares
    mine = rank_shares(list(range(a, b)), 1, 2)[rank]
    chunk = [samples[k] for k in mine]
    return chunk, adv[mine], engine.logprobs(chunk)


def _worker(proc, addrs, model_dir, out):
    from test_trainer_fsdp import _advantages, _samples

    from bidirl.cluster.engines.workers.trainer import TrainerEngine
    from bidirl.rl import grpo

    primary = proc < 2
    rank = proc if primary else proc - 2
    samples = _samples(model_dir)
    adv = _advantages(samples)
    norm = grpo.loss_normalizer([s.response_len for s in samples])
    kw = dict(lr=LR, seed=0, threads=1, max_grad_norm=None)
    eng = TrainerEngine(model_dir, role="primary" if primary else "auxiliary", **kw)
    addr = addrs["primary" if primary else "auxiliary"]
    join_gang(rank, 2, addr)                      # this gang's group: both engines of a primary rank take it
    eng.init_process_group(rank, 2, addr)
    _save(eng.shard_signature(), os.path.join(out, f"sig{proc}.pt"))
    _wait_for([os.path.join(out, "transfers.pt")])             # the driver's part: pairs and transfers
    plan = torch.load(os.path.join(out, "transfers.pt"), weights_only=False)
    result = {"pairs": plan["pairs"]}
    for c in (PRIMARY_CHUNKS if primary else WINDOW):
        eng.chunk_gradients(*_share(eng, samples, adv, *CHUNKS[c], rank), normalizer=norm, accumulate=True, chunk_id=c)
    if not primary:
        result["sent"] = eng.send_window(plan["transfers"][rank], chunk_ids=WINDOW)
        result["left"] = [p.grad for p in eng.params if p.grad is not None]
    else:
        src = next(a for a, ps in plan["pairs"].items() if rank in ps)
        transfer = plan["transfers"][src]
        result["received"] = eng.receive_window(transfer, transfer.rank_of(f"primary/{rank}"))
        result["accumulated"] = list(eng.accumulated)
        own = torch.cat([p.grad.to_local().reshape(-1) for p in eng.params])
        borrowed = own + eng.windows[transfer.tid]              # what apply sums
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
        result["applied"] = eng.apply(windows={transfer.tid: list(WINDOW)})
        ref.apply(vectors)
        w = torch.cat([p.to_local().detach().reshape(-1) for p in eng.params])
        w_ref = torch.cat([p.to_local().detach().reshape(-1) for p in ref.params])
        g = in_order.abs()
        same_sign = g > delta
        df = torch.where(same_sign, delta * EPS / (g - delta + EPS).clamp_min(EPS) ** 2, torch.full_like(g, 2.0))
        bound = LR * (df.clamp_max(2.0) + 2 * 8 * U) + 2 * U * w_ref.abs()
        result["weight_excess"] = float(((w - w_ref).abs() - bound).max())
        result["weight_moved"] = float((w - w_ref).abs().max())
        result["windows_left"] = len(eng.windows)
        ref.destroy_process_group()
    torch.save(result, os.path.join(out, f"result{proc}.pt"))
    eng.destroy_process_group()


def _spawn_entry(proc, addrs, model_dir, out, tests_dir):
    import sys
    sys.path.insert(0, tests_dir)
    _worker(proc, addrs, model_dir, out)


def test_auxiliary_window_merges_shard_to_shard_and_matches_no_borrow(model_dir, tmp_path):
    import math

    import torch.multiprocessing as mp

    from bidirl.cluster.engines.workers.bridge import pair_ranks, window_layout
    from bidirl.cluster.engines.workers.weight_transport import Rendezvous

    with listening_store() as primary, listening_store() as auxiliary:      # each gang's store, listening here
        addrs = {"primary": primary, "auxiliary": auxiliary}
        procs = mp.spawn(_spawn_entry, args=(addrs, str(model_dir), str(tmp_path), os.path.dirname(__file__)),
                         nprocs=4, join=False)
        # the engine driver's part: pair the ranks from their shard signatures, open one transfer per auxiliary rank
        _wait_for([tmp_path / f"sig{p}.pt" for p in range(4)])
        sigs = [torch.load(tmp_path / f"sig{p}.pt") for p in range(4)]
        pairs = pair_ranks(sigs[:2], sigs[2:])                     # {aux rank: [primary ranks]}
        rendezvous = Rendezvous("127.0.0.1")
        numel = [sum(math.prod(shape) for _, shape in sig) for sig in sigs[2:]]
        transfers = {a: rendezvous.open([f"primary/{p}" for p in dsts], 0, window_layout(numel[a], BUCKET_BYTES),
                                        120.0)
                     for a, dsts in pairs.items()}
        _save({"pairs": pairs, "transfers": transfers}, tmp_path / "transfers.pt")
        while not procs.join():
            pass
        rendezvous.close_all()
    res = [torch.load(tmp_path / f"result{p}.pt", weights_only=False) for p in range(4)]
    assert pairs == {0: [0], 1: [1]}, "identical layouts pair rank i with rank i"
    assert all(len(t.layout.buckets) > 1 for t in transfers.values()), "the shard travels in several buckets"
    for a, aux in zip(range(2), res[2:]):
        sent = aux["sent"]
        assert sent["chunks"] == list(WINDOW) and sent["served"] == 1 and sent["failed"] == {}, sent
        assert sent["bytes"] == 4 * numel[a], "the shard once, to its one primary rank"
        assert aux["left"] == [], "the window is forgotten once sent"
    for p, pri in zip(range(2), res[:2]):
        assert pri["received"]["bytes"] == 4 * numel[p] and pri["received"]["buckets"] == len(transfers[p].layout.buckets)
        assert sorted(pri["accumulated"]) == list(PRIMARY_CHUNKS)
        assert pri["applied"]["chunks"] == 4 and pri["windows_left"] == 0
        assert pri["grad_scale"] > 0
        assert pri["grad_excess"] <= 0, "the merged gradient is the no-borrow gradient up to summation order"
        assert pri["weight_excess"] <= 0, "the update is the no-borrow update up to rounding"
