"""The weight sync without a host detour: trainer gang → rollouters in buckets over ``torch.distributed`` (§3.2).

Paper §3.2 / §6.2: after each optimizer step the new actor version goes from the primary trainer to the rollouters
(``SyncWeights``), and a rollouter switched in or restarted later loads the version it must serve. This module
moves those weights **directly between the workers' processes**: the primary gang's rank 0 sends, the target
workers receive, and Ray carries only metadata — the :class:`BucketLayout` (names, shapes, dtype, bucket bounds),
the rendezvous address and the version (:class:`Transfer`).

* **Dtype.** Weights travel in the *rollout* dtype (:func:`wire_dtype`): bf16 on GPU, where vLLM runs bf16 and the
  trainer computes in bf16 from fp32 master weights (rounding once, round-to-nearest-even, exactly as the trainer's
  own forward casts them), fp32 on CPU, where the tiny model runs fp32 on both sides (no rounding at all: a CPU
  rollouter's weights equal the trainer's bit for bit).
* **Buckets.** The model's tensors, in the checkpoint's order, are packed into flat buffers of at most
  ``transport.bucket_mb`` MiB (default :data:`DEFAULT_BUCKET_MB`, slime's size on GPU); a tensor larger than a
  bucket travels alone. The trainer gang gathers its shards *one bucket at a time* (FSDP2 all-gathers of that
  bucket's tensors only), so neither side ever holds more than a bucket beyond the model itself; a receiver loads
  each bucket into vLLM in place as it arrives (``model.load_weights`` inside vLLM's layerwise reload) and keeps
  no copy.
* **One rendezvous per transfer, one group per receiver.** The driver opens a fresh ``TCPStore``
  (:class:`Rendezvous`) for every transfer with the live targets only and closes it after. The sender and each
  receiver form a two-rank process group of their own (gloo on CPU, NCCL between two GPUs; gloo staged through
  the host for a receiver on the sender's own GPU, where NCCL cannot run two ranks — CUDA IPC would avoid that
  copy and is not implemented). Separate pairs keep one member's death from touching the others: a dead receiver
  only loses its own pair.
* **Failures** (workers die at any moment, ``bidirl.cluster.recovery``). Every wait — for a peer at the rendezvous,
  for a bucket to arrive or leave — polls the operation and the rendezvous, where the driver marks members it
  knows dead (``gone/<rank>``), and gives up after ``transport.timeout_s`` at the latest (gloo itself does not
  notice a killed peer before its own timeout). Forming a pair blocks in the store until the peer has written its
  address, and a store client serves one call at a time, so each pair forms over a client of its own: the marks
  stay readable while a pair forms with a peer that died after announcing itself. The sender drops a receiver
  that is gone or times out and serves the others; a receiver whose sender is gone or silent raises
  :class:`WeightTransferError` — its vLLM weights may be half-loaded, so the driver restarts it rather than let it
  generate. Nobody waits forever.

:func:`send_buckets` runs on every rank of the sending gang (the gathers are collectives); only rank 0 talks to
the receivers. :class:`Receiver` runs in the receiving worker's process.
"""

from __future__ import annotations

import datetime
import itertools
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch

from bidirl.errors import BidirlError, ConfigError

#: ``transport.weights``: the two ways weights reach a worker
MODES = ("collective", "object_store")
#: default bucket size (MiB): slime's NCCL bucket; a bucket this size fits beside any model on a GPU
DEFAULT_BUCKET_MB = 512.0
#: default seconds a member waits for its peers (the rendezvous, and each bucket) before the transfer fails
DEFAULT_TIMEOUT_S = 300.0
#: wire dtype names
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

_POLL_S = 0.001            # how often a pending bucket is checked
_MARK_POLL_S = 0.05        # how often the rendezvous is checked for members marked gone meanwhile


def _backoff():
    """Sleeps for a polling loop: 1 ms, doubling up to :data:`_MARK_POLL_S` (a peer that is already there is
    seen within a millisecond or two, one that is busy costs one store round trip per 50 ms)."""
    delay = 0.001
    while True:
        time.sleep(delay)
        yield
        delay = min(2 * delay, _MARK_POLL_S)


