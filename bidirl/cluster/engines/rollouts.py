"""The engine backend's rollouters: starting groups, keeping a busy rollouter generating, interrupting it (§3, §5.1).

A ``Generate`` loads the command's version into the rollouter if it is behind (:mod:`.weight_loads`), sends its
groups' requests (prompts from ``workload.data_file`` or the built-in task) and keeps one generation call in flight
while the rollouter is busy: the rollouter's stream (``RolloutActor.stream``), whose engine loop yields each group as
it finishes and ends once the rollouter holds no requests. Each reply says whether requests are left and which
start it saw; the actor numbers its reports, so a stale one is ignored. A busy period that ran only fresh groups
becomes a ``RolloutRecord`` for the profiler (§5.1).
"""

from __future__ import annotations

from bidirl.cluster.backend import is_stream
from bidirl.core import protocol as P


class EngineRollouts:
    """The rollouters of one engine run (module doc). ``backend``: the
    :class:`~bidirl.cluster.engines.backend.EngineBackend`."""

    def __init__(self, backend):
        self.backend, self.pool = backend, backend.pool
        self.period: dict = {}            # rollouter -> its current busy period (for profiling records)
        self.r_report: dict = {}          # rollouter -> number of its latest report applied (see busy_after)

    def forget(self, worker: str) -> None:
        """A lost rollouter's busy period ends with it; a fresh process numbers its reports afresh."""
        self.period.pop(worker, None)
        self.r_report.pop(worker, None)

    def request(self, task: P.GroupTask):
        d = self.pool
        from bidirl.cluster.engines.workers.rollout import GroupRequest
        w = d.config.workload
        g = task.group_id
        forced = d.forced_lengths(g)[1] if d.forced_lengths is not None else None
        return GroupRequest(g, d.prompts.prompt_ids(g), w.group_size, w.max_response_len,
                            d.prompts.reward_input(g), resume=task.resume, response_tokens=forced)

    def generate(self, cmd: P.Generate):
        d = self.pool
        w = cmd.worker
        if not d.r_busy.get(w) or w not in self.period:
            self.period[w] = {"since": d.now(), "clean": True, "groups": []}
        if any(t.resume is not None for t in cmd.tasks):
            self.period[w]["clean"] = False
        loads = self.backend.loads
        d._when_all(loads.calls([w], cmd.version), lambda replies: loads.record(replies, cmd.version))
        d.r_busy[w] = True
        d._count_start(w)
        requests = [self.request(t) for t in cmd.tasks]
        d._submit(w, d.actors[w].start.remote(requests, d.r_starts[w]), lambda reply: None)
        self.ensure_advance(w)

    def ensure_advance(self, worker: str):
        """Keep a busy rollouter generating: one :meth:`advance_call` in flight, each of its results reported to
        :meth:`advanced`. The call is a slice (an object ref: one result) or a stream (an ``ObjectRefGenerator``: a
        result each time it yields, until the rollouter holds no requests); when it ends another is sent if the
        rollouter is still busy."""
        d = self.pool
        if d.r_advancing.get(worker) or not d.r_busy.get(worker) or worker in d.failed:
            return
        d.r_advancing[worker] = True
        d._count_call(worker, "advances")
        starts = d.r_starts.get(worker, 0)

        def ended():
            d.r_advancing[worker] = False
            self.ensure_advance(worker)
        call = self.advance_call(worker)
        if is_stream(call):
            d._submit_stream(worker, call, lambda result: self.advanced(worker, result, starts), ended)
            return

        def done(result):
            d.r_advancing[worker] = False
            self.advanced(worker, result, starts)
            self.ensure_advance(worker)
        d._submit(worker, call, done)

    def advance_call(self, worker):
        """The rollouter's stream (``RolloutActor.stream``): it waits for the last start sent, then runs free."""
        d = self.pool
        return d.actors[worker].stream.remote(d.r_starts.get(worker, 0), d.report_seconds)

    def advanced(self, worker, reply, starts_before):
        """One reply of a stream: its generate spans, the groups that finished, and whether requests are left."""
        for sp in reply.spans:
            if sp["detail"].get("steps"):
                self.pool.span(worker, "generate", self.backend.wall(sp["start"]), self.backend.wall(sp["end"]),
                               dict(sp["detail"]))
        self.finished(worker, reply.value["groups"])
        self.busy_after(worker, reply.value)

    def busy_after(self, worker, report: dict) -> None:
        """Take a rollouter's report (a stream reply's, an interrupt's): it is busy if the report saw requests left
        or a start sent after the one it saw is still to run. The actor numbers its reports (its stream and its
        other calls report in the order they held the engine); one older than the latest applied is stale."""
        if report["report"] <= self.r_report.get(worker, 0):
            return
        self.r_report[worker] = report["report"]
        self.set_busy(worker, bool(report["busy"]) or self.pool.r_starts.get(worker, 0) > report["starts"])

    def finished(self, worker, groups):
        d = self.pool
        period = self.period.get(worker)
        for g in groups:
            if period is not None:
                period["groups"].append(g)
            d.feed(P.GroupFinished(d.now(), worker, g))

    def set_busy(self, worker, busy: bool):
        """A rollouter went idle: a busy period of fresh groups only becomes a profiling record (§5.1)."""
        d = self.pool
        was, d.r_busy[worker] = d.r_busy.get(worker), busy
        period = self.period.get(worker)
        if was and not busy and period is not None:
            if period["clean"] and period["groups"]:
                prompt = [g.prompt_len for g in period["groups"] for _ in g.generated]
                resp = [n for g in period["groups"] for n in g.generated]
                d.feed(P.RolloutRecord(d.now(), worker, tuple(prompt), tuple(resp),
                                       d.now() - period["since"]))
            self.period.pop(worker, None)

    def interrupt(self, cmd: P.Interrupt):
        d = self.pool
        w = cmd.worker
        if w in self.period:
            self.period[w]["clean"] = False

        def done(reply):
            d.feed(P.GenerationStopped(d.now(), w, tuple(reply.value)))
            self.busy_after(w, reply.spans[0]["detail"])
            self.ensure_advance(w)
        ids = list(cmd.group_ids) if cmd.group_ids is not None else None
        d._submit(w, d.actors[w].interrupt.remote(ids), done)
