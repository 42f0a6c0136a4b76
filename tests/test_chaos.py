"""Real runs that survive: workers killed on a seeded schedule, and the driver process itself killed and resumed.

Integration tests (``-m integration``) with the real engines on the built-in tiny model (``tiny-cpu``: two vLLM
rollouters, a two-rank FSDP2 trainer gang on gloo, and the auxiliary rollouters and gang that borrowing switches
in), on the session's Ray and kept workers (``tests/conftest.py``). The runs borrow in both directions at every
step (policy ``opportunistic``, 32 groups of 8 responses so generation outlasts a switch), so there are auxiliary
workers to kill and switches to kill them in.

* **Chaos.** A 10-step run at s = 0 and at s = 1 for one seed in ``make test`` and each of three seeds in
  ``make test-chaos`` (``BIDIRL_CHAOS_SEEDS=0,1,2``; run it before landing any change to recovery): every run
  kills each kind of worker, so one seed per staleness covers every kill kind and moment. :class:`Chaos` kills
  one worker of each kind — a primary rollouter, an auxiliary rollouter, a rank of the primary gang, a rank of the auxiliary
  gang — each from a seeded step on: the primary rollouter while it receives a weight sync, the others while
  they work (a rollouter generating, a gang running a chunk); and one more worker, of whichever kind, while a
  switch it takes part in is in flight. The rollouter or rank is a seeded choice too (``ray.kill``: the process
  dies). Every run completes with no sample lost or duplicated and no pool hosting both roles; every kill was
  recovered; at s = 0 the same prompt groups train in every step and the final weights equal a fault-free run's
  bit for bit (``tests/rounding.py``'s ``exact_weights``: the reproducible mode, on by default at s = 0, sums the
  chunk gradients in one order whatever the kills, restarts and borrowing). The primary gang writes a recovery snapshot every 3 steps, so a restarted one
  loads a snapshot and replays the steps since (``bidirl.cluster.engines.trainer_recovery``); an auxiliary gang
  killed holding an unsent window rolls its step back.
* **Driver death.** ``bidirl run --address auto``, a driver of its own on the session's Ray, is killed (SIGKILL;
  Ray ends its job's workers) once its checkpoint after 2 of 4 steps exists; ``bidirl run --resume`` runs the other 2 on
  the same cluster and prints the CLI's JSON contract, with the trace written. The result equals 4 steps straight
  (the fault-free run's checkpoint after step 4): the same prompt groups per step, the same rewards, the same
  weights (as above), and the resumed run's log, metrics and summary number the steps 0-3. Two steps on each side
  of the kill are the fewest that still resume mid-run with a step of the first run's in the second's log and a
  weight-update step after the resume; the two engine starts (one per CLI process) are most of its time.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest

from bidirl.cluster.recovery import MAX_RESTARTS
from bidirl.core import protocol as P
from bidirl.results import metrics
from bidirl.runtime import checkpoints

import engine_jobs
import rounding

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="engine runs need vllm (pip install -e .[cpu])")]

STEPS, POLICY = engine_jobs.REFERENCE_STEPS, engine_jobs.REFERENCE_POLICY
KINDS = ("primary rollouter", "auxiliary rollouter", "primary trainer rank", "auxiliary trainer rank")
#: kill schedules' seeds: one in ``make test``, the full matrix (0,1,2) in ``make test-chaos``
SEEDS = tuple(int(s) for s in os.environ.get("BIDIRL_CHAOS_SEEDS", "0").split(","))


#: the driver-death test: the CLI run is killed after its checkpoint at step DEATH_AT and resumed to DEATH_STEPS
DEATH_AT, DEATH_STEPS = 2, 4

#: the module's job at a staleness: the shared job, its primary gang snapshotting every SNAPSHOT_EVERY (3) steps
job, SNAPSHOT_EVERY = engine_jobs.reference, engine_jobs.SNAPSHOT_EVERY


@dataclass
class Chaos:
    """A seeded kill schedule, polled by ``PoolDriver.run(kill=...)`` after every completed call (module doc).

    Five kills, each armed from a seeded step and done the first time its moment comes: one per kind — the
    primary rollouter while it is a target of the weight sync in flight (``sync``), the others while they work
    (``work``: generating, or running a chunk) — and one of any worker taking part in a switch in flight
    (``switch``). Which directions a run borrows in, and when, is the scheduler's choice: at s = 1 the trainer
    pool is lent to rollout only in the first steps (later the trainer never waits), and after kills the gate may
    admit no more windows of a direction (once at s = 0: the primary gang killed twice in step 1, and the rollout
    pool never lent to training again from step 3 on), so the kills that need a window (an auxiliary
    rollouter's, an auxiliary rank's, the switch's) are armed from a step in ``[0, early]``, the others from one
    in ``[1, last]``; a kill armed from a step may come at any step after it. At s = 1 ``early`` is 0: on a slower
    machine the trainer pool may be lent only while the first batch is generated. The switch kill waits until the
    auxiliary rollouter's kill is done: killing either side of the trainer pool's switch (the gang switching out,
    or an auxiliary rollouter switching in) can close the one window that kill has (seen at s = 1 on warm engines:
    the primary gang killed as it switched out at step 0, and no auxiliary rollouter generated afterwards). The worker, and the rank of a gang, are seeded
    choices; ``ray.kill`` ends the process."""
    seed: int
    early: int = 1
    last: int = 4
    kills: list = field(default_factory=list)          # (kind, moment, worker, steps done)

    def __post_init__(self):
        self.rng = random.Random(self.seed)
        self.moment = dict.fromkeys(KINDS, "work")
        self.moment["primary rollouter"] = "sync"
        self.moment["switch"] = "switch"
        needs_window = ("auxiliary rollouter", "auxiliary trainer rank", "switch")
        self.armed = {kind: (self.rng.randint(0, self.early) if kind in needs_window
                             else self.rng.randint(1, self.last)) for kind in KINDS + ("switch",)}

    def __call__(self, driver) -> None:
        import ray
        for kind, step in sorted(self.armed.items(), key=lambda kv: (kv[1], kv[0])):
            if driver.steps_done < step:
                break
            if kind == "switch" and "auxiliary rollouter" in self.armed:
                continue        # that kill may have this window only, and killing either side can close it
            candidates = sorted(w for w in self._in(kind, self.moment[kind], driver) if w not in driver.failed)
            if candidates:
                worker = self.rng.choice(candidates)
                ranks = driver.gangs.get(worker) or [driver.actors[worker]]
                ray.kill(self.rng.choice(ranks))
                self.kills.append((self.kind_of(worker, driver.topology), self.moment[kind], worker,
                                   driver.steps_done))
                del self.armed[kind]
                return

    @staticmethod
    def kind_of(worker: str, top) -> str:
        if worker in top.rollouters:
            return "primary rollouter"
        if worker in top.aux_rollouters:
            return "auxiliary rollouter"
        return "primary trainer rank" if P.is_primary(worker) else "auxiliary trainer rank"

    @staticmethod
    def _in(kind: str, moment: str, d) -> list:
        if moment == "switch":
            return [w for cmd in d.switching.values() for side in d.switch_sides(cmd) for w in side]
        top = d.topology
        of_kind = {"primary rollouter": top.rollouters, "auxiliary rollouter": top.aux_rollouters,
                   "primary trainer rank": (P.PRIMARY_TRAINER,), "auxiliary trainer rank": (P.AUX_TRAINER,)}[kind]
        if moment == "sync":
            busy = d.syncing.targets if d.syncing is not None else ()
        else:
            busy = [w for w in of_kind if d.r_busy.get(w) or d.chunk_running.get(w) is not None]
        return [w for w in of_kind if w in busy]


def _run(model_dir, kept_workers, cfg, kill=None, **kwargs):
    """A run on the session's kept workers (``kept_workers``), each reset to a fresh engine's state."""
    from bidirl.cluster.engines.driver import EngineDriver
    return EngineDriver(cfg, POLICY, STEPS, cfg.seed, model_dir=str(model_dir), kept_workers=kept_workers,
                        **kwargs).run(kill=kill)


def _batches(view) -> list:
    return [sorted(ids) for _, _, ids in view.batches]


def _same_weights(a: dict, b: dict, cfg) -> str:
    """Two runs of one job at s = 0, where the reproducible mode is on by default: whatever the kills, restarts and
    borrowing, the same weights bit for bit (``rounding.exact_weights``). Returns it in words."""
    assert cfg.rl.reproducible_on
    differ = rounding.exact_weights(a, b)
    assert not differ, f"{len(differ)} tensors differ from the fault-free run's: {differ[:5]}"
    return "equal bit for bit"


@pytest.fixture(scope="module")
def fault_free(reference_run):
    """The s = 0 run without faults, checkpointed after every step (all kept): the reference of both tests. It is
    the session's reference run (``tests/conftest.py``): this module's job, policy and steps."""
    ref = reference_run.of(job(0.0), POLICY)
    return ref.result, ref.checkpoints


@pytest.mark.parametrize("staleness", [0.0, 1.0])
@pytest.mark.parametrize("seed", SEEDS)
def test_killing_any_worker_at_any_moment_loses_nothing(model_dir, kept_workers, fault_free, staleness, seed):
    cfg = job(staleness)
    chaos = Chaos(seed, early=0 if staleness else 1)
    res = _run(model_dir, kept_workers, cfg, kill=chaos)
    s = res.summary()
    assert not chaos.armed, f"kills never done: {chaos.armed} (killed: {chaos.kills})"
    assert {m for _, m, _, _ in chaos.kills} == {"sync", "switch", "work"}
    assert {k for k, _, _, _ in chaos.kills} == set(KINDS)
    assert len(res.log.steps) == STEPS and [r.step for r in res.log.steps] == list(range(STEPS))
    consumed = STEPS * cfg.workload.prompts_per_step * cfg.workload.group_size
    assert s["samples"]["lost"] == 0 and s["samples"]["duplicated"] == 0 and s["samples"]["consumed"] == consumed
    assert metrics.role_conflicts(res.log) == [], "a pool hosted both roles at once"
    recovered = {r["worker"] for r in s["recoveries"]}
    assert {w for _, _, w, _ in chaos.kills} <= recovered, (chaos.kills, s["recoveries"])
    assert max(r["restart"] for r in s["recoveries"]) <= MAX_RESTARTS and res.view.failed == ()
    # the primary gang's state never went through the object store: snapshots on its ranks' disks (at steps 3, 6
    # and 9; a rank killed while one is written voids that one), and a restarted gang replayed the steps since
    rec = s["recovery"]
    assert rec["snapshots"] >= 2 and rec["recovery_point"][0] == "snapshot", rec
    assert rec["steps_kept"] < 2 * SNAPSHOT_EVERY, rec
    diff = None
    if staleness == 0.0:
        ref, _ = fault_free
        assert _batches(res.view) == _batches(ref.view), "other prompt groups trained"
        diff = _same_weights(res.weights, ref.weights, cfg)
    print(f"chaos seed {seed} s={staleness}: kills {chaos.kills}; samples {s['samples']}; "
          f"weights against the fault-free run's: {diff}")


def _cli(*args, env, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "bidirl.cli", "run", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs)


#: the keys of ``bidirl run --json`` that outside checks read (the CLI's contract)
CONTRACT = ("policy", "throughput", "step_times", "idle", "utilization", "borrows", "samples", "costs", "reward",
            "train", "startup", "weight_sync")


def test_a_killed_driver_resumes_from_its_checkpoint_as_if_never_stopped(model_dir, fault_free, ray_session_env,
                                                                          tmp_path):
    """Both runs are ``bidirl run --address auto`` joining the session's Ray as drivers of their own
    (``ray_session_env``), as a user's CLI joins a running cluster: the killed driver's job ends with it, its actors
    and placement group with it, and the resumed run finds the slots free.
    The resumed run also carries the CLI's contract: stdout holds the JSON object only, the trace is written."""
    ref, ref_folder = fault_free
    config = tmp_path / "job.yaml"
    # the killed driver cannot delete its run's recovery snapshots: they go under this test's folder
    config.write_text(job(0.0).with_overrides({"recovery.snapshot_dir": str(tmp_path / "snapshots")}).to_yaml())
    folder = tmp_path / "ck"
    env = dict(ray_session_env, BIDIRL_CACHE=str(model_dir.parent))
    common = ["--policy", POLICY, "--steps", str(DEATH_STEPS), "--json", "--address", "auto"]

    first = _cli(str(config), *common, "--checkpoint-dir", str(folder), "--checkpoint-every", str(DEATH_AT),
                 "--out", str(tmp_path / "out-1"), env=env)
    deadline = time.time() + 900
    try:
        while not (folder / f"step-{DEATH_AT:06d}" / checkpoints.MANIFEST).exists():
            assert first.poll() is None, f"the run ended before its checkpoint: {first.communicate()[1][-3000:]}"
            assert time.time() < deadline, f"no checkpoint after {DEATH_AT} steps within 15 minutes"
            time.sleep(0.05)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)        # the driver: Ray ends its job's actors
        first.communicate()
    assert not (folder / f"step-{DEATH_STEPS:06d}").exists(), "the driver was killed after it finished"

    trace = tmp_path / "run.json"
    second = _cli(str(config), *common, "--resume", str(folder), "--out", str(tmp_path / "out-2"),
                  "--trace", str(trace), env=env)
    out, err = second.communicate(timeout=900)
    assert second.returncode == 0, err[-3000:]
    summary = json.loads(out)       # stdout holds the JSON object only (Ray's own output goes to stderr)
    missing = [key for key in CONTRACT if key not in summary]
    assert not missing, missing
    assert summary["emulated"] is False and summary["policy"] == POLICY
    events = json.loads(trace.read_text())
    assert any(e.get("name") == "generate" for e in events["traceEvents"]), "the trace holds the generation spans"
    assert summary["resumed_from"]["step"] == DEATH_AT
    assert len(summary["step_times"]) == DEATH_STEPS and len(summary["reward"]) == DEATH_STEPS
    assert summary["samples"]["lost"] == 0 and summary["samples"]["duplicated"] == 0
    assert summary["reward"] == ref.summary()["reward"][:DEATH_STEPS]

    resumed = checkpoints.find(folder)
    straight = checkpoints.Checkpoint.open(ref_folder / f"step-{DEATH_STEPS:06d}")
    assert resumed.step == DEATH_STEPS
    assert _batches(resumed.control().coordinator.view()) == _batches(straight.control().coordinator.view())
    differ = rounding.exact_weights(resumed.trainer_weights(), straight.trainer_weights())
    print(f"{DEATH_AT} + {DEATH_STEPS - DEATH_AT} resumed steps against {DEATH_STEPS} straight: {differ or 'equal'}")
    assert job(0.0).rl.reproducible_on and not differ, differ[:5]
    # the resumed run's own outputs number the steps 0-3: its log continues the first run's
    from bidirl.results.trace import EventLog
    from bidirl.results.tracking import EVENTS_FILE, METRICS_FILE
    log = EventLog.load(tmp_path / "out-2" / EVENTS_FILE)
    assert [r.step for r in log.steps] == list(range(DEATH_STEPS))
    rows = [json.loads(line) for line in (tmp_path / "out-2" / METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(DEATH_STEPS))
