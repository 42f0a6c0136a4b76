"""What a Ray run's checkpoint records of its driver, and how a resumed run takes it back (:mod:`bidirl.runtime.checkpoints`).

A checkpoint holds the control plane (the coordinator, its event log, the boundary event), the driver's own
per-run state (:func:`driver_state`) and the trainer's files, under the run's identity (:func:`identity`: the
config, policy, seed, driver, model, data and :func:`layout`), which a resumed run must match. :func:`load`
continues a run from one: the control plane and the driver's state are restored, the clock continues from the
boundary, and the workers — started afresh — reserve their first switches' pinned buffers from the boundary on.
:class:`Resumable` holds the driver's methods over these functions.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from bidirl.runtime import checkpoints


def layout(d) -> dict:
    """The world size of every pool and gang of the pool driver ``d`` (GPU slots, replicas, ranks)."""
    env, top = d.plan.envelope, d.topology
    return {"gpus": d.config.cluster.gpus, "rollout_gpus": env.rollout_gpus,
            "trainer_gpus": env.trainer_gpus, "rollout_layout": env.rollout_layout,
            "trainer_layout": env.trainer_layout, "rollouters": top.rollout_replicas,
            "aux_rollouters": top.aux_rollout_replicas,
            "trainer_ranks": top.trainer_replicas * env.trainer_layout,
            "aux_trainer_ranks": top.aux_trainer_replicas * env.trainer_layout}


def identity(d) -> checkpoints.RunIdentity:
    """What a checkpoint of ``d``'s run records and a resumed run must match (it hashes the prompt file)."""
    workers = d.backend.identity()
    return checkpoints.RunIdentity(config=d.config.to_dict(), policy=d.policy_name, steps=d.steps, seed=d.seed,
                                   driver=d.label, model=workers["model"], data=workers["data"], layout=d.layout())


def driver_state(d) -> dict:
    """The driver's own per-run state a checkpoint keeps."""
    return {"version": d.version, "measured": d.measured, "step_marks": list(d.step_marks),
            "recoveries": list(d.restarts.record), "step_stats": list(d.step_stats),
            "backend": d.backend.run_state()}


def restore_driver_state(d, state: dict) -> None:
    """Take back what :func:`driver_state` returned (a resumed run)."""
    d.version = state["version"]
    d.measured = {k: list(v) for k, v in state["measured"].items()}
    d.step_marks = list(state["step_marks"])
    d.restarts.record = list(state["recoveries"])
    d.step_stats = list(state.get("step_stats", []))     # (an emulated run's checkpoint before it kept none)
    d.backend.take_run_state(state.get("backend", {}))


def load(d) -> None:
    """Restore the control plane and the driver's state from ``d.resume`` (before Ray starts: a bad checkpoint fails
    fast, naming what is wrong); newer checkpoints in the folder the run writes to are removed (this run replaces
    them)."""
    found = checkpoints.find(d.resume, d.identity())
    if d.steps <= found.step:
        raise checkpoints.CheckpointError(
            f"checkpoint {str(found.path)!r} holds {found.step} steps already; this run asks for {d.steps} "
            f"in all: pass --steps greater than {found.step} to continue it")
    control = found.control()
    d.continue_from(control)
    checkpoints.set_rng_states(control.rng)
    d.restore_state(control.driver)
    d.boundary, d.clock_start, d.resumed_from = control.boundary, float(control.boundary.t), found
    if d.switch_times is not None:
        # the resumed run's workers start anew at its boundary: their trainers reserve the first switches' pinned
        # buffers from then on (SwitchTimes.take charges what is left of that from the boundary)
        d.switch_times.loaded_at = d.clock_start
    if d.writer is not None and Path(d.writer.root).resolve() == found.path.parent.resolve():
        newer = [p for p in checkpoints.step_folders(d.writer.root) if checkpoints.step_of(p) > found.step]
        if newer:
            warnings.warn(f"resuming from {found.path.name}: removing the newer checkpoints "
                          f"{', '.join(p.name for p in newer)}, which this run replaces", RuntimeWarning,
                          stacklevel=3)
            for p in newer:
                d.writer.abandon(p)


class Resumable:
    """Checkpoints and resume, a part of :class:`bidirl.cluster.pool.PoolDriver` split out by concern (as
    :class:`~bidirl.cluster.worker_failures.WorkerFailures` is): its methods read the driver's state (declared
    there) through this module's functions."""

    def layout(self) -> dict:
        """The world size of every pool and gang (GPU slots, replicas, ranks)."""
        return layout(self)

    def identity(self) -> checkpoints.RunIdentity:
        """What a checkpoint of this run records and a resumed run must match (computed once: it hashes the
        prompt file)."""
        if self._identity is None:
            self._identity = identity(self)
        return self._identity

    def checkpoint_state(self) -> dict:
        """The driver's own per-run state a checkpoint keeps."""
        return driver_state(self)

    def restore_state(self, state: dict) -> None:
        """Take back what :meth:`checkpoint_state` returned (a resumed run)."""
        restore_driver_state(self, state)

    def save_trainer_state(self, folder: Path) -> bool:
        """Write the trainer's state into ``folder`` (a checkpoint's ``trainer/``); False if there is none.
        Raises :class:`~bidirl.runtime.checkpoints.CheckpointSkipped` when it cannot now (the trainer is being
        restarted). Other workers hold nothing a checkpoint needs: one being restarted is announced again on resume."""
        return self.backend.save_trainer_state(folder)

    def _load_resume(self) -> None:
        """Restore the control plane and the driver's state from ``resume`` (before Ray starts: a bad
        checkpoint fails fast, naming what is wrong; :func:`bidirl.cluster.resume.load`)."""
        if self.resume is not None:
            load(self)
