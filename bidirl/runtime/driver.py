"""The execution layer every driver shares: feeding the coordinator, dispatching its messages, the event log.

A driver (simulator, emulated Ray workers, real engines; ``docs/architecture.md``) subclasses :class:`Driver`
and supplies a clock and one handler ``do_<Command>`` per command of :data:`bidirl.core.protocol.COMMANDS`;
a driver that lacks one fails when it is built, naming what is missing. Everything else is here, once:

* :meth:`Driver.feed` hands an event to the coordinator and executes what comes back, in order: commands go
  to the driver's handlers, reports (:class:`~bidirl.core.protocol.StepDone`,
  :class:`~bidirl.core.protocol.Decided`, :class:`~bidirl.core.protocol.RunDone`) into the event log;
* **the lane rule** — which lane of the Gantt a command's span lands on — is one set of functions
  (:func:`switch_lane`, :meth:`Driver.record_switch`, :meth:`Driver.record_sync`, ...), so the same command
  lands on the same lane under every driver and utilisation means the same thing everywhere;
* spans carry the step and actor version the driver has seen through the protocol (``StepDone`` reports and
  ``OptimizerStepped`` events), never read from coordinator state;
* side effects of a run — checkpoints, the output folder, live views — hang on the driver as
  :class:`RunListener` objects (``add_listener``) that see its protocol traffic, never as overrides of ``feed`` or
  ``execute``;
* the run summary, :class:`~bidirl.results.run_result.RunResult` and the progress bar.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

from bidirl.core import protocol as P
from bidirl.job import config as cfgmod
from bidirl.perf.costs import SwitchTimes
from bidirl.perf.predictor import StagePredictor
from bidirl.results.run_result import RunResult
from bidirl.results.trace import EventLog, Span

class RunListener:
    """Something a run does on the side (checkpoints, the output folder, a live view), told of the driver's
    protocol traffic. Every hook is optional; a listener reads the driver and never feeds it events."""

    def on_event(self, driver: "Driver", event) -> None:
        """``event`` is about to reach the coordinator."""

    def on_command(self, driver: "Driver", command) -> None:
        """The coordinator sent ``command``; the driver's handler runs it next."""

    def on_report(self, driver: "Driver", report) -> None:
        """The coordinator's ``report`` (``StepDone``, ``Decided``, ``RunDone``) is now in the event log."""


def switch_lane(pool: str, to_role: str) -> str:
    """The lane a switch is drawn on: the role taking the pool (its trainer gang or first rollout replica),
    so a switch-in is the auxiliary's preparation and a switch-out the primary's."""
    return P.trainer_gang(pool) if to_role == P.TRAINER else P.rollouter(pool, 0)


@contextlib.contextmanager
def progress_bar(total: int, desc: str, enabled: bool = True):
    """A tqdm bar over ``total`` steps; yields ``tick(done)`` that moves it to ``done`` (no-op when disabled)."""
    if not enabled:
        yield lambda done: None
        return
    from tqdm.auto import tqdm
    bar = tqdm(total=total, desc=desc, leave=False)
    seen = [0]

    def tick(done: int) -> None:
        if done != seen[0]:
            bar.update(done - seen[0])
            seen[0] = done
    try:
        yield tick
    finally:
        bar.close()


