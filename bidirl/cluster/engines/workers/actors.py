"""Thin Ray actor wrappers around the engines: one engine per actor, every call timed as a span.

The engine driver (:mod:`bidirl.cluster.engines.driver`) hosts a
:class:`~bidirl.cluster.engines.workers.rollout.RolloutEngine` in a
``RolloutActor`` and a :class:`~bidirl.cluster.engines.workers.trainer.TrainerEngine` in a ``TrainerActor``. The
wrappers add nothing but remote access and self-recorded spans: each method returns a :class:`Reply`
whose ``spans`` list the work it did as ``{"worker", "kind", "start", "end", "detail"}`` records in
wall-clock seconds (``time.time()``), so the driver places them on its timeline without asking Ray
(``ray.timeline()`` is only for cross-checks). Span kinds: ``generate``, ``interrupt``, ``sync``
(weight load), ``offload`` / ``onload`` (the two halves of a hot switch, §3.2), ``logprob``, ``chunk``,
``optimizer``, ``start`` (engine construction).

A ``RolloutActor``'s engine runs free of the driver: :meth:`RolloutActor.stream` is a Ray streaming generator in the
actor's own concurrency group that steps the engine back to back and yields finished groups as they finish; the
other calls run in the order sent and pause it (keeping the engine's requests) while they hold the engine.

``num_cpus`` is always set (DESIGN.md): pass ``RolloutActor.options(num_cpus=..., resources=...)`` to
place an actor on a pool's bundle.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import ray


@dataclass(frozen=True)
class Reply:
    """What an actor method returns: its value and the spans it recorded."""
    value: Any
    spans: tuple = field(default_factory=tuple)


class _Timed:
    """Common to both actors: a worker name, timed replies, and the hot-switch state moves of ``self.engine``."""

    def __init__(self, name: str):
        self.name = name

    def offload(self) -> Reply:
        return self._reply("offload", self.engine.offload)

    def onload(self) -> Reply:
        return self._reply("onload", self.engine.onload)

    def _reply(self, kind: str, fn, *args, detail: Optional[dict] = None, **kwargs) -> Reply:
        start = time.time()
        value = fn(*args, **kwargs)
        end = time.time()
        return Reply(value, ({"worker": self.name, "kind": kind, "start": start, "end": end,
                              "detail": dict(detail or {})},))


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off while a worker starts. A start creates millions of objects that live as
    long as the process (the imports of torch, transformers and vLLM, the engine's set-up) and makes hardly any
    garbage, yet the collector walks the growing heap again and again meanwhile: ≈ 1.3 s of CPU of a rollouter's
    ≈ 10 s start, ≈ 1.4 s of a trainer rank's (measured by process time on a 2-core CPU machine). Explicit
    ``gc.collect()`` calls inside (vLLM's own) still run."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@ray.remote(num_cpus=1, concurrency_groups={"stream": 1})
class RolloutActor(_Timed):
    """A rollout replica: ``RolloutEngine(**engine_kwargs)`` inside a Ray actor.

    Its engine runs free: :meth:`stream` (concurrency group ``stream``, a Ray streaming generator) steps the engine
    back to back while it holds requests and yields each finished group as soon as it finishes, so the engine never
    waits for the driver between steps. Every other call runs in the default group, one at a time in the order sent
    (the driver relies on it), and holds the engine for its whole run: the stream's loop pauses after the step it is
    in, keeping the engine's requests, and goes on once the call has returned. Every engine access holds one lock
    (vLLM's engine is not thread-safe); a call waiting for it goes before the loop's next step."""

    def __init__(self, name: str, model_dir: str, seed: int = 0, **engine_kwargs):
        super().__init__(name)
        self._engine_lock = threading.Lock()       # held by every engine access
        self._calls = threading.Condition()        # guards _waiting; wakes a paused stream loop
        self._waiting = 0                          # calls waiting for or holding the engine (the loop yields to them)
        self._started = 0                          # the sequence number of the last start call applied
        self._reports = 0                          # reports made (_report): numbers them in the order they were made
        start = time.time()
        with _collector_paused():
            from bidirl.cluster.engines.workers.rollout import RolloutEngine
            self.engine = RolloutEngine(model_dir, seed=seed, **engine_kwargs)
        self._start_span = {"worker": name, "kind": "start", "start": start, "end": time.time(),
                            "detail": {"kv_cache_tokens": self.engine.kv_cache_tokens}}

    @contextlib.contextmanager
    def _exclusive(self):
        """Hold the engine for one call: a running stream pauses after its current step, keeping its requests."""
        with self._calls:
            self._waiting += 1
        try:
            with self._engine_lock:
                yield
        finally:
            with self._calls:
                self._waiting -= 1
                self._calls.notify_all()

    def _reply(self, kind: str, fn, *args, detail: Optional[dict] = None, **kwargs) -> Reply:
        with self._exclusive():
            return super()._reply(kind, fn, *args, detail=detail, **kwargs)

    def _report(self, **detail) -> dict:
        """``detail`` plus whether the engine holds requests, the last start applied and the report's number (in the
        order the reports were made: a driver tells a stale one). Call with the engine held."""
        self._reports += 1
        return dict(detail, busy=self.engine.busy, starts=self._started, report=self._reports)

    def ready(self) -> Reply:
        return Reply(self.engine.start_seconds, (self._start_span,))

    def onload(self, kv: bool = True) -> Reply:
        """Both phases of the switch-in, or (``kv=False``) the weights phase only (``RolloutEngine.onload``)."""
        return self._reply("onload", self.engine.onload, kv, detail={"kv": kv})

    def start(self, requests: Sequence, seq: Optional[int] = None) -> Reply:
        """Add groups. ``seq`` numbers the driver's start calls on this actor (default: one more than the last):
        :meth:`stream` and every reply report the last one applied, so the driver knows whether a reply saw them."""
        def run():
            self._started = self._started + 1 if seq is None else int(seq)     # first: even a refused start counts
            return self.engine.start(list(requests))
        return self._reply("generate", run, detail={"phase": "submit", "groups": len(requests)})

    @ray.method(concurrency_group="stream", num_returns="streaming")
    def stream(self, starts: int = 0, report_seconds: Optional[float] = None):
        """Run the engine while it holds requests; yield a :class:`Reply` each time groups finish, and end once it
        holds none (after start ``starts`` has been applied: a stream sent right behind a start waits for it).

        Each reply's value is ``{"groups": the groups that finished, "busy": whether requests are left, "starts":
        the last start applied, "report": its number}`` (:meth:`_report`) and its spans are the ``generate`` spans
        since the previous reply: one per run of back-to-back steps (``steps``, ``completed``, ``busy``), split where
        a call paused the loop. The last reply has ``busy`` False. With ``report_seconds`` a reply also comes after
        that long without one (its spans keep the driver's timeline current; the engine does not wait for it). A Ray
        streaming generator in the ``stream`` concurrency group: ``actor.stream.remote()`` returns an
        ``ObjectRefGenerator``."""
        e = self.engine
        spans, groups, run = [], [], None
        last = time.time()

        def close():
            nonlocal run
            if run is not None:
                spans.append({"worker": self.name, "kind": "generate", "start": run.pop("start"),
                              "end": run.pop("end"), "detail": dict(run, stream=True)})
                run = None
        while True:
            with self._calls:
                while self._waiting or self._started < starts:
                    close()                                   # the loop pauses here: the span ends at its last step
                    self._calls.wait()
            with self._engine_lock:
                t0 = time.time()
                before = e.steps
                done = e.step_until(max_steps=1)               # one step (none if no request is in flight)
                t1 = time.time()
                stepped, report = e.steps - before, self._report()
            if stepped:
                if run is None:
                    run = {"start": t0, "steps": 0, "completed": 0}
                run.update(end=t1, steps=run["steps"] + stepped, completed=run["completed"] + len(done),
                           busy=report["busy"])
            groups += done
            if groups or not report["busy"] or (report_seconds is not None and t1 - last >= report_seconds):
                close()
                yield Reply(dict(report, groups=groups), tuple(spans))
                if not report["busy"]:
                    return
                spans, groups, last = [], [], t1

    def step_until(self, min_groups: Optional[int] = None, max_steps: Optional[int] = None,
                   max_seconds: Optional[float] = None) -> Reply:
        """Run engine steps; stops once ``min_groups`` groups completed (or the step / time budget). The polled
        alternative to :meth:`stream` (tests and the streaming benchmark's baseline)."""
        stop = None if min_groups is None else (lambda done: len(done) >= min_groups)

        def run():
            before = self.engine.steps
            done = self.engine.step_until(stop=stop, max_steps=max_steps, max_seconds=max_seconds)
            return done, self._report(steps=self.engine.steps - before, completed=len(done))
        reply = self._reply("generate", run)
        (done, detail), spans = reply.value, reply.spans
        spans[0]["detail"].update(detail)
        return Reply(done, spans)

    def interrupt(self, group_ids: Optional[Sequence[int]] = None) -> Reply:
        """Stop the listed groups (``None``: all); groups already returned as complete are skipped. A stream in
        flight pauses for it and goes on with the other groups."""
        def run():
            stopped = self.engine.interrupt(group_ids, missing_ok=True)
            return stopped, self._report(stopped=len(stopped))
        reply = self._reply("interrupt", run)
        (stopped, detail), spans = reply.value, reply.spans
        spans[0]["detail"].update(detail)
        return Reply(stopped, spans)

    def load_weights(self, state_dict, version: Optional[int] = None) -> Reply:
        return self._reply("sync", self.engine.load_weights, state_dict, version, detail={"version": version})

    def receive_weights(self, transfer, rank: int) -> Reply:
        """Load ``transfer.version`` from the trainer gang over the weight transport (receiver ``rank``)."""
        return self._reply("sync", self.engine.receive_weights, transfer, rank,
                           detail={"version": transfer.version, "transport": "collective"})

    def reset(self, reward_fn=None) -> Reply:
        """A fresh engine's state again, scoring with the new run's ``reward_fn`` (a new run on kept workers:
        ``PoolDriver.workers``); start numbers begin again at 1."""
        def run():
            self._started = 0
            return self.engine.reset(reward_fn)
        return self._reply("reset", run)

    def effective_weights(self) -> dict:
        """The weights vLLM computes with, read back through its own layers (``weight_transport.effective_weights``;
        for tests and benchmarks: a copy of the model, made only when asked)."""
        from bidirl.cluster.engines.workers.weight_transport import effective_weights
        with self._exclusive():
            return self.engine.llm.collective_rpc(effective_weights)[0]

    def status(self) -> dict:
        with self._exclusive():
            e = self.engine
            return {"busy": e.busy, "groups": e.group_ids, "version": e.version, "steps": e.steps,
                    "generated_tokens": e.generated_tokens, "offloaded": e.offloaded, "starts": self._started}


@ray.remote(num_cpus=1, concurrency_groups={"transport": 1, "snapshot": 1})
class TrainerActor(_Timed):
    """One trainer rank: ``TrainerEngine(**engine_kwargs)`` inside a Ray actor. Calls run one at a time in the order
    sent, except :meth:`send_weights` and :meth:`receive_window`, which run on a thread of their own (concurrency
    group ``transport``) beside them: a rollouter's weight load never waits for the chunk the gang is running, nor
    an auxiliary window for the primary's; and :meth:`flush_snapshot` (group ``snapshot``), which waits for a
    recovery snapshot's write while the gang goes on training."""

    def __init__(self, name: str, model_dir: str, **engine_kwargs):
        super().__init__(name)
        start = time.time()
        with _collector_paused():
            from bidirl.cluster.engines.workers.trainer import TrainerEngine
            self.engine = TrainerEngine(model_dir, **engine_kwargs)
        self._kept: dict = {}
        self._start_span = {"worker": name, "kind": "start", "start": start, "end": time.time(), "detail": {}}

    def ready(self) -> Reply:
        return Reply(self.engine.role, (self._start_span,))

    def reset(self) -> Reply:
        """A fresh engine's state again (a new run on kept workers: ``PoolDriver.workers``)."""
        self._kept.clear()
        return self._reply("reset", self.engine.reset)

    def address(self) -> str:
        """The ``host:port`` of a gang's rendezvous, opened on this actor's node (called on rank 0): a store
        listening on a port the OS picked as it bound, held until the gang has joined through it
        (``TrainerEngine.listen``)."""
        import ray
        return self.engine.listen(ray.util.get_node_ip_address())

    def init_process_group(self, rank: int, world: int, addr: str, replicas: int = 1) -> Reply:
        """Join the gang (rank ``rank`` of ``world``) and shard the model over ``replicas`` replicas (FSDP2)."""
        return self._reply("start", self.engine.init_process_group, rank, world, addr, replicas=replicas,
                           detail={"rank": rank, "world": world, "replicas": replicas})

    def logprobs(self, samples: Sequence, model: str = "actor", compare: bool = False) -> Reply:
        """The samples' per-token log-probs. With route replay on, the span's detail says how many tokens' routes
        the forward replayed (``replayed_tokens``); ``compare`` runs the forward again without the replay and adds
        each sample's largest gap to the rollout's log-probs there (``gap_without_replay``; R3's comparison)."""
        from bidirl.cluster.engines.workers.trainer.replay import replay_detail

        samples = list(samples)
        before = self.engine.route_replay_counts()["tokens"]
        reply = self._reply("logprob", self.engine.logprobs, samples, model,
                            detail={"model": model, "samples": len(samples)})
        reply.spans[0]["detail"].update(replay_detail(self.engine, samples, before, compare, model))
        return reply

    # The engine driver's gradient path: a primary gang accumulates each chunk's gradient into its ranks' sharded
    # p.grad on their devices (nothing leaves the gang, nothing goes to the host). An auxiliary gang does the same
    # over its window and, when the window ends, each rank sends its shard to the primary ranks holding it
    # (send_window / receive_window: C_grad, once per window, shard to shard;
    # bidirl.cluster.engines.workers.bridge). With
    # transport.weights: object_store an auxiliary gang instead gathers each chunk gradient unsharded and returns
    # it as one object, which the merge moves to the primary ranks (each adds its shard).
    @ray.method(num_returns=2)
    def chunk_gradient(self, chunk_id: int, samples: Sequence, advantages, old_logprobs, ref_logprobs=None,
                       normalizer: Optional[float] = None, keep: bool = True, give: bool = False,
                       position: Optional[tuple] = None):
        """``chunk_gradients`` for this rank's share of a chunk: returns (Reply with the loss statistics,
        the gradient if ``give`` else None). ``keep`` accumulates this rank's shard into its ``p.grad`` under
        ``chunk_id`` (a chunk id accumulated twice is refused: it would count twice); without ``keep`` (an
        auxiliary gang: every rank calls it so) the gang gathers the full gradient, which ``give`` returns.
        ``position`` (``(first unit, units)``, with ``keep``): the step's gradient is summed in unit order
        (``TrainerEngine.chunk_gradients``)."""
        def run():
            if keep:
                if int(chunk_id) in self.engine.accumulated:
                    raise RuntimeError(f"{self.name}: chunk {chunk_id} was already accumulated into this step's "
                                       "gradient; a chunk counts once")
                g = self.engine.chunk_gradients(list(samples), advantages, old_logprobs, ref_logprobs, normalizer,
                                                accumulate=True, chunk_id=int(chunk_id), position=position)
                out = None
            else:
                g = self.engine.chunk_gradients(list(samples), advantages, old_logprobs, ref_logprobs, normalizer)
                out = self.engine.full_gradient(g.flat)
            return dict(g.stats, samples=g.samples, tokens=g.tokens, passes=self.engine.passes_run - passes,
                        replayed_tokens=self.engine.route_replay_counts()["tokens"] - before), out
        before, passes = self.engine.route_replay_counts()["tokens"], self.engine.passes_run
        reply = self._reply("chunk", run, detail={"chunk_id": chunk_id, "samples": len(samples)})
        stats, flat = reply.value
        return Reply(stats, reply.spans), (flat if give else None)

    def receive_gradient(self, chunk_id: int, flat) -> Reply:
        """Keep this rank's shard of another gang's full chunk gradient under its chunk id (the receiving end
        of C_grad); it is added to the accumulated gradient at the optimizer step."""
        def run():
            self._kept[int(chunk_id)] = self.engine.local_gradient(flat)
            return int(flat.numel())
        return self._reply("grad_merge", run, detail={"chunk_id": chunk_id})

    def shard_signature(self) -> tuple:
        """Which elements of every parameter this rank holds (pairs the gangs' ranks for the windows)."""
        return self.engine.shard_signature()

    def send_window(self, transfer, chunk_ids: Sequence[int]) -> Reply:
        """An auxiliary rank's window ends: send its gradient shard (``TrainerEngine.send_window``). It runs in
        order after the window's chunks, before the switch that offloads the gang."""
        return self._reply("grad_merge", self.engine.send_window, transfer, list(chunk_ids),
                           detail={"chunks": list(chunk_ids), "receivers": len(transfer.receivers)})

    @ray.method(concurrency_group="transport")
    def receive_window(self, transfer, rank: int, pieces=None) -> Reply:
        """A primary rank takes an auxiliary rank's window (``TrainerEngine.receive_window``) beside the chunk it
        may be running. A transfer whose sender was lost returns ``{"failed": why}`` instead of raising: this
        rank's state is intact, and the auxiliary gang's failure decides what happens to the step."""
        from bidirl.cluster.engines.workers.weight_transport import WeightTransferError

        def run():
            try:
                return self.engine.receive_window(transfer, rank, pieces)
            except WeightTransferError as exc:
                return {"tid": transfer.tid, "failed": str(exc)}
        return self._reply("grad_merge", run, detail={"tid": transfer.tid})

    def apply_kept(self, chunk_ids_in_order: Sequence[int], windows: Optional[dict] = None,
                   positions: Optional[dict] = None, final: bool = True) -> Reply:
        """``apply``: the step's gradient is the chunks accumulated here, the received ones and the auxiliary
        windows ``windows`` (``{transfer id: chunk ids}``), and it must hold exactly the step's update chunks
        ``chunk_ids_in_order`` (one missing or one extra would change the update); every kept gradient is
        forgotten afterwards. ``positions`` (chunk id -> (first unit, units)): the step is summed in unit order and
        the received chunk gradients are added at their places in it. ``final``: the local update's last optimizer
        update (the next version); an optimizer mini-batch's before it keeps the version (``TrainerEngine.apply``)."""
        want = [int(c) for c in chunk_ids_in_order]
        windows = {tid: [int(c) for c in ids] for tid, ids in (windows or {}).items()}
        have = list(self.engine.accumulated) + list(self._kept) + [c for ids in windows.values() for c in ids]
        missing = sorted(set(want) - set(have))
        extra = sorted(set(have) - set(want))
        if missing or extra or len(have) != len(set(have)):
            self._kept.clear()
            self.engine.discard_gradients()
            raise RuntimeError(f"{self.name}: the step's gradient does not hold exactly its update chunks "
                               f"(missing {missing}, not in the step {extra}); every update chunk must be computed "
                               "here or received once before the optimizer step")
        if positions:       # summed in unit order: the received chunk gradients take their places in it
            for c in want:
                if c in self._kept:
                    first, units = positions[c]
                    self.engine.order.hold(first, units, self._kept[c].to(self.engine.device), c)
            grads = []
        else:
            grads = [self._kept[c] for c in want if c in self._kept]
        self._kept.clear()
        return self._reply("optimizer", self.engine.apply, grads, windows, final)

    def discard_gradients(self) -> Reply:
        """Forget the gradients kept for the next optimizer step (a step that starts over)."""
        self._kept.clear()
        return self._reply("discard", self.engine.discard_gradients)

    def weights(self) -> Optional[dict]:
        """The full ``state_dict`` as a plain value, so its object ref can be handed to other actors. On a
        sharded gang every rank must be asked (the gather is a collective): rank 0 returns the weights, the
        others None."""
        return self.engine.state_dict() or None

    def load_state_dict(self, state: dict, version: Optional[int] = None) -> Reply:
        return self._reply("sync", self.engine.load_state_dict, state, version, detail={"version": version})

    # The primary gang's training state: run checkpoints (every rank writes its shards with
    # torch.distributed.checkpoint) and the snapshot after each optimizer step that a restarted gang takes back.
    def save_train_state(self, path: str) -> Reply:
        return self._reply("checkpoint", self.engine.save_train_state, path, detail={"path": path})

    def load_train_state(self, path: str, version: int) -> Reply:
        return self._reply("checkpoint", self.engine.load_train_state, path, version, detail={"version": version})

    @ray.method(num_returns=2)
    def put_version(self, weights: bool = True, publish: Optional[dict] = None):
        """Put the version an optimizer step made out for the weight loads: (Reply acknowledging it, the full
        weights on rank 0 else None). Every rank of a sharded gang must be asked (the weight gather is a
        collective); the caller owns the returned object, so it outlives this actor. ``weights=False`` gathers no
        weights (the weight transport sends them); ``publish`` (``{"dtype", "keep"}``) keeps this version for it
        (:meth:`TrainerEngine.publish`)."""
        start = time.time()
        full = (self.engine.state_dict() or None) if weights else None
        if publish is not None:
            self.engine.publish(self.engine.version, publish["dtype"], publish.get("keep", ()))
        ack = Reply({"version": self.engine.version}, ({"worker": self.name, "kind": "publish", "start": start,
                                                        "end": time.time(), "detail": {}},))
        return ack, full

    # The weight transport (bidirl.cluster.engines.workers.weight_transport): the primary gang publishes each version
    # and
    # sends it bucket by bucket (every rank gathers, rank 0 sends); an auxiliary gang's ranks receive.
    def publish(self, version: int, dtype: str, keep: Sequence[int] = ()) -> Reply:
        return self._reply("publish", self.engine.publish, version, dtype, keep, detail={"version": version})

    @ray.method(concurrency_group="transport")
    def send_weights(self, transfer) -> Reply:
        """Send a published version (``TrainerEngine.send_weights``: it reads only the published shards and gathers
        over the gang's transport group, so it runs beside the calls of the default group)."""
        return self._reply("send", self.engine.send_weights, transfer,
                           detail={"version": transfer.version, "receivers": len(transfer.receivers)})

    def receive_weights(self, transfer, rank: int) -> Reply:
        return self._reply("sync", self.engine.receive_weights, transfer, rank,
                           detail={"version": transfer.version, "transport": "collective"})

    # Recovery snapshots on the rank's own disk (bidirl.cluster.engines.trainer_recovery)
    def save_snapshot(self, folder: str, version: int) -> Reply:
        return self._reply("snapshot", self.engine.save_snapshot, folder, version, detail={"version": version})

    @ray.method(concurrency_group="snapshot")
    def flush_snapshot(self) -> dict:
        """Wait for the snapshot write (beside the calls that train) and report it; ``{"error": why}`` if the file
        could not be written (a full or missing ``recovery.snapshot_dir``: the run stops and says so)."""
        try:
            return self.engine.flush_snapshot()
        except OSError as exc:
            return {"error": str(exc)}

    def drop_snapshots(self, folder: str) -> None:
        """Delete a finished run's snapshot folder on this rank's node."""
        import shutil
        self.engine.flush_snapshot()
        shutil.rmtree(folder, ignore_errors=True)

    def load_snapshot(self, folder: str, version: int) -> Reply:
        return self._reply("restore", self.engine.load_snapshot, folder, version, detail={"version": version})