class WeightTransferError(BidirlError, RuntimeError):
    """This member could not complete a transfer: its peer died, was marked gone, or stayed silent past the
    timeout. A receiver's weights may be half-loaded; the driver restarts it."""

    fix = "the driver restarts the worker and sends it the version again"


class TransferOrderError(BidirlError, RuntimeError):
    """The ranks of a sending gang were running different transfers at once: their gathers would have mixed the
    buckets of two versions. An error of the driver's ordering, not a lost peer: the run stops."""

    fix = "every rank of the sending gang must run the same transfers in the same order (one send call per rank)"


def check_same_transfer(tid: str, version: int, rank: int, group, device) -> None:
    """Before the first collective of a transfer, every rank of the sending gang checks that all of them run the
    same one: one all-gather of (a CRC-32 of the transfer id, the version) over the gang's transport ``group``;
    raises :class:`TransferOrderError` on every rank if they differ (all ranks take part, so the gang stays in
    step). Gathers carry no id of their own: without this check two transfers run in different orders on two ranks
    would mix versions silently."""
    import zlib

    import torch.distributed as dist
    key = torch.tensor([zlib.crc32(str(tid).encode()), int(version)], dtype=torch.int64, device=device)
    keys = [torch.empty_like(key) for _ in range(dist.get_world_size(group))]
    dist.all_gather(keys, key, group=group)
    seen = [tuple(int(v) for v in k.tolist()) for k in keys]
    if len(set(seen)) > 1:
        ranks = ", ".join(f"rank {r}: id crc {c:08x} version {v}" for r, (c, v) in enumerate(seen))
        raise TransferOrderError(f"weight transfer {tid} (version {version}) on rank {rank}: the sending gang's "
                                 f"ranks run different transfers ({ranks}); {TransferOrderError.fix}")


def wire_dtype(gpu: bool) -> str:
    """The dtype weights travel in: the rollouter's (bf16 on GPU, fp32 on CPU)."""
    return "bfloat16" if gpu else "float32"


def check_settings(mode: str, bucket_mb: float, timeout_s: float, where: str = "transport") -> None:
    """Raise :class:`ConfigError` naming the field for a bad transport setting."""
    if mode not in MODES:
        raise ConfigError(f"{where}.weights", f"{mode!r} is not a weight transport",
                          f"use one of {list(MODES)} (collective: buckets over torch.distributed)")
    for name, value, fix in (("bucket_mb", bucket_mb, f"give the bucket size in MiB, e.g. {DEFAULT_BUCKET_MB:g}"),
                             ("timeout_s", timeout_s, f"give seconds, e.g. {DEFAULT_TIMEOUT_S:g}")):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{where}.{name}", f"must be a positive number, got {value!r}", fix)


# --------------------------------------------------------------------------------------------------
# metadata: what goes through Ray
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Slot:
    """One tensor in a bucket: its checkpoint name, shape and offset (elements) in the bucket's flat buffer."""
    name: str
    shape: tuple
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class BucketLayout:
    """The model's tensors packed into buckets of one dtype (the transfer's only bulk metadata).

    ``aliases``: ``(alias, source)`` names sent once and delivered under both (a tied ``lm_head.weight``)."""
    dtype: str
    buckets: tuple
    aliases: tuple = ()
    bucket_bytes: int = 0

    @classmethod
    def plan(cls, shapes: Sequence, dtype: str, bucket_bytes: int, aliases: Sequence = ()) -> "BucketLayout":
        """Pack ``(name, shape)`` pairs in order into buckets of at most ``bucket_bytes`` (a larger tensor alone)."""
        if dtype not in DTYPES:
            raise ValueError(f"BucketLayout: dtype must be one of {list(DTYPES)}, got {dtype!r}")
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"BucketLayout: bucket_bytes must be a positive integer, got {bucket_bytes!r}")
        size = DTYPES[dtype].itemsize
        names = [str(n) for n, _ in shapes]
        if len(set(names)) != len(names):
            raise ValueError("BucketLayout: a tensor name appears twice")
        for alias, source in aliases:
            if source not in names or alias in names:
                raise ValueError(f"BucketLayout: alias {alias!r} must name a tensor not sent, of a source that is "
                                 f"({source!r})")
        buckets, current, used = [], [], 0
        for name, shape in shapes:
            shape = tuple(int(d) for d in shape)
            n = math.prod(shape)
            if current and (used + n) * size > bucket_bytes:
                buckets.append(tuple(current))
                current, used = [], 0
            current.append(Slot(str(name), shape, used))
            used += n
        if current:
            buckets.append(tuple(current))
        return cls(dtype, tuple(buckets), tuple((str(a), str(s)) for a, s in aliases), int(bucket_bytes))

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def bucket_numel(self, i: int) -> int:
        last = self.buckets[i][-1]
        return last.offset + last.numel

    @property
    def nbytes(self) -> int:
        """Bytes one receiver gets (every bucket once)."""
        return sum(self.bucket_numel(i) for i in range(len(self.buckets))) * self.torch_dtype.itemsize

    def shapes(self) -> dict:
        """``{name: shape}`` of everything a receiver gets, aliases included."""
        out = {s.name: s.shape for b in self.buckets for s in b}
        out.update({a: out[s] for a, s in self.aliases})
        return out


