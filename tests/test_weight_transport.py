"""The weight transport (issue #24, ``bidirl.cluster.engines.workers.weight_transport``): trainer gang → rollouters
in buckets.

Unit tests: the bucket layout, the settings' errors. Integration tests (``-m integration``):

* **Plain tensors between processes** (gloo): one sender, three receivers of a 20-tensor model in 5 buckets. Every
  receiver gets every tensor exactly; in bf16 each equals the fp32 value rounded to bf16 (below); a receiver that
  never comes, one killed mid-transfer (marked gone by the driver, or not: then the sender gives up after its
  timeout) and a sender killed mid-transfer break no one else's transfer and hang no one: the others complete or
  raise ``WeightTransferError`` within the timeouts.
* **The real engines** (Ray, vLLM): a two-rank FSDP2 trainer gang over gloo takes one GRPO step, publishes the
  version and sends it over the collective transport to two vLLM rollouters. Every rollouter's weights — read back
  through vLLM's own layers — equal the trainer's exactly, and nothing but metadata went through Ray's object
  store (counted: the calls' arguments and returns by kind, and the object store's own count of bytes created).

Tolerances, derived. On CPU the rollout dtype is fp32, the trainer's too: the weights travel unconverted and the
FSDP2 all-gather only concatenates shards, so a rollouter's weights equal the trainer's bit for bit; vLLM's CPU
linear weights are read back as each layer's output for the identity matrix, which is exact in fp32 (each entry is
one product by 1 plus products by 0, all exact). On GPU the wire dtype is bf16: each weight is rounded once,
to nearest even, ``|bf16(w) − w| ≤ 2⁻⁸·|w|`` (8 significant bits: unit roundoff u = 2⁻⁸), the same rounding the
trainer's bf16-mixed forward applies to its fp32 master weights — checked here on the bf16 wire between processes
(``received == w.to(bfloat16)`` exactly, and the bound).
"""

from __future__ import annotations

import errno
import importlib.util
import multiprocessing
import os
import signal
import socket
import time

import pytest
import torch

from bidirl.cluster.engines.workers import weight_transport as wt
from bidirl.errors import ConfigError

from gang_rendezvous import join_gang, listening_store

N_TENSORS = 20
BUCKET_BYTES = 1_000_000            # 20 tensors of ~200 KB in fp32: 5 buckets


def _shapes():
    return [(f"t{i}", (1000 + i, 50)) for i in range(N_TENSORS)]


def _full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(name[1:]))
    return torch.randn(1000 + int(name[1:]), 50, generator=g)


# --------------------------------------------------------------------------------------------------
# unit: layout and settings
# --------------------------------------------------------------------------------------------------

def test_layout_packs_tensors_in_order_into_buckets_and_sends_a_tied_head_once():
    shapes = [("a", (10, 10)), ("b", (30,)), ("big", (100, 10)), ("c", (5,))]
    layout = wt.BucketLayout.plan(shapes, "float32", 200 * 4, aliases=[("head", "a")])
    assert [[s.name for s in b] for b in layout.buckets] == [["a", "b"], ["big"], ["c"]]   # big travels alone
    assert [s.offset for s in layout.buckets[0]] == [0, 100]
    assert layout.bucket_numel(0) == 130 and layout.nbytes == (130 + 1000 + 5) * 4
    assert layout.shapes()["head"] == (10, 10)
    half = wt.BucketLayout.plan(shapes, "bfloat16", 200 * 4)
    assert half.nbytes == (130 + 1000 + 5) * 2 and [len(b) for b in half.buckets] == [2, 1, 1]
    with pytest.raises(ValueError, match="appears twice"):
        wt.BucketLayout.plan([("a", (1,)), ("a", (2,))], "float32", 64)
    with pytest.raises(ValueError, match="alias"):
        wt.BucketLayout.plan(shapes, "float32", 64, aliases=[("x", "missing")])
    with pytest.raises(ValueError, match="dtype"):
        wt.BucketLayout.plan(shapes, "float16", 64)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The built-in tiny model's layout (weights as created, not warm-started: only names and shapes matter)."""
    from bidirl.rl import tiny_model
    return tiny_model.create(tmp_path_factory.mktemp("tiny") / "m", seed=0)


