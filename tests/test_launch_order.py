"""One launch order per rank (``bidirl.cluster.engines.workers.launch_order``), on gloo: two ranks, each launching
collectives from two threads over two groups, launch them in the same order — the leader's — while the second
thread's collectives still slip in between the first's; without the order the same threads launch in different
orders on the two ranks (the hazard NCCL documents, which gloo survives), so the check can fail.

And on a trainer gang of two (FSDP2 over gloo): the weight transport's bucket gathers on one thread and the
chunk's collectives on the main thread, with the engine's own order: both ranks take the same turns, and gathers
land between the blocks of a chunk (the send overlaps it).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest
import torch

from gang_rendezvous import join_gang, spawn_gang


def _two_threads(rank, world, addr, path, ordered):
    """Main thread: 3 units of 4 all-reduces with a yield point between them; transport thread: 6 all-reduces on
    a second group, started at once on rank 0 and after the main units on rank 1 (so unordered launches differ)."""
    import torch.distributed as dist

    from bidirl.cluster.engines.workers import launch_order as lo

    join_gang(rank, world, addr)
    second = dist.new_group(backend="gloo")
    order = lo.LaunchOrder(lo.gang_store("test"), rank, world) if ordered else None
    seen, lock = [], threading.Lock()

    def turn(kind):
        return order.turn(kind) if order is not None else contextlib.nullcontext()

    def launch(kind, i, group):
        with lock:
            seen.append(f"{kind}{i}")
        x = torch.ones(1)
        dist.all_reduce(x, group=group)
        assert x.item() == world

    def transport():
        if rank == 1 and not ordered:
            main_done.wait()
        for i in range(6):
            with turn(lo.TRANSPORT):
                launch("t", i, second)
            time.sleep(0.01)

    main_done = threading.Event()
    thread = threading.Thread(target=transport)
    thread.start()
    k = 0
    for unit in range(3):
        with turn(lo.MAIN):
            for j in range(4):
                if j and order is not None:
                    order.yield_turn()
                launch("m", k, None)
                k += 1
                time.sleep(0.01)
    main_done.set()
    thread.join(60)
    torch.save({"seen": seen, "log": order.log if order else None}, f"{path}/rank{rank}.pt")
    dist.destroy_process_group()


def _run(tmp_path, fn, *args, world=2):
    """Run ``fn`` on ``world`` spawned ranks, which join a store listening here (``gang_rendezvous``: race-free)."""
    spawn_gang(fn, world, str(tmp_path), *args)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def test_two_threads_launch_in_one_order_on_every_rank(tmp_path):
    ranks = _run(tmp_path, _two_threads, True)
    assert ranks[0]["seen"] == ranks[1]["seen"]
    assert ranks[0]["log"] == ranks[1]["log"]
    seen = ranks[0]["seen"]
    assert sorted(seen) == sorted([f"m{i}" for i in range(12)] + [f"t{i}" for i in range(6)])
    # the second thread was not held back until the first was done: its launches slip in between
    assert seen.index("t0") < seen.index("m11")


def test_without_the_order_the_ranks_launch_in_different_orders(tmp_path):
    ranks = _run(tmp_path, _two_threads, False)
    assert ranks[0]["seen"] != ranks[1]["seen"]


def _store(timeout_s: float):
    from datetime import timedelta
    store = torch.distributed.HashStore()
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


def test_a_follower_refuses_an_unknown_entry():
    from bidirl.cluster.engines.workers import launch_order as lo
    store = _store(5)
    store.set("turn/0", "bogus")
    with pytest.raises(lo.LaunchOrderError, match="entry 0 is 'bogus'"):
        with lo.LaunchOrder(store, 1, 2).turn(lo.MAIN):
            pass
    with pytest.raises(ValueError, match="kind must be one of"):
        with lo.LaunchOrder(store, 0, 2).turn("chunk"):
            pass
    with pytest.raises(ValueError, match="rank must be in"):
        lo.LaunchOrder(store, 2, 2)


def test_a_follower_waits_for_the_leader_and_gives_up_with_the_stores_error():
    """A leader gone (its process took the store with it) or silent past the store's timeout: the follower raises
    the store's own c10d error, which the pool recovers as a peer's death, as it does a broken collective."""
    from bidirl.cluster.engines.workers import launch_order as lo
    from bidirl.cluster.recovery import PEER_LOST, failure_kind
    with pytest.raises(torch.distributed.DistError) as raised:
        with lo.LaunchOrder(_store(0.05), 1, 2).turn(lo.MAIN):
            pass
    assert failure_kind(raised.value) == PEER_LOST


def test_the_last_follower_to_take_an_entry_deletes_it():
    from bidirl.cluster.engines.workers import launch_order as lo
    store = _store(5)
    leader, followers = lo.LaunchOrder(store, 0, 3), [lo.LaunchOrder(store, r, 3) for r in (1, 2)]
    for kind in (lo.MAIN, lo.TRANSPORT):
        with leader.turn(kind):
            pass
    for f in followers:
        with f.turn(lo.MAIN):
            pass
        assert f.log == [lo.MAIN]
    assert not store.check(["turn/0"]) and store.check(["turn/1"])
    pair = _store(5)                              # a gang of two: its one follower deletes at once
    with lo.LaunchOrder(pair, 0, 2).turn(lo.TRANSPORT):
        pass
    with lo.LaunchOrder(pair, 1, 2).turn(lo.TRANSPORT):
        pass
    assert not pair.check(["turn/0"])


def _gang_sends_beside_a_chunk(rank, world, addr, path, model_dir):
    from bidirl.cluster.engines.workers.trainer import TrainerEngine
    from bidirl.rl import grpo
    from test_rounding import _samples

    engine = TrainerEngine(model_dir, lr=1e-3, seed=0, threads=1, gang=True)
    join_gang(rank, world, addr)                  # the engine takes the process group joined here
    engine.init_process_group(rank, world, addr)
    try:
        engine.publish(0, "float32")
        shards = engine.published[0]
        names = sorted(shards)
        samples = _samples(8, seed=0)[rank * 4:(rank + 1) * 4]
        adv = grpo.group_advantages([s.reward for s in samples], group_size=2).float()
        old = engine.logprobs(samples)
        started = threading.Event()
        gathered = []

        def send():
            started.wait()
            for name in names:                    # one turn per bucket, as send_weights takes them
                with engine._transport_turn():
                    gathered.append(engine._gather_bucket(shards, [name])[0])

        thread = threading.Thread(target=send)
        thread.start()
        started.set()
        engine.chunk_gradients(samples, adv, old, normalizer=64.0, accumulate=True, chunk_id=0)
        engine.chunk_gradients(samples, adv, old, normalizer=64.0, accumulate=True, chunk_id=1)
        thread.join(120)
        full = engine.state_dict()
        torch.save({"log": list(engine._launches.log), "gathered": dict(zip(names, gathered)), "full": full},
                   f"{path}/rank{rank}.pt")
    finally:
        engine.destroy_process_group()


def test_a_gangs_bucket_gathers_and_chunks_take_the_same_turns_on_every_rank(tmp_path, model_dir):
    ranks = _run(tmp_path, _gang_sends_beside_a_chunk, str(model_dir))
    assert ranks[0]["log"] == ranks[1]["log"]
    log = ranks[0]["log"]
    assert log.count("transport") == len(ranks[0]["gathered"])
    # gathers went between the blocks of the chunks, not only after them: the send overlapped the chunk
    last_main = max(i for i, k in enumerate(log) if k == "main")
    assert any(k == "transport" for k in log[:last_main]), log
    start = ranks[0]["full"]
    for name, t in ranks[0]["gathered"].items():           # every rank gathered the published weights whole
        torch.testing.assert_close(t, start[name], atol=0, rtol=0)
        assert torch.equal(ranks[1]["gathered"][name], t)


def _replicas_with_unequal_passes(rank, world, addr, path, model_dir):
    """Two replicas of one rank each with a token budget: rank 0's share needs several passes, rank 1 is dealt none.
    Both take every gang call (as the engine driver sends them), then a weight send runs its turns: the send's
    first gather needs both ranks' transport threads."""
    from bidirl.cluster.engines.workers.trainer import TrainerEngine
    from bidirl.cluster.engines.workers.trainer.micro_batches import token_micro_batches
    from bidirl.rl import grpo
    from test_rounding import _samples

    samples = _samples(6, seed=0)
    widest = max(len(s.prompt_ids) + s.response_len for s in samples)
    engine = TrainerEngine(model_dir, lr=1e-3, seed=0, threads=1, gang=True, max_tokens_per_micro_batch=widest)
    join_gang(rank, world, addr)
    engine.init_process_group(rank, world, addr, replicas=world)
    mine = samples if rank == 0 else []
    passes = len(token_micro_batches([len(s.prompt_ids) + s.response_len for s in mine], widest)) if mine else 0
    sent = threading.Event()
    try:
        engine.publish(0, "float32")
        shards = engine.published[0]
        adv = grpo.group_advantages([s.reward for s in samples], group_size=2).float()
        old = engine.logprobs(mine)                                   # a forward-only stage: rank 1 idle
        engine.chunk_gradients(mine, adv if mine else [], old, normalizer=64.0, accumulate=True, chunk_id=0)

        def send():                                                   # after the chunks, as a step's weight sync
            for name in sorted(shards):
                with engine._transport_turn():
                    engine._gather_bucket(shards, [name])
            sent.set()

        threading.Thread(target=send, daemon=True).start()
        sent.wait(60)
        torch.save({"log": list(engine._launches.log), "sent": sent.is_set(), "passes": passes},
                   f"{path}/rank{rank}.pt")
    finally:
        if sent.is_set():
            engine.destroy_process_group()
        else:
            # the send is stuck in a collective: leave without running C++ destructors, whose joinable threads
            # would abort the process (SIGABRT), so the test reads this rank's file and fails naming the stall
            os._exit(0)


def test_replicas_with_unequal_passes_take_the_same_turns_and_a_send_after_them_completes(tmp_path, model_dir):
    """The stall of a token-budget engine run (issue #37): every rank runs every gang call and the budget's passes
    are agreed over the whole gang, so the ranks' logs agree though one replica ran several passes and the other
    had no samples — and the weight send after them completes. When the idle replica ran fewer passes (passes
    agreed per replica, or the log-prob call sent only to the busy replica), the leader logged ``main`` turns the
    follower never took: the follower's send waited on them for ever and the leader's send in its first gather."""
    ranks = _run(tmp_path, _replicas_with_unequal_passes, str(model_dir))
    assert ranks[0]["passes"] >= 2 and ranks[1]["passes"] == 0
    assert all(r["sent"] for r in ranks), ("the weight send after the chunks did not complete; turns taken: "
                                           f"rank 0 {ranks[0]['log']}, rank 1 {ranks[1]['log']}")
    assert ranks[0]["log"] == ranks[1]["log"]
    assert ranks[0]["log"].count("transport") > 0
