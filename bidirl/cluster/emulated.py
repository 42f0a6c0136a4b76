"""Emulated workers: the real Ray actors and control path, with execution replaced by model-timed sleeps.

Each actor owns the same state a real worker would (a rollout engine's running requests, a trainer gang's
chunk), but where a real worker would compute it sleeps for the stage-time model's duration divided by
``time_scale`` (virtual seconds per wall second). Rollout replicas run the simulator's continuous-batching
engine model against the wall clock, so completions, interruptions and prefixes behave exactly as in
simulation while the driver, Ray scheduling and ``ray.wait`` loop are real. This lets 16-512 virtual
GPUs run on one machine and measures what the control path itself costs.
"""

from __future__ import annotations

import math
import time

import numpy as np

from bidirl.sim.engine import EngineSim, SimGroup
from bidirl.sim.loop import EventLoop


class VirtualClock:
    """Virtual seconds since ``t0`` (a shared wall-clock origin) at ``scale`` virtual s per wall s."""

    def __init__(self, t0: float, scale: float):
        self.t0, self.scale = t0, scale

    def now(self) -> float:
        return (time.time() - self.t0) * self.scale

    def sleep_virtual(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds / self.scale)


class EmulatedRollout:
    """A rollout replica emulated with the engine model. Driven by ``advance`` calls from the driver."""

    def __init__(self, name: str, engine_costs, t0: float, scale: float, seed: int):
        self.name, self.clock = name, VirtualClock(t0, scale)
        self.loop = EventLoop()
        self.finished, self.spans = [], []
        self.engine = EngineSim(name, engine_costs, self.loop, np.random.default_rng(seed),
                                on_group=lambda w, st, el: self.finished.append((self.loop.now, st, el)),
                                on_span=lambda w, kind, a, b, det: self.spans.append((kind, a, b, det)),
                                on_record=lambda *a: None)

    def _catch_up(self) -> None:
        now = self.clock.now()
        self.loop.run(until=now)
        self.loop.now = max(self.loop.now, now)

    def start(self, tasks: list, version: int) -> int:
        """``tasks``: (group_id, prompt_len, targets, resume GroupState or None)."""
        self._catch_up()
        for gid, prompt, targets, resume in tasks:
            if resume is not None:
                gen, v = list(resume.generated), min(resume.version, version)
            else:
                gen, v = [0] * len(targets), version
            self.engine.add(SimGroup(gid, prompt, tuple(targets), gen, v))
        return len(tasks)

    def advance(self, max_wall: float) -> dict:
        """Sleep until the next completion (or ``max_wall``), then report what finished."""
        self._catch_up()
        nxt = self.loop.peek()
        horizon = self.loop.now + max_wall * self.clock.scale
        target = min(nxt, horizon)
        if math.isfinite(target):
            self.clock.sleep_virtual(target - self.clock.now())
        self._catch_up()
        out, self.finished = self.finished, []
        spans, self.spans = self.spans, []
        return {"finished": out, "busy": self.engine.busy, "spans": spans, "t": self.loop.now}

    def interrupt(self, group_ids) -> dict:
        self._catch_up()
        states = self.engine.interrupt(group_ids)
        out, self.finished = self.finished, []
        spans, self.spans = self.spans, []
        return {"stopped": states, "finished": out, "spans": spans, "t": self.loop.now, "busy": self.engine.busy}

    def hold(self, seconds: float) -> float:
        """A timed state operation on this worker (weight load, offload, onload): returns virtual seconds."""
        t0 = self.clock.now()
        self.clock.sleep_virtual(seconds)
        return self.clock.now() - t0


class EmulatedTrainer:
    """A trainer gang emulated by sleeping for the trainer model's chunk time."""

    def __init__(self, name: str, t0: float, scale: float):
        self.name, self.clock = name, VirtualClock(t0, scale)

    def run_chunk(self, chunk_id: int, seconds: float) -> dict:
        start = self.clock.now()
        self.clock.sleep_virtual(seconds)
        return {"chunk_id": chunk_id, "start": start, "end": self.clock.now(), "payload": None}

    def hold(self, seconds: float) -> float:
        t0 = self.clock.now()
        self.clock.sleep_virtual(seconds)
        return self.clock.now() - t0