def test_model_layout_reads_the_checkpoint_and_aliases_the_tied_head(tiny_dir):
    from bidirl.rl.model_folder import checkpoint_shapes
    model_dir = tiny_dir
    layout = wt.model_layout(model_dir, "float32", 2**20)
    stored = checkpoint_shapes(model_dir)
    assert layout.aliases == (("lm_head.weight", "model.embed_tokens.weight"),)
    assert {s.name for b in layout.buckets for s in b} == set(stored)
    assert layout.nbytes == sum(torch.Size(s).numel() for s in stored.values()) * 4


def test_bad_transport_settings_name_the_field():
    from bidirl.job import config as C
    cfg = C.load("tiny-cpu")
    for key, value in (("transport.bucket_mb", 0), ("transport.timeout_s", -1), ("transport.weights", "nccl")):
        with pytest.raises(ConfigError) as info:
            cfg.with_overrides({key: value})
        assert info.value.field == key and info.value.fix
    assert cfg.transport.weights == "collective" and cfg.transport.bucket_mb == wt.DEFAULT_BUCKET_MB
    with pytest.raises(ConfigError, match="transport.bucket_mb"):
        wt.check_settings("collective", float("nan"), 10)
    assert wt.wire_dtype(gpu=True) == "bfloat16" and wt.wire_dtype(gpu=False) == "float32"


class _Method:
    def __init__(self, log, actor, name):
        self.log, self.actor, self.name = log, actor, name

    def remote(self, *args):
        self.log.append((self.actor, self.name, args))
        return f"ref:{self.actor}.{self.name}:{len(self.log)}"


class _Actor:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def __getattr__(self, method):
        return _Method(self.log, self.name, method)


class _Driver:
    """What :class:`WeightSync` uses of the engine driver, recording the calls it would make."""

    def __init__(self, model_dir):
        from types import SimpleNamespace

        from bidirl.core import protocol as P
        self.log, self.when_all = [], []
        self.model_dir, self.failed, self.trainer_state = model_dir, set(), None
        self.gangs = {P.PRIMARY_TRAINER: [_Actor(self.log, f"primary/{j}") for j in range(2)],
                      P.AUX_TRAINER: [_Actor(self.log, f"aux/{j}") for j in range(2)]}
        self.actors = {"r0": _Actor(self.log, "r0"), "r1": _Actor(self.log, "r1")}
        self.versions = {P.PRIMARY_TRAINER: 3}
        self.plan = SimpleNamespace(envelope=SimpleNamespace(trainer_layout=2))

    def _when_all(self, calls, callback, tolerate=False):
        self.when_all.append((calls, callback, tolerate))