def model_layout(model_dir, dtype: str, bucket_bytes: int) -> BucketLayout:
    """The layout of a checkpoint folder's weights (names and shapes from the file headers, in file order; entries
    that are not weights dropped; a tied output head sent once as the embedding and delivered as both)."""
    from bidirl.rl import model_folder as mf

    shapes = [(k, s) for k, s in mf.checkpoint_shapes(model_dir).items() if not k.endswith(mf.NON_WEIGHT_SUFFIXES)]
    names = {k for k, _ in shapes}
    tied = mf.tied_embeddings(mf.causal_lm_config(model_dir, "model_dir"))
    aliases = ()
    if tied and "lm_head.weight" not in names and "model.embed_tokens.weight" in names:
        aliases = (("lm_head.weight", "model.embed_tokens.weight"),)
    return BucketLayout.plan(shapes, dtype, bucket_bytes, aliases)


@dataclass(frozen=True)
class Transfer:
    """One transfer, as every member is told through Ray: the rendezvous, who receives (rank ``i + 1`` is
    ``receivers[i]``; rank 0 sends), the version and the layout."""
    tid: str
    address: str
    receivers: tuple
    version: int
    layout: BucketLayout
    timeout_s: float = DEFAULT_TIMEOUT_S

    def rank_of(self, name: str) -> int:
        return self.receivers.index(name) + 1


# --------------------------------------------------------------------------------------------------
# the driver's end: a fresh rendezvous per transfer
# --------------------------------------------------------------------------------------------------

def _node_ip() -> str:
    try:
        import ray
        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:
        pass
    return "127.0.0.1"


class Rendezvous:
    """The driver's side of every transfer: a ``TCPStore`` of its own per transfer (the members connect to it; it
    carries the handshake and the pairs' addresses), and the marks of members the driver knows dead."""

    def __init__(self, host: Optional[str] = None):
        self.host = host
        self._stores: dict = {}           # tid -> (store under the transfer's prefix, its TCPStore, Transfer, opened)
        self._ids = itertools.count()

    def open(self, receivers: Sequence[str], version: int, layout: BucketLayout,
             timeout_s: float = DEFAULT_TIMEOUT_S) -> Transfer:
        import torch.distributed as dist

        if not receivers:
            raise ValueError("Rendezvous.open: a transfer needs at least one receiver")
        host = self.host or _node_ip()
        server = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=timeout_s))
        tid = f"w{next(self._ids)}"
        transfer = Transfer(tid, f"{host}:{server.port}", tuple(receivers), int(version), layout, float(timeout_s))
        self._stores[tid] = (dist.PrefixStore(tid, server), server, transfer, time.monotonic())
        return transfer

    def started(self, tid: str) -> bool:
        """Whether the sender began serving anyone (a ``go`` was given): a sender lost before that can be replaced
        and the receivers keep waiting; one lost after it leaves them with a broken stream."""
        entry = self._stores.get(tid)
        if entry is None:
            return True
        store, _, transfer, _ = entry
        return any(store.check([f"go/{r}"]) for r in range(1, len(transfer.receivers) + 1))

    def gone(self, tid: str, rank: int) -> None:
        """Mark member ``rank`` dead: its peers stop waiting for it."""
        entry = self._stores.get(tid)
        if entry is not None:
            entry[0].set(f"gone/{rank}", "marked by the driver")

    def close(self, tid: str) -> None:
        self._stores.pop(tid, None)

    def close_stale(self) -> None:
        """Close the rendezvous of transfers whose members have all given up by now (past their timeouts)."""
        now = time.monotonic()
        for tid, (_, _, transfer, opened) in list(self._stores.items()):
            if now - opened > 3 * transfer.timeout_s + 60:
                self.close(tid)

    def close_all(self) -> None:
        self._stores.clear()

    @property
    def open_transfers(self) -> list:
        return sorted(self._stores)


