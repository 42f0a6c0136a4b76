"""``run``: a job on Ray, with real engines (the default) or emulated, model-timed workers."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from bidirl.cluster.recovery import MAX_RESTARTS
from bidirl.job import config as cfgmod
from bidirl.results.run_result import RunResult


def run(config, policy: Optional[str] = None, *, steps: Optional[int] = None, seed: Optional[int] = None,
        emulate: bool = False, address: Optional[str] = None, time_scale: float = 20.0,
        model_dir: Optional[str] = None, out_dir: Optional[str] = None, progress: bool = False,
        on_event=None, checkpoint_dir: Optional[str] = None, checkpoint_every: int = 1, keep: int = 3,
        resume: Optional[str] = None, max_restarts: int = MAX_RESTARTS, kept_workers=None) -> RunResult:
    """Run a job on Ray (embedded local Ray unless ``address`` names a cluster).

    Engine workers (vLLM rollouters, torch trainers: :class:`~bidirl.cluster.engines.driver.EngineDriver`)
    by default; ``emulate=True`` runs model-timed workers (:class:`~bidirl.cluster.emulated.EmulatedDriver`)
    at ``time_scale`` virtual seconds per wall second. ``on_event`` sees every event (live views).
    ``out_dir``: the run's output folder (``bidirl.results.tracking``: per-step metrics as JSONL and TensorBoard, trace,
    event log, summary), written while the run goes on.

    ``checkpoint_dir``: write a checkpoint every ``checkpoint_every`` steps and after the last, keeping the last
    ``keep`` (``bidirl.runtime.checkpoints``); ``resume``: continue from the newest good checkpoint in that folder (or
    from that ``step-*`` checkpoint) — it keeps checkpointing there unless ``checkpoint_dir`` names another
    folder. ``max_restarts``: restarts allowed per worker in a row (no whole step completed between its failures)
    before its next failure ends the run. ``kept_workers``: a :class:`~bidirl.cluster.kept_workers.KeptWorkers` shared by
    runs one after another on this Ray (engine runs): a run of the same shape takes the workers an earlier one
    left, reset to a fresh engine's state, instead of starting its own.
    """
    cfg = cfgmod.load(config)
    if not emulate:
        cfgmod.check_engine_run(cfg)          # a setting engine workers would not carry out is refused by name
    policy = policy or cfg.scheduler.policy
    from bidirl.core.policies import get_policy
    try:
        get_policy(policy)
    except ValueError as exc:
        raise cfgmod.ConfigError("scheduler.policy", str(exc), "the Ray runtime runs the core policies") from None
    if time_scale <= 0:
        raise cfgmod.ConfigError("time_scale", f"must be > 0, got {time_scale}", "use e.g. 20 (virtual s per wall s)")
    steps = cfg.workload.steps if steps is None else int(steps)
    seed = cfg.seed if seed is None else int(seed)
    if resume is not None and checkpoint_dir is None:
        from bidirl.runtime.checkpoints import MANIFEST
        checkpoint_dir = str(Path(resume).parent if (Path(resume) / MANIFEST).exists() else Path(resume))
    durable = dict(checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, keep=keep, resume=resume,
                   max_restarts=max_restarts, out_dir=out_dir)
    if not emulate:
        from bidirl.cluster.engines.driver import EngineDriver
        return EngineDriver(cfg, policy, steps, seed, on_event=on_event, address=address,
                            model_dir=model_dir, kept_workers=kept_workers, **durable).run(progress)
    if kept_workers is not None:
        raise cfgmod.ConfigError("kept_workers", "emulated runs start their workers in a second and keep none",
                                 "pass kept_workers only to engine runs (emulate=False)")
    from bidirl.cluster.emulated import EmulatedDriver
    return EmulatedDriver(cfg, policy, steps, seed, on_event=on_event, address=address,
                          time_scale=time_scale, **durable).run(progress)