def test_the_driver_side_sends_published_versions_marks_the_dead_and_resends_after_a_restart(tiny_dir):
    from types import SimpleNamespace

    from bidirl.cluster.engines.weight_sync import WeightSync
    from bidirl.cluster.pool import ClusterError
    from bidirl.core import protocol as P

    tp2 = WeightSync(_Driver(tiny_dir), "collective", 1.0, 30.0,
                     lambda: SimpleNamespace(dtype="bfloat16", tensor_parallel_size=2))
    assert tp2.mode == "object_store" and "tensor-parallel" in tp2.fallback and tp2.snapshot_spec() is None
    d = _Driver(tiny_dir)
    sync = WeightSync(d, "collective", 1.0, 30.0, lambda: SimpleNamespace(dtype="float32", tensor_parallel_size=1))
    sync.published = {2, 3}
    calls = sync.loads(["r0", P.AUX_TRAINER], 3)
    # one transfer: the rollouter is rank 1, the auxiliary gang's ranks 2 and 3; every primary rank sends it
    assert [(w, a, m) for w, (a, m, _) in zip([c[0] for c in calls], [e for e in d.log[:3]])] == [
        ("r0", "r0", "receive_weights"), (P.AUX_TRAINER, "aux/0", "receive_weights"),
        (P.AUX_TRAINER, "aux/1", "receive_weights")]
    transfer = d.log[0][2][0]
    assert transfer.receivers == ("r0", f"{P.AUX_TRAINER}/0", f"{P.AUX_TRAINER}/1") and transfer.version == 3
    assert transfer.layout.dtype == "float32" and [e[1] for e in d.log[3:]] == ["send_weights"] * 2
    with pytest.raises(ClusterError, match="actor version 1 .* holds only \\[2, 3\\]"):
        sync.loads(["r1"], 1)
    with pytest.raises(ClusterError, match="primary trainer would need"):
        sync.loads([P.PRIMARY_TRAINER], 3)

    # a receiver that dies is marked gone at the rendezvous, so the sender stops waiting for it
    store = sync.rendezvous._stores[transfer.tid][0]
    sync.member_lost("r0")
    assert store.check(["gone/1"]) and not store.check(["gone/2"])
    sync.member_lost(P.AUX_TRAINER)
    assert store.check(["gone/2"]) and store.check(["gone/3"])

    # the primary gang dies before serving anyone: the restarted gang publishes its snapshot's version, then resends
    second = sync.loads(["r1"], 3)[0][1]
    tid = [t for t in sync.flights if t != transfer.tid][0]
    d.failed.add(P.PRIMARY_TRAINER)
    sync.member_lost(P.PRIMARY_TRAINER)
    assert not sync.flights[tid].sent and not sync.flights[tid].broken and second.startswith("ref:r1")
    sync.publish(d.gangs[P.PRIMARY_TRAINER], 3)
    assert sync.published == set() and sync.publishing == 3
    publish_calls, done, _ = d.when_all[-1]
    assert [a for a, m, _ in d.log[-2:]] == ["primary/0", "primary/1"] and d.log[-1][1] == "publish"
    d.failed.discard(P.PRIMARY_TRAINER)
    done([None, None])
    assert sync.published == {3} and sync.flights[tid].sent and d.log[-1][1] == "send_weights"
    # one that had begun is broken instead: its receivers give up (and are restarted)
    store = sync.rendezvous._stores[tid][0]
    store.set("go/1", "gloo")
    sync.member_lost(P.PRIMARY_TRAINER)
    assert sync.flights[tid].broken and store.check(["gone/0"])


# --------------------------------------------------------------------------------------------------
# integration: plain tensors between processes
# --------------------------------------------------------------------------------------------------

def _check(name: str, t: torch.Tensor) -> tuple:
    """(exactly the value sent in the wire dtype, within one bf16 rounding of the fp32 value): derivation above."""
    w = _full(name)
    exact = torch.equal(t, w.to(t.dtype))
    bound = bool(((t.float() - w).abs() <= 2.0 ** -8 * w.abs()).all())
    return exact, bound, t.dtype == torch.float32 and torch.equal(t, w)


def _receiver(transfer, rank, q):
    try:
        r = wt.Receiver(transfer, rank, "cpu")
        r.connect()
        got = {}
        for name, t in r.items():
            got[name] = _check(name, t)           # checked here: tensors do not cross the queue
            q.put(("progress", rank, r.buckets))
            time.sleep(0.02)                      # slow enough for a kill to land mid-transfer
        q.put(("done", rank, got, r.close()))
    except wt.WeightTransferError as exc:
        q.put(("error", rank, str(exc)))


def _sender(transfer, q):
    dtype = wt.DTYPES[transfer.layout.dtype]
    q.put(("sent", 0, wt.send_buckets(transfer, 0, lambda names: [_full(n).to(dtype) for n in names], "cpu")))


class _Inbox:
    """One queue per process: a process killed while it writes to a shared queue would leave the queue's lock held
    and every other writer blocked (``multiprocessing.Queue``'s one write lock)."""

    def __init__(self, ctx, keys):
        self.queues = {k: ctx.Queue() for k in keys}

    def get(self, timeout: float):
        import queue
        deadline = time.time() + timeout
        while True:
            for q in self.queues.values():
                try:
                    return q.get_nowait()
                except queue.Empty:
                    pass
            if time.time() > deadline:
                raise queue.Empty
            time.sleep(0.01)


