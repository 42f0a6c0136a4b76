"""The one engine-worker shape most real-engine tests share, so they run on the session's kept workers.

``tests/conftest.py`` keeps one set of engine workers for the session (``kept_workers``); a run takes it when its
``EngineDriver.worker_shape()`` matches. The shape follows from the job: the model, the layout, the rollouters'
``max_model_len`` and KV budget (from the batch, the staleness and ``workload.max_prompt_len``). :func:`borrowing`
is ``tiny-cpu`` at 32 prompts × 8 responses — generation outlasts a hot switch, so both directions borrow — with
``max_prompt_len`` 48: the longest prompt of the shipped veRL sample (46 tokens) and of the arithmetic task fit, and
48 + ``max_response_len`` 16 is the tiny model's 64 positions. Jobs on other data or rewards with these settings
share the workers (the reward is a per-run argument of the workers' reset).

:func:`reference` is that job as the chaos runs and the reference run (``tests/conftest.py``'s ``reference_run``)
run it: a recovery snapshot of the primary gang every :data:`SNAPSHOT_EVERY` steps.
"""

from __future__ import annotations

from bidirl.job import config as cfgmod

#: the overrides of tiny-cpu that fix the shared worker shape (module docstring)
SHARED = {"workload.prompts_per_step": 32, "workload.group_size": 8, "workload.max_prompt_len": 48}


def borrowing(**overrides):
    """``tiny-cpu`` with :data:`SHARED` and ``overrides`` (dotted keys, as ``JobConfig.with_overrides``)."""
    return cfgmod.load("tiny-cpu").with_overrides({**SHARED, **overrides})


#: the primary gang writes a recovery snapshot every 3 steps: a restarted gang loads one and replays the steps since
SNAPSHOT_EVERY = 3

#: the reference run: this many steps of :func:`reference` at s = 0 under this policy (``tests/conftest.py``)
REFERENCE_STEPS, REFERENCE_POLICY = 10, "opportunistic"


def reference(staleness: float = 0.0):
    """:func:`borrowing` at ``staleness`` with a recovery snapshot every :data:`SNAPSHOT_EVERY` steps."""
    return borrowing(**{"rl.staleness": staleness, "recovery.snapshot_every": SNAPSHOT_EVERY})
