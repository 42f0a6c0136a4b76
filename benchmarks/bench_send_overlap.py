"""A weight send beside a chunk under one launch order per rank (issue #38; paper §6.2,
:mod:`bidirl.cluster.engines.workers.launch_order`).

A two-rank FSDP2 trainer gang (gloo) and one receiving trainer, each a process of its own with one thread of
compute. Three phases, ``reps`` times each, medians:

* ``chunk_s`` — one chunk's forward and backward on the gang (``chunk_gradients(accumulate=True)``), alone;
* ``send_s`` — one transfer of the published weights to the receiver (``send_weights`` on a thread of its own, as
  the actor's ``transport`` thread runs it; the receiver's ``receive_weights``), alone;
* ``both_s`` — the send started as the chunk starts, on its own thread; the time until both are done.

``hidden`` = (chunk_s + send_s − both_s) / min(chunk_s, send_s): the share of the shorter one hidden by the
overlap (1: fully overlapped, 0: serialised). ``gathers_inside_chunk`` is the share of the send's transport turns
(its check, broadcast and bucket gathers) that rank 0's launch order granted between two blocks of the chunk —
the gathers do not wait for the chunk to end. ``turns_per_chunk`` counts the main turns a chunk took (its yield
points) and ``chunk_turn_overhead_s`` what they cost (``chunk_s`` with the order minus without it, in the same
processes: the second group's rank order is the only difference); ``turn_s`` is one turn's cost alone (a main
turn's yield point with nothing between, the slower rank's: the follower's, whose blocking read waits for the
leader's store write, then deletes the entry).

Gloo on CPU: the order is the same logic as on NCCL, but the figures are a CPU's (no two GPUs were available; the
NCCL launch path, where gathers run on the GPU's own streams, is unmeasured).
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path

SIZES = {True: "tiny", False: "small"}
BUCKET_BYTES = 256 * 1024            # many buckets, so the send has many gathers that can slip between blocks
TURNS = 200                          # empty turns timed for the cost of one


def _worker(rank: int, world: int, addr: str, md: str, transfers: list, reps: int, barrier, out: str) -> None:
    import torch

    from benchmarks.bench_trainer_scale import _samples
    from bidirl.cluster.engines.workers.trainer import TrainerEngine
    from bidirl.rl import grpo

    torch.set_num_threads(1)
    gang = rank < 2
    engine = TrainerEngine(md, lr=1e-4, seed=0, threads=1, gang=gang)
    if gang:
        engine.init_process_group(rank, 2, addr)
        engine.publish(0, "float32")
        samples = _samples(8, 32, 32, engine.config.vocab_size, 0)[rank * 4:(rank + 1) * 4]
        adv = grpo.group_advantages([s.reward for s in samples], group_size=2).float()
        old = engine.logprobs(samples)

    def chunk():
        engine.chunk_gradients(samples, adv, old, normalizer=512.0, accumulate=True, chunk_id=0)
        engine.discard_gradients()

    def send(transfer):
        box = {}
        thread = threading.Thread(target=lambda: box.update(engine.send_weights(transfer)))
        thread.start()
        return thread, box

    times = {"chunk": [], "unordered": [], "send": [], "both": [], "inside": [], "turns": []}
    chunk() if gang else None                      # warm-up: first-call allocations
    for rep in range(reps):
        for phase, transfer in (("chunk", None), ("unordered", None), ("send", transfers[2 * rep]),
                                ("both", transfers[2 * rep + 1])):
            barrier.wait()
            if not gang:
                if transfer is not None:
                    engine.receive_weights(transfer, 1)
                continue
            log_start = len(engine._launches.log)
            t0 = time.perf_counter()
            if phase == "chunk":
                chunk()
                times["turns"].append(engine._launches.log[log_start:].count("main"))
            elif phase == "unordered":                 # the same chunk with no turns (nothing else launches)
                order, engine._launches = engine._launches, None
                try:
                    chunk()
                finally:
                    engine._launches = order
            elif phase == "send":
                thread, box = send(transfer)
                thread.join()
                assert rank or box.get("served") == 1, box
            else:
                thread, box = send(transfer)
                chunk()
                thread.join()
                assert rank or box.get("served") == 1, box
                log = engine._launches.log[log_start:]
                mains = [i for i, k in enumerate(log) if k == "main"]
                inside = sum(1 for i, k in enumerate(log) if k == "transport" and mains[0] < i < mains[-1])
                times["inside"].append(inside / max(1, log.count("transport")))
            times[phase].append(time.perf_counter() - t0)
    if gang:                                       # the cost of a turn alone: yield points with nothing between
        barrier.wait()
        t0 = time.perf_counter()
        with engine._launches.turn("main"):
            for _ in range(TURNS):
                engine._launches.yield_turn()
        took = torch.tensor([(time.perf_counter() - t0) / TURNS], dtype=torch.float64)
        torch.distributed.all_reduce(took, op=torch.distributed.ReduceOp.MAX)    # the follower's, which waits
        times["turn"] = float(took)
    else:
        barrier.wait()
    if rank == 0:
        torch.save(times, out)
    if gang:
        engine.destroy_process_group()


def send_beside_chunk(size: str, reps: int) -> dict:
    """Run the three phases ``reps`` times on a gang of two and a receiver (module docstring); medians."""
    import socket

    import torch
    import torch.multiprocessing as mp

    from benchmarks.bench_weight_sync import _model
    from bidirl.cluster.engines.workers import weight_transport as wt

    with tempfile.TemporaryDirectory() as tmp:
        md = _model(size, Path(tmp) / size)
        layout = wt.model_layout(md, "float32", BUCKET_BYTES)
        rendezvous = wt.Rendezvous("127.0.0.1")
        transfers = [rendezvous.open(["receiver"], 0, layout, 300.0) for _ in range(2 * reps)]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        barrier = ctx.Barrier(3)
        out = str(Path(tmp) / "times.pt")
        mp.start_processes(_worker, args=(3, f"127.0.0.1:{port}", md, transfers, reps, barrier, out), nprocs=3,
                           join=True, start_method="spawn")
        times = torch.load(out)
    chunk, send, both = (statistics.median(times[k]) for k in ("chunk", "send", "both"))
    return {f"{size}.chunk_s": (chunk, "s"), f"{size}.send_s": (send, "s"), f"{size}.both_s": (both, "s"),
            f"{size}.hidden": ((chunk + send - both) / min(chunk, send), ""),
            f"{size}.gathers_inside_chunk": (statistics.median(times["inside"]), ""),
            f"{size}.turns_per_chunk": (statistics.median(times["turns"]), ""),
            f"{size}.chunk_turn_overhead_s": (chunk - statistics.median(times["unordered"]), "s"),
            f"{size}.turn_s": (times["turn"], "s"),
            f"{size}.buckets": (len(layout.buckets), "")}


def bench_send_overlap(quick: bool) -> dict:
    return send_beside_chunk(SIZES[quick], reps=3 if quick else 5)


BENCHMARKS = {"send_overlap": bench_send_overlap}