def _start(case: str, dtype: str = "float32", timeout_s: float = 120.0):
    ctx = multiprocessing.get_context("spawn")
    layout = wt.BucketLayout.plan(_shapes(), dtype, BUCKET_BYTES)
    rendezvous = wt.Rendezvous("127.0.0.1")
    transfer = rendezvous.open(["r1", "r2", "r3"], 7, layout, timeout_s)
    q = _Inbox(ctx, (0, 1, 2, 3))
    procs = {r: ctx.Process(target=_receiver, args=(transfer, r, q.queues[r])) for r in (1, 2, 3)}
    procs[0] = ctx.Process(target=_sender, args=(transfer, q.queues[0]))
    for r, p in procs.items():
        if not (case == "absent" and r == 3):
            p.start()
    return rendezvous, transfer, q, procs


def _collect(q, n, deadline_s=600.0):
    out, deadline = [], time.time() + deadline_s
    while len(out) < n:
        msg = q.get(timeout=max(1.0, deadline - time.time()))
        if msg[0] != "progress":
            out.append(msg)
    return {(m[0], m[1]): m for m in out}


def _stop(procs):
    for p in procs.values():
        if p.pid is not None and p.is_alive():
            p.kill()
        if p.pid is not None:
            p.join(10)


@pytest.mark.integration
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_receiver_gets_every_tensor_in_the_wire_dtype(dtype):
    rendezvous, transfer, q, procs = _start("ok", dtype)
    try:
        got = _collect(q, 4)
    finally:
        _stop(procs)
    report = got[("sent", 0)][2]
    buckets = len(transfer.layout.buckets)
    assert buckets == (5 if dtype == "float32" else 3)             # bf16 packs twice the elements per bucket
    assert report["served"] == 3 and report["failed"] == {} and report["buckets"] == buckets
    assert report["bytes"] == 3 * transfer.layout.nbytes
    for r in (1, 2, 3):
        tensors, stats = got[("done", r)][2], got[("done", r)][3]
        assert stats["bytes"] == transfer.layout.nbytes and stats["buckets"] == buckets
        assert set(tensors) == {n for n, _ in _shapes()}
        for name, (exact, bound, fp32_equal) in tensors.items():
            # fp32: the very values; bf16: one round to nearest even, exactly w.to(bf16), within u = 2^-8 relative
            assert exact and bound and fp32_equal == (dtype == "float32"), name


@pytest.mark.integration
def test_a_receiver_that_never_comes_is_skipped_once_marked_gone():
    rendezvous, transfer, q, procs = _start("absent")
    try:
        rendezvous.gone(transfer.tid, 3)          # the driver saw it die before it joined
        got = _collect(q, 3)
    finally:
        _stop(procs)
    report = got[("sent", 0)][2]
    assert report["served"] == 2 and list(report["failed"]) == ["r3"]
    for r in (1, 2):
        assert set(got[("done", r)][2]) == {n for n, _ in _shapes()} and all(c[2] for c in got[("done", r)][2].values())