@dataclass
class Driver:
    """The shared half of every driver (module doc). Subclasses define ``provenance`` and ``do_<Command>``."""
    config: cfgmod.JobConfig
    policy_name: Any                              # a policy name, or a Policy (the modelled external systems')
    steps: int
    seed: int
    on_event: Optional[Callable] = None           # called with each event fed to the coordinator (live views)
    predictor: Any = None                         # the coordinator's starting models (default: the presets')

    provenance = "simulated"
    #: whether the driver loads new weights into an auxiliary trainer gang (``do_RefreshWeights``, which only such a
    #: driver defines; else the coordinator never sends it: the gang keeps the version's weights and runs only the
    #: segments computed on them)
    refreshes_aux_weights = False

    def __post_init__(self):
        from bidirl.runtime.assemble import assemble
        commands = [c for c in P.COMMANDS if c is not P.RefreshWeights or self.refreshes_aux_weights]
        missing = [cls.__name__ for cls in commands if not callable(getattr(self, "do_" + cls.__name__, None))]
        if missing:
            raise TypeError(f"{type(self).__name__} has no handler for {', '.join(missing)}; a driver defines "
                            "do_<Command> for every command of bidirl.core.protocol.COMMANDS (RefreshWeights only "
                            "if it sets refreshes_aux_weights)")
        self._handlers = {cls: getattr(self, "do_" + cls.__name__) for cls in commands}
        own_models = self.predictor is not None
        self.assembly = a = assemble(self.config, self.policy_name, steps=self.steps, seed=self.seed,
                                     predictor=self.predictor, aux_refresh=self.refreshes_aux_weights)
        self.policy_name = a.coordinator.policy.name
        self.plan, self.topology, self.predictor, self.coordinator = a.plan, a.topology, a.predictor, a.coordinator
        env = self.plan.envelope
        # what the work really takes where the driver models it (simulator, emulated workers): the presets'
        # models, kept apart from the coordinator's predictor, which the online profiler refits (while the
        # coordinator starts from the presets too, both share the model objects and their memo)
        self.truth = (StagePredictor.from_config(self.config, env.rollout_layout, env.trainer_layout,
                                                 expert_parallel=env.trainer_expert_parallel) if own_models
                      else self.predictor.sharing_models())
        self.log = EventLog()
        self.messages: list = []      # every command and report executed, in order (cross-driver checks)
        self.version = 0              # the primary trainer's actor version, as the events fed have told
        self.finished = False         # the coordinator reported RunDone
        self.listeners: list = []     # RunListener objects (add_listener)
        self.open_windows: dict = {}  # pool -> its open borrowing window: switch-in span, whether guests worked
        # what each switch takes where the driver times switches by the models: the steady costs and the one copy of
        # the first switches' pinned allocations, reserved in the background from the engines' load at the run's
        # start (a measured run's switches are what they are: None)
        self.switch_times = (SwitchTimes({d: self.config.switch_costs(d) for d in P.DIRECTIONS}, dict(a.first_switch),
                                         loaded_at=0.0) if self.provenance != "measured" else None)

    def add_listener(self, listener: RunListener) -> RunListener:
        """Tell ``listener`` of every event, command and report from now on (after the listeners added before)."""
        self.listeners.append(listener)
        return listener

    def remove_listener(self, listener: RunListener) -> None:
        self.listeners.remove(listener)

    def continue_from(self, control) -> None:
        """Continue a run from ``control`` (a checkpoint's :class:`~bidirl.runtime.checkpoints.ControlPlane`): its
        coordinator, with this driver's ``steps`` as the goal (a resumed run may go on to more steps), the models
        that coordinator refits as the driver's predictor, and its event log, filled into the driver's in place
        (a live Gantt that follows ``self.log`` keeps following it)."""
        from dataclasses import replace
        self.coordinator = control.coordinator
        self.coordinator.settings = replace(self.coordinator.settings, steps=int(self.steps))
        self.predictor = self.coordinator.predictor
        self.log.spans[:] = control.log.spans
        self.log.steps[:] = control.log.steps
        self.log.decisions[:] = control.log.decisions

    # ------------------------------------------------------------------------------------------
    @property
    def steps_done(self) -> int:
        return len(self.log.steps)

    def feed(self, event) -> None:
        """Hand ``event`` to the coordinator and execute its messages in order. ``on_event`` (a plain function
        of the event, settable at any time: live views) and the listeners see it first."""
        if self.on_event is not None:
            self.on_event(event)
        for listener in self.listeners:
            listener.on_event(self, event)
        messages = self.coordinator.handle(event)
        if isinstance(event, P.OptimizerStepped):
            self.version = event.version
        for msg in messages:
            self.execute(msg)

    def execute(self, msg) -> None:
        """Record a report, or run a command through the driver's handler; the listeners hear of either."""
        self.messages.append(msg)
        if isinstance(msg, P.REPORTS):
            if isinstance(msg, P.StepDone):
                self.log.add_step(msg.record)
            elif isinstance(msg, P.Decided):
                self.log.add_decision(msg.decision)
            elif isinstance(msg, P.RuleWaited):
                self.span(msg.worker, "rule_wait", msg.start, msg.end, {"held": msg.held})
            else:
                self.finished = True
            for listener in self.listeners:
                listener.on_report(self, msg)
        else:
            for listener in self.listeners:
                listener.on_command(self, msg)
            self._handlers[type(msg)](msg)

    # ---- the lane rule ------------------------------------------------------------------------
    def span(self, worker: str, kind: str, start: float, end: float, detail: Optional[dict] = None,
             step: Optional[int] = None) -> None:
        """One span on ``worker``'s lane, tagged with the current step (or ``step``) and actor version."""
        if kind in ("generate", "chunk") and not P.is_primary(worker):
            window = self.open_windows.get(P.worker_pool(worker))
            if window is not None:
                window["worked"] = True
        self.log.add_span(Span(worker=worker, pool=P.worker_pool(worker), role=P.worker_role(worker), kind=kind,
                               start=float(start), end=float(max(start, end)),
                               step=self.steps_done if step is None else step, version=self.version,
                               detail=dict(detail or {})))

    def record_chunk(self, cmd: P.RunChunk, start: float, end: float) -> None:
        ch = cmd.chunk
        self.span(cmd.worker, "chunk", start, end, {"stage": ch.stage, "chunk_id": ch.chunk_id,
                                                    "samples": len(ch.samples)}, step=ch.step)

    def record_switch(self, cmd: P.Switch, start: float, end: float, alloc: Optional[float] = None) -> None:
        """The switch's span (with a ``pin_alloc`` span over its start when it is the first of its direction and
        phase, the driver times switches by the models and the background reservation of the pinned buffer had not
        finished by ``start``: ``alloc`` seconds, the part of the switch :meth:`SwitchTimes.take
        <bidirl.perf.costs.SwitchTimes.take>` gave; None: taken from :attr:`switch_times` here); a switch out closing
        a window that sent its guests no work carries the scheduler's reason in ``detail["no_work"]``
        (``Switch.no_work``, read by ``bidirl.results.windows``); a switch out that closes a window in which the
        guests ran nothing (generated no token, ran no chunk: the window closed before its switch in completed, or
        had nothing left for them) also marks both of the window's switches ``switch_no_work`` (paid for no
        work)."""
        lane = switch_lane(cmd.pool, cmd.to_role)
        self.span(lane, "switch_in" if cmd.phase == "in" else "switch_out", start, end,
                  {"direction": cmd.direction, **({"no_work": cmd.no_work} if cmd.no_work else {})})
        if alloc is None:
            alloc = self.switch_times.take(cmd.direction, cmd.phase, start)[1] if self.switch_times else 0.0
        if alloc > 0:                 # the first switch of its kind: the yielding trainer pins what is left
            self.span(lane, "pin_alloc", start, min(end, start + alloc), {"direction": cmd.direction,
                                                                         "phase": cmd.phase, "seconds": alloc})
        if cmd.phase == "in":
            self.open_windows[cmd.pool] = {"lane": lane, "start": start, "end": end, "worked": False}
            return
        window = self.open_windows.pop(cmd.pool, None)
        if window is not None and not window["worked"]:
            paid = (window["end"] - window["start"]) + (end - start)
            detail = {"direction": cmd.direction, "paid": paid}
            self.span(window["lane"], "switch_no_work", window["start"], window["end"], {**detail, "phase": "in"})
            self.span(lane, "switch_no_work", start, end, {**detail, "phase": "out"})

    def record_sync(self, cmd: P.SyncWeights, start: float, end: float, per_target: Optional[dict] = None) -> None:
        """The sync on every target's lane (its own interval when ``per_target`` gives one) and on the primary
        trainer's, which sends the weights."""
        for w in cmd.targets:
            a, b = (per_target or {}).get(w, (start, end))
            self.span(w, "sync", a, b, {"version": cmd.version})
        self.span(P.PRIMARY_TRAINER, "sync", start, end, {"version": cmd.version})

    def record_merge(self, cmd: P.MergeGradients, start: float, end: float) -> None:
        self.span(P.PRIMARY_TRAINER, "grad_merge", start, end, {"chunks": len(cmd.chunk_ids)}, step=cmd.step)

    def record_refresh(self, cmd: P.RefreshWeights, start: float, end: float) -> None:
        """The weight refresh on the auxiliary gang's lane, which receives the weights."""
        self.span(cmd.worker, "weight_refresh", start, end, {"updates": cmd.updates}, step=cmd.step)

    def record_optimizer(self, cmd: P.OptimizerStep, start: float, end: float) -> None:
        self.span(P.PRIMARY_TRAINER, "optimizer", start, end, {}, step=cmd.step)

    def do_StartStep(self, cmd: P.StartStep) -> None:
        """Most drivers need nothing at a step's start (engine runs prepare the step's data here)."""

    # ---- results ------------------------------------------------------------------------------
    def summary(self) -> dict:
        """The ``simulate`` / ``run`` JSON summary of what the log holds (DESIGN.md's keys, then extensions)."""
        from bidirl.results import metrics
        view = self.coordinator.view()
        out = metrics.summary(self.log, policy=self.policy_name, staleness=self.config.rl.staleness,
                              pool_gpus=self.assembly.pool_gpus, gpus_per_worker=self.assembly.gpus_per_worker(),
                              samples=view.samples)
        out["provenance"] = self.provenance
        out["calibration"] = view.calibration
        out["reproducibility"] = view.reproducibility
        self.log.meta["reproducibility"] = view.reproducibility       # the event log says it too
        return out

    def result(self, **extra) -> RunResult:
        """The run's :class:`RunResult`; raises if the coordinator never reported the end of the run."""
        if not self.finished:
            raise RuntimeError(f"the run stopped after {self.steps_done} of {self.steps} steps with no work left "
                               f"(policy {self.policy_name}); this is a scheduler bug — please report it with the "
                               "event log")
        return RunResult(self.policy_name, self.config, self.log, extra.pop("summary", None) or self.summary(),
                         self.provenance, view=self.coordinator.view(), **extra)