# --------------------------------------------------------------------------------------------------
# the members' ends
# --------------------------------------------------------------------------------------------------

#: threads given up while they waited on a pair group (forming it, or an operation on it), with their groups:
#: destroying a group with a pending operation blocks until gloo's own timeout ends it, so they are kept here until
#: the thread is done
_ABANDONED: list = []


def _forget_finished() -> None:
    """Drop abandoned groups whose waiting thread has ended; one given up with an operation that no thread waits on
    is kept for the process's life (a receiver that failed is restarted, so at most one per failure)."""
    _ABANDONED[:] = [(g, t) for g, t in _ABANDONED if t is None or t.is_alive()]


def _in_thread(fn, name: str):
    """Run ``fn`` in a daemon thread; returns the thread and a box that gets ``value`` or ``error``. Blocking gloo
    calls run so (forming a group, ``wait`` on a point-to-point operation — gloo's report completion only through
    ``wait``, and a ``wait`` that times out breaks its whole group), beside a caller that polls the rendezvous."""
    import threading

    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except Exception as exc:
            box["error"] = exc
    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, box


def form_eagerly(group, device) -> None:
    """Form ``group``'s communicator now, with a one-element all-reduce, instead of inside its first send or gather
    (NCCL forms a communicator lazily, on the thread of its first operation, where nothing polls the driver's marks
    of dead peers). The caller runs it where a wait is polled (a pair: :func:`_in_thread` under
    :meth:`_Member._wait`; a gang's groups: right after they are made, every rank at once). The same code on gloo
    (whose pairs connect when the group is made: the all-reduce then only checks the pair works)."""
    work = group.allreduce([torch.zeros(1, device=device)])
    while not work.is_completed():             # a non-blocking NCCL communicator reports its progress so
        time.sleep(_POLL_S)
    work.wait()


def _abandon(group, thread, backend: str) -> None:
    """Give a pair group up: keep it (and the thread waiting on it) in :data:`_ABANDONED` until the thread ends, and
    abort an NCCL communicator at once, so the pending operation is released instead of timing out in NCCL's
    watchdog, which ends the process (``ProcessGroupNCCL`` abort; unrun here: no GPU). Gloo's ``abort`` does not
    release a pending ``wait`` (measured with torch 2.13: a ``recv`` still blocked 10 s after it), so a gloo group
    is only kept until gloo's own timeout ends its thread."""
    if isinstance(group, dict):                # a pair still forming: its group, once made (``_Member._pair``)
        group = group.get("group")
    _ABANDONED.append((group, thread))
    if backend == "nccl" and group is not None:
        try:
            group.abort()
        except Exception:
            pass


def _first_line(exc: Exception) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:200]


def _device_id(device: torch.device) -> str:
    """What tells two members whether they share a GPU: the CUDA device's UUID (``cpu`` on CPU)."""
    if device.type != "cuda":
        return "cpu"
    return str(torch.cuda.get_device_properties(device).uuid)