def _peer_that_dies_while_its_pair_forms(end: str) -> tuple:
    """One end of a one-receiver transfer (``end``: "sender" or "receiver") runs in a thread; its peer announces
    itself at the rendezvous as a live member does (``ready/1``, or the sender's ``go/1``) and then never forms the
    pair — it died there — and the driver marks it gone once the thread is forming the pair. Returns what the
    thread ended with, and whether it ended within half the transfer's timeout of the mark."""
    import datetime
    import threading

    import torch.distributed as dist

    timeout_s = 120.0
    rendezvous = wt.Rendezvous("127.0.0.1")
    transfer = rendezvous.open(["r1"], 7, wt.BucketLayout.plan(_shapes(), "float32", BUCKET_BYTES), timeout_s)
    host, port = transfer.address.rsplit(":", 1)
    peer = dist.PrefixStore(transfer.tid, dist.TCPStore(host, int(port), is_master=False,
                                                        timeout=datetime.timedelta(seconds=30)))
    box: dict = {}

    def run():
        try:
            if end == "sender":
                member = wt.Sender(transfer, "cpu")
                member.connect()
                box["value"] = dict(member.failed)
            else:
                wt.Receiver(transfer, 1, "cpu").connect()
                box["value"] = "paired"
        except Exception as exc:
            box["error"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    if end == "sender":
        peer.set("ready/1", "cpu")             # the receiver announced itself ...
        peer.wait(["go/1"])                    # ... the sender began forming the pair ...
    else:
        peer.wait(["ready/1"])
        peer.set("go/1", "gloo")               # the sender said go ...
    time.sleep(0.5)                            # ... and the thread is now blocked forming the pair
    rendezvous.gone(transfer.tid, 1 if end == "sender" else 0)
    thread.join(timeout_s / 2)                 # finished well before the transfer's own timeout, or it waited for it
    return box, not thread.is_alive()


@pytest.mark.parametrize("end", ["sender", "receiver"])
def test_a_peer_that_dies_while_its_pair_forms_is_let_go_once_marked(end):
    """Forming a pair blocks in the rendezvous store until the peer writes its address; the marks are polled over
    another store client, so a peer that died between announcing itself and pairing is let go when the driver
    marks it gone, not after ``transport.timeout_s`` (here 120 s). Seen in a chaos run: a primary rollouter killed
    just after it announced itself held up a weight sync for the full 300 s."""
    box, let_go = _peer_that_dies_while_its_pair_forms(end)
    assert let_go, f"the {end} was still forming its pair 60 s after its peer was marked gone"
    if end == "sender":
        assert set(box["value"]) == {1} and "gone" in box["value"][1], box
    else:
        assert isinstance(box.get("error"), wt.WeightTransferError) and "gone" in str(box["error"]), box


def _wait_progress(q, rank, buckets, others):
    """Wait until ``rank`` has received ``buckets`` buckets; other messages are kept in ``others``."""
    while True:
        msg = q.get(timeout=600)
        if msg[0] == "progress" and msg[1] == rank and msg[2] >= buckets:
            return
        if msg[0] != "progress":
            others.append(msg)


def _kill_mid_transfer(timeout_s: float, member: int, progress: tuple, mark: bool):
    """Start a transfer, SIGKILL ``member`` once member ``progress[0]`` has ``progress[1]`` buckets, mark it gone at
    the rendezvous if ``mark`` (as the driver does for a death it sees), and collect every other member's last
    message. Returns (the transfer, the messages by (kind, rank), the kill's time)."""
    rendezvous, transfer, q, procs = _start("kill", timeout_s=timeout_s)
    others: list = []
    try:
        _wait_progress(q, *progress, others)
        os.kill(procs[member].pid, signal.SIGKILL)
        if mark:
            assert rendezvous.started(transfer.tid)      # it had begun: the driver marks the member gone
            rendezvous.gone(transfer.tid, member)
        t_kill = time.time()
        got = {(m[0], m[1]): m for m in others}
        got.update(_collect(q, 3 - len(others)))
    finally:
        _stop(procs)
    return transfer, got, t_kill


@pytest.mark.integration
@pytest.mark.parametrize("marked", [True, False], ids=["marked-gone", "unnoticed"])
def test_a_receiver_killed_mid_transfer_breaks_only_its_own_pair(marked):
    # unnoticed: nobody marks it; the sender gives up on it after its timeout (short here), the others wait longer
    transfer, got, t_kill = _kill_mid_transfer(120.0 if marked else 15.0, 2, (2, 1), marked)
    report = got[("sent", 0)][2]
    assert report["served"] == 2 and list(report["failed"]) == ["r2"], report
    for r in (1, 3):
        assert len(got[("done", r)][2]) == N_TENSORS and all(c[2] for c in got[("done", r)][2].values())
    assert time.time() - t_kill < transfer.timeout_s * 3


@pytest.mark.integration
def test_a_sender_killed_mid_transfer_fails_its_receivers_instead_of_hanging_them():
    _, got, t_kill = _kill_mid_transfer(120.0, 0, (1, 1), True)
    # each receiver either had every bucket before the kill or raises; none waits out the 120 s timeout
    errors = [r for r in (1, 2, 3) if ("error", r) in got]
    assert 1 in errors, got.keys()
    for r in errors:      # the mark, or gloo itself seeing the killed peer's connection close
        assert "broke off after" in got[("error", r)][2], got[("error", r)][2]
    for r in set((1, 2, 3)) - set(errors):
        assert len(got[("done", r)][2]) == N_TENSORS and all(c[2] for c in got[("done", r)][2].values())
    assert time.time() - t_kill < 60


def _gang_rank(rank: int, addr: str, tids: tuple, q) -> None:
    """One rank of a two-rank gloo gang: forms its groups as a trainer rank does (the transport group's
    communicator eagerly), then checks a transfer before its first gather (``wt.check_same_transfer``)."""
    import torch.distributed as dist
    join_gang(rank, 2, addr)
    group = dist.new_group(backend="gloo")
    wt.form_eagerly(group, torch.device("cpu"))
    out = []
    for tid in tids[rank]:
        try:
            wt.check_same_transfer(tid, 5, rank, group, torch.device("cpu"))
            out.append("same")
        except wt.TransferOrderError as exc:
            out.append(str(exc))
    q.put((rank, out))
    dist.destroy_process_group()


@pytest.mark.integration
def test_every_rank_checks_the_transfer_before_its_first_gather():
    """Two ranks that run the same transfer pass; two that run different ones (a send ordered differently on two
    ranks) both refuse before any bucket is gathered, naming each rank's transfer — and stay in step: the next
    check, of the same transfer, passes on both."""
    tids = (("t-1", "t-2", "t-3"), ("t-1", "t-9", "t-3"))
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    with listening_store() as addr:
        procs = {r: ctx.Process(target=_gang_rank, args=(r, addr, tids, q)) for r in range(2)}
        for p in procs.values():
            p.start()
        try:
            got = dict(q.get(timeout=120) for _ in procs)
        finally:
            _stop(procs)
    for rank in (0, 1):
        same, mixed, again = got[rank]
        assert same == "same" and again == "same", got
        assert "run different transfers" in mixed and "rank 0: id crc" in mixed and "rank 1: id crc" in mixed


# --------------------------------------------------------------------------------------------------
# integration: the real engines over Ray
# --------------------------------------------------------------------------------------------------

def _fused(state: dict, name: str) -> torch.Tensor:
    """The trainer's weight under vLLM's fused name (q, k, v → qkv_proj; gate, up → gate_up_proj)."""
    if ".qkv_proj." in name:
        return torch.cat([state[name.replace("qkv_proj", p)] for p in ("q_proj", "k_proj", "v_proj")])
    if ".gate_up_proj." in name:
        return torch.cat([state[name.replace("gate_up_proj", p)] for p in ("gate_proj", "up_proj")])
    return state[name]


def _assert_port_taken(port: int) -> None:
    """Binding ``port`` on this node fails: something listens on it."""
    with socket.socket() as other, pytest.raises(OSError) as taken:
        other.bind(("", port))
    assert taken.value.errno == errno.EADDRINUSE


@pytest.mark.integration
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the rollout engine needs vllm")
def test_a_sync_over_the_transport_gives_every_rollouter_the_trainers_weights_through_no_object_store(model_dir,
                                                                                                     ray_session):
    ray = ray_session
    from bidirl.cluster.engines.workers.actors import RolloutActor, TrainerActor
    from bidirl.cluster.engines.object_store_meter import ObjectStoreMeter, inline_limit
    from bidirl.cluster.engines.sync_grpo import requests_for
    from bidirl.cluster.engines.workers.trainer import rank_shares
    from bidirl.rl import grpo
    from bidirl.rl.samples import samples_from_groups
    from bidirl.rl.tasks import ArithmeticTask
    from bidirl.rl.tiny_model import load_tokenizer

    md = str(model_dir)
    ranks = [TrainerActor.options(num_cpus=0.5).remote(f"trainer_pool/trainer/{j}", md, lr=3e-3, threads=1)
             for j in range(2)]
    rollouters = [RolloutActor.options(num_cpus=0.5).remote(f"rollout_pool/rollouter/{i}", md, 0, max_model_len=32,
                                                            reward_fn=ArithmeticTask.reward) for i in range(2)]
    try:
        ray.get([a.ready.remote() for a in ranks + rollouters], timeout=600)
        addr = ray.get(ranks[0].address.remote())
        port = int(addr.rsplit(":", 1)[1])
        _assert_port_taken(port)      # rank 0's store listens on the port it named: nothing else can take it
        ray.get([r.init_process_group.remote(j, 2, addr, 1) for j, r in enumerate(ranks)], timeout=300)
        _assert_port_taken(port)      # and still does once the gang joined through it

        # one GRPO step on the gang (FSDP2 shards), so the version sent is not the checkpoint's
        task = ArithmeticTask(seed=0)
        ray.get(rollouters[0].start.remote(requests_for(task, load_tokenizer(md), 0, 4, 4, 8)))
        groups = []
        while len(groups) < 4:
            groups += ray.get(rollouters[0].step_until.remote(max_seconds=5.0)).value
        samples = samples_from_groups(groups)
        adv = grpo.group_advantages([s.reward for s in samples], group_size=4).float()
        shares = rank_shares(list(range(len(samples))), 8, 2)
        old = [None] * len(samples)
        live = range(len(ranks))                   # every rank runs every gang call (trainer.shares)
        for j, reply in zip(live, ray.get([ranks[j].logprobs.remote([samples[k] for k in shares[j]]) for j in live])):
            for k, lp in zip(shares[j], reply.value):
                old[k] = lp
        norm = grpo.loss_normalizer([s.response_len for s in samples])
        ray.get([ranks[j].chunk_gradient.remote(0, [samples[k] for k in shares[j]], adv[shares[j]],
                                                [old[k] for k in shares[j]], None, norm, keep=True)[0]
                 for j in range(2)])
        assert ray.get([r.apply_kept.remote([0]) for r in ranks])[0].value["version"] == 1
        ray.get([r.publish.remote(1, "float32") for r in ranks])
        trainer_state = ray.get([r.weights.remote() for r in ranks])[0]

        layout = wt.model_layout(md, "float32", 64 * 1024)          # small buckets: the model in many
        assert len(layout.buckets) > 4
        rendezvous = wt.Rendezvous()
        with ObjectStoreMeter() as meter:
            transfer = rendezvous.open([f"rollout_pool/rollouter/{i}" for i in range(2)], 1, layout, 120.0)
            received = [a.receive_weights.remote(transfer, i + 1) for i, a in enumerate(rollouters)]
            sent = [r.send_weights.remote(transfer) for r in ranks]
            replies = ray.get(sent + received, timeout=600)
        report = replies[0].value
        assert report["served"] == 2 and report["failed"] == {} and report["buckets"] == len(layout.buckets)
        for reply in replies[2:]:
            assert reply.value["bytes"] == layout.nbytes and reply.value["buckets"] == len(layout.buckets)
        assert [ray.get(a.status.remote())["version"] for a in rollouters] == [1, 1]

        # every rollouter computes with exactly the trainer's weights (fp32 on CPU: no rounding, derivation above)
        for a in rollouters:
            effective = ray.get(a.effective_weights.remote())
            assert {n for n in effective if "proj" in n} and "model.embed_tokens.weight" in effective
            for name, value in effective.items():
                want = _fused(trainer_state, name)
                assert torch.equal(value[:want.shape[0]], want), name      # vLLM pads the vocabulary rows
        initial = dict(_checkpoint(md))
        assert any(not torch.equal(v, initial[n]) for n, v in trainer_state.items()), "the step changed no weight"

        # nothing but metadata through Ray: no argument or return in the object store, and the store itself created
        # less than one object could hold inline (a copy of the weights would be layout.nbytes = 1.6 MB)
        counted = meter.report()
        assert counted["object_store_total"] == 0, counted
        assert counted["raylet_bytes"] is not None and counted["raylet_bytes"] < inline_limit(), counted
        assert 0 < counted["inline"]["weights"] < 4 * 16 * 1024, counted      # four calls' layouts: metadata

        # a layout of other weights is refused before anything is loaded (the sender is not needed to learn it)
        other = wt.BucketLayout.plan([("model.norm.weight", (7,))], "float32", 1024)
        bad = rendezvous.open(["rollout_pool/rollouter/0"], 2, other, 30.0)
        with pytest.raises(ray.exceptions.RayTaskError, match="do not match the checkpoint"):
            ray.get(rollouters[0].receive_weights.remote(bad, 1), timeout=120)
        assert ray.get(rollouters[0].status.remote())["version"] == 1
    finally:
        for actor in ranks + rollouters:
            ray.kill(actor)


def _checkpoint(model_dir):
    from bidirl.rl.model_folder import causal_lm_config, checkpoint_weights, tied_embeddings
    return checkpoint_weights(model_dir, tied_embeddings(causal_lm_config(model_dir)))