class _Member:
    """Common to both ends: the rendezvous client, marks, pair groups and the polled waits."""

    def __init__(self, transfer: Transfer, rank: int, device):
        _forget_finished()
        self.transfer, self.rank = transfer, int(rank)
        self.device = torch.device(device)
        self.timeout = datetime.timedelta(seconds=transfer.timeout_s)
        self.store = self._client()

    def _client(self):
        """A client of the transfer's rendezvous, under its prefix. The marks are polled over the member's own
        client; a pair forms over another (module docstring: a client is blocked while a call of it waits)."""
        import torch.distributed as dist

        host, port = self.transfer.address.rsplit(":", 1)
        try:
            return dist.PrefixStore(self.transfer.tid, dist.TCPStore(host, int(port), is_master=False,
                                                                      timeout=self.timeout))
        except Exception as exc:
            raise WeightTransferError(f"weight transfer {self.transfer.tid}: cannot reach the rendezvous at "
                                      f"{self.transfer.address} ({_first_line(exc)})") from None

    def _marked(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except Exception:          # the driver closed the rendezvous: the transfer is over either way
            return False

    def _mark(self, key: str, value: str = "1") -> None:
        try:
            self.store.set(key, value)
        except Exception:
            pass

    def _pair(self, peer: int, backend: str, holder: Optional[dict] = None):
        """The two-rank group of this member and ``peer`` (the sender is rank 0 of every pair), its communicator
        formed (:func:`form_eagerly`); ``holder["group"]`` is the group as soon as it is made, so a wait that gives
        up on the forming can abort it."""
        import torch.distributed as dist

        r = peer if self.rank == 0 else self.rank
        store = dist.PrefixStore(f"pair/{r}", self._client())     # not self.store: its polls must not wait on this
        me = 0 if self.rank == 0 else 1
        if backend == "nccl":          # GPU-only branch (unverified here: no GPU)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            opts.config.blocking = 0   # a non-blocking communicator: its forming can be polled and aborted
            group = dist.ProcessGroupNCCL(store, me, 2, opts)
        else:
            group = dist.ProcessGroupGloo(store, me, 2, self.timeout)
        if holder is not None:
            holder["group"] = group
        form_eagerly(group, self.device if backend == "nccl" else torch.device("cpu"))
        return group

    def _wait(self, thread, box, gone: Sequence[str], limit: float, what: str, group=None,
              backend: str = "gloo") -> Optional[str]:
        """Wait for a thread of :func:`_in_thread` (forming a pair, or waiting on an operation); ``None`` when it
        finished without error, else why not — an error, a mark in ``gone``, or ``limit`` seconds. A thread
        given up on stays in :data:`_ABANDONED` with its group until it ends (:func:`_abandon`)."""
        deadline = time.monotonic() + limit
        while thread.is_alive():
            thread.join(_MARK_POLL_S)
            if not thread.is_alive():
                break
            marked = [k for k in gone if self._marked(k)]
            if marked or time.monotonic() > deadline:
                _abandon(group, thread, backend)
                return f"{what}: {marked[0].replace('gone/', 'rank ')} is gone" if marked else \
                    f"{what}: no progress for {limit:g} s"
        if "error" in box:
            return f"{what}: {_first_line(box['error'])}"
        return None

    def _finish(self, group, work, peer: int, what: str, backend: str = "gloo", patience: float = 1.0) -> Optional[str]:
        """Wait for ``work`` on ``group`` with ``peer``; ``None`` when it completed, else why it did not (the peer
        marked gone, an error, or ``patience`` timeouts without progress) — the group is then abandoned."""
        limit = patience * self.transfer.timeout_s
        if backend != "nccl":
            thread, box = _in_thread(work.wait, "bidirl-weight-transfer-wait")
            return self._wait(thread, box, [f"gone/{peer}"], limit, what, group, backend)
        # GPU-only branch (unverified here): NCCL work reports completion itself, and wait() would not block
        deadline = time.monotonic() + limit
        next_mark = time.monotonic() + _MARK_POLL_S
        while not work.is_completed():
            now = time.monotonic()
            if now >= next_mark:
                if self._marked(f"gone/{peer}"):
                    _abandon(group, None, backend)
                    return f"{what}: rank {peer} is gone"
                next_mark = now + _MARK_POLL_S
            if now > deadline:
                _abandon(group, None, backend)
                return f"{what}: no progress for {limit:g} s"
            time.sleep(_POLL_S)
        try:
            work.wait()
        except Exception as exc:
            return f"{what}: {_first_line(exc)}"
        return None


class Sender(_Member):
    """Rank 0 of a transfer: waits for the receivers at the rendezvous, then sends each bucket to every live one."""

    def __init__(self, transfer: Transfer, device):
        super().__init__(transfer, 0, device)
        self.pairs: dict = {}             # receiver rank -> (group, backend)
        self.failed: dict = {}            # receiver rank -> why it was dropped
        self.bytes = 0
        self.handshake_seconds = 0.0

    def connect(self) -> list:
        """Wait until every receiver is ready or marked gone (those still missing after the timeout are dropped
        and marked gone), then form the pairs with the ready ones, all at once; returns the ranks served."""
        t0 = time.monotonic()
        pending = set(range(1, len(self.transfer.receivers) + 1))
        deadline = t0 + self.transfer.timeout_s
        ready: dict = {}
        pause = _backoff()
        while pending:
            for r in sorted(pending):
                if self._marked(f"gone/{r}"):
                    self.failed[r] = "gone before the transfer began"
                    pending.discard(r)
                elif self._marked(f"ready/{r}"):
                    ready[r] = self.store.get(f"ready/{r}").decode()
                    pending.discard(r)
            if pending and time.monotonic() > deadline:
                for r in sorted(pending):
                    self.failed[r] = f"not ready within {self.transfer.timeout_s:g} s"
                    self._mark(f"gone/{r}", "not ready in time")
                break
            if pending:
                next(pause)
        mine = _device_id(self.device)
        forming = {}
        for r, theirs in sorted(ready.items()):
            # NCCL between two GPUs; gloo on CPU, and through the host for a receiver on this very GPU
            backend = "nccl" if self.device.type == "cuda" and theirs not in ("cpu", mine) else "gloo"
            self._mark(f"go/{r}", backend)
            holder: dict = {}
            forming[r] = (backend, holder, *_in_thread(lambda r=r, b=backend, h=holder: self._pair(r, b, h),
                                                       "bidirl-weight-pair"))
        for r, (backend, holder, thread, box) in forming.items():
            why = self._wait(thread, box, [f"gone/{r}"], self.transfer.timeout_s, "forming its pair", holder, backend)
            if why is None:
                self.pairs[r] = (box["value"], backend)
            else:
                self.failed[r] = why
        self.handshake_seconds = time.monotonic() - t0
        return sorted(self.pairs)

    @property
    def live(self) -> list:
        return sorted(self.pairs)

    def post(self, index: int, flat: torch.Tensor) -> tuple:
        """Start sending bucket ``index`` (a flat tensor of the layout's dtype) to every live receiver; returns what
        :meth:`complete` waits for (the caller may gather the next bucket meanwhile)."""
        works = {}
        for r, (group, backend) in sorted(self.pairs.items()):
            data = flat if backend == "nccl" else flat.cpu()
            try:
                works[r] = (group, group.send([data], 1, index), data, backend)
            except Exception as exc:
                self._drop(r, f"bucket {index}: {_first_line(exc)}")
        return index, works

    def complete(self, posted: tuple) -> None:
        """Wait for a posted bucket to reach every receiver; a receiver that fails is dropped, the others go on."""
        index, works = posted
        for r, (group, work, data, backend) in works.items():
            if r not in self.pairs:
                continue
            why = self._finish(group, work, r, f"bucket {index}", backend)
            if why is None:
                self.bytes += data.numel() * data.element_size()
            else:
                self._drop(r, why)

    def send(self, index: int, flat: torch.Tensor) -> None:
        """Send bucket ``index`` to every live receiver and wait for it (:meth:`post` then :meth:`complete`)."""
        self.complete(self.post(index, flat))

    def _drop(self, r: int, why: str) -> None:
        self.pairs.pop(r, None)
        self.failed[r] = why
        self._mark(f"gone/{r}", why[:200])          # it must not wait for more buckets

    def close(self) -> dict:
        self.pairs.clear()
        return {"served": len(self.transfer.receivers) - len(self.failed),
                "failed": {self.transfer.receivers[r - 1]: why for r, why in sorted(self.failed.items())},
                "bytes": self.bytes, "handshake_seconds": self.handshake_seconds}


class Receiver(_Member):
    """A receiving member (rank ``rank`` of the transfer): joins, then yields each bucket's tensors as it arrives."""

    def __init__(self, transfer: Transfer, rank: int, device):
        if not 1 <= rank <= len(transfer.receivers):
            raise ValueError(f"Receiver: rank must be in [1, {len(transfer.receivers)}], got {rank}")
        super().__init__(transfer, rank, device)
        self.group = None
        self.backend = None
        self.buckets = 0
        self.bytes = 0
        self.wait_seconds = 0.0

    def _fail(self, why: str):
        self._mark(f"gone/{self.rank}", why[:200])          # the sender stops waiting for this member
        if self.group is not None:                           # it may hold a posted receive: never destroyed here
            _abandon(self.group, None, self.backend)
        self.group = None
        return WeightTransferError(f"weight transfer {self.transfer.tid} (version {self.transfer.version}), "
                                   f"receiver {self.rank}: {why}")

    def abandon(self, why: str) -> None:
        """Leave before joining (this member cannot take the weights): the sender stops waiting for it."""
        self._mark(f"gone/{self.rank}", why[:200] or "1")

    def connect(self) -> None:
        """Announce readiness, wait for the sender's go (or its loss, or being dropped), form the pair. The sender
        may be busy for a while (it finishes its current work first): up to the transfer's timeout."""
        t0 = time.monotonic()
        self._mark(f"ready/{self.rank}", _device_id(self.device))
        keys = [f"go/{self.rank}", f"gone/{self.rank}", "gone/0"]
        deadline = t0 + self.transfer.timeout_s
        pause = _backoff()
        while True:
            found = [k for k in keys if self._marked(k)]
            if found or time.monotonic() > deadline:
                break
            next(pause)
        if f"go/{self.rank}" not in found:
            why = ("the sender is gone" if "gone/0" in found else "the sender dropped this receiver" if found
                   else f"the sender did not begin within {self.transfer.timeout_s:g} s")
            raise self._fail(why + " (nothing was loaded)")
        self.backend = self.store.get(f"go/{self.rank}").decode()
        holder: dict = {}
        thread, box = _in_thread(lambda: self._pair(0, self.backend, holder), "bidirl-weight-pair")
        why = self._wait(thread, box, ["gone/0", f"gone/{self.rank}"], self.transfer.timeout_s,
                         "forming the pair with the sender", holder, self.backend)
        if why is not None:
            raise self._fail(why + " (nothing was loaded)")
        self.group = box["value"]
        self.wait_seconds = time.monotonic() - t0

    def items(self) -> Iterator:
        """``(name, tensor)`` for every tensor of the layout (aliases too), bucket by bucket as they arrive. Each
        bucket is a fresh buffer (a loader may hold a tensor until its layer is complete); tensors are views of it
        on the pair's device (the host for gloo). Raises :class:`WeightTransferError` if the sender fails."""
        if self.group is None:
            raise RuntimeError("Receiver.items: connect() first")
        layout = self.transfer.layout
        aliases: dict = {}
        for alias, source in layout.aliases:
            aliases.setdefault(source, []).append(alias)
        device = self.device if self.backend == "nccl" else torch.device("cpu")
        n = len(layout.buckets)

        def post(i: int):
            buf = torch.empty(layout.bucket_numel(i), dtype=layout.torch_dtype, device=device)
            try:
                return buf, self.group.recv([buf], 0, i)
            except Exception as exc:        # gloo refuses at once on a connection its peer closed (a killed sender)
                raise self._fail(f"broke off after {i} of {n} buckets: {_first_line(exc)}") from None
        ahead = post(0)
        for i, bucket in enumerate(layout.buckets):
            buf, work = ahead
            # the sender may spend up to a timeout on another receiver that died before it sends the next bucket
            why = self._finish(self.group, work, 0, f"bucket {i}", self.backend, patience=2.0)
            if why is not None:
                raise self._fail(f"broke off after {i} of {n} buckets: {why}")
            # the next bucket arrives while this one is loaded (two buffers in flight at most)
            ahead = post(i + 1) if i + 1 < n else None
            self.buckets += 1
            self.bytes += buf.numel() * buf.element_size()
            for slot in bucket:
                view = buf.narrow(0, slot.offset, slot.numel).view(slot.shape)
                yield slot.name, view
                for alias in aliases.get(slot.name, ()):
                    yield alias, view

    def close(self) -> dict:
        self.group = None
        return {"buckets": self.buckets, "bytes": self.bytes, "wait_seconds": self.wait_seconds,
                "backend": self.backend}


def send_buckets(transfer: Transfer, rank: int, gather: Callable, device, broadcast: Optional[Callable] = None,
                 agree: Optional[Callable] = None) -> dict:
    """Send ``transfer`` from a gang: every rank of the gang calls this with its ``rank`` in the gang.

    ``gather(names) -> [full tensor]`` returns the full tensors of those names in the layout's dtype (a collective on
    a sharded gang: every rank calls it, bucket by bucket, in the layout's order); ``broadcast(n) -> n`` shares
    rank 0's count of live receivers with the gang (``None``: a gang of one); ``agree(transfer)``, the gang's first
    collective of the transfer, checks every rank runs this one (:func:`check_same_transfer`; ``None``: a gang of
    one). Rank 0 runs the rendezvous and sends; the others only gather. Returns rank 0's report (bytes sent,
    receivers dropped and why, seconds)."""
    t0 = time.monotonic()
    if agree is not None:
        agree(transfer)
    sender = None
    error = None
    live = 0
    if rank == 0:
        try:
            sender = Sender(transfer, device)
            live = len(sender.connect())
        except Exception as exc:         # the gang stays consistent: it learns there is no one to send to
            error, live = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}", 0
    if broadcast is not None:
        live = broadcast(live)
    gather_s = send_s = 0.0
    if live:
        posted = None
        for i, bucket in enumerate(transfer.layout.buckets):
            tg = time.monotonic()
            tensors = gather([s.name for s in bucket])          # overlaps the previous bucket's sends
            gather_s += time.monotonic() - tg
            if sender is not None:
                ts = time.monotonic()
                flat = torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) > 1 else tensors[0].reshape(-1)
                if posted is not None:
                    sender.complete(posted)
                posted = sender.post(i, flat) if sender.live else None
                send_s += time.monotonic() - ts
            del tensors
        if posted is not None:
            ts = time.monotonic()
            sender.complete(posted)
            send_s += time.monotonic() - ts
    report = {"tid": transfer.tid, "version": transfer.version, "receivers": len(transfer.receivers),
              "buckets": len(transfer.layout.buckets), "bytes_per_receiver": transfer.layout.nbytes,
              "dtype": transfer.layout.dtype, "gather_seconds": gather_s, "send_seconds": send_s,
              "seconds": time.monotonic() - t0}
    if sender is not None:
        report.update(sender.close())
    if error is not None:
        report.update(served=0, failed={name: error for name in transfer.receivers}, bytes=0)
    return report


def effective_weights(worker) -> dict:
    """The weights a vLLM worker computes with, read back through its own layers (run it on the worker through
    ``collective_rpc``; for tests and benchmarks). vLLM's CPU backend keeps linear weights packed where they cannot
    be read, so a linear layer's weight is read as its output for the identity matrix without bias — exact in
    fp32 (each output entry is one product by 1 plus products by 0); every other parameter as it is. Names are
    vLLM's (fused ``qkv_proj`` / ``gate_up_proj``), values on the host."""
    model = worker.model_runner.get_model()
    out: dict = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            method, weight = getattr(module, "quant_method", None), getattr(module, "weight", None)
            size = getattr(module, "input_size_per_partition", None)
            if method is None or weight is None or size is None or not hasattr(method, "apply"):
                continue
            device = next((p.device for p in model.parameters() if p.numel()), torch.device("cpu"))
            eye = torch.eye(int(size), dtype=weight.dtype, device=device)
            out[f"{name}.weight"] = method.apply(module, eye, None).t().contiguous().cpu()
        for name, p in model.named_parameters():
            if name not in out and p.numel() > 0:
                out[name] = p.detach().to("cpu", copy=True)
    return out
