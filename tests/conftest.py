"""Shared test settings and fixtures: deterministic hypothesis profiles; the session's tiny model, Ray, kept engine
workers and reference run.

``default`` is used on a developer machine, ``ci`` (fewer examples) when ``CI`` is set or when
``HYPOTHESIS_PROFILE=ci``. Both are derandomized (the same examples every run, so a failure reproduces)
and have no deadline (timing is never asserted in tests).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

_COMMON = dict(derandomize=True, deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow])

settings.register_profile("default", max_examples=100, **_COMMON)
settings.register_profile("ci", max_examples=25, **_COMMON)

settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default"))


def pytest_configure(config):
    config.addinivalue_line("markers", "fresh_workers: compares a run on fresh engine workers with one on kept "
                                       "workers (runs first of the tests on the session's kept workers)")


def pytest_collection_modifyitems(config, items):
    """The test marked ``fresh_workers`` runs just before the first test on the session's kept workers
    (``kept_workers``): its fresh run is what starts the shared worker shape (``tests/engine_jobs.py``), which the
    tests after it take, instead of ending a set an earlier test started and starting another. Every other test
    keeps its place, so a module's tests stay together. Only the time of a session depends on this order, never a
    result: every kept run resets its workers to a fresh engine's state (the ``fresh_workers`` test checks that),
    and the suite passes in reverse order too."""
    kept = [i for i, item in enumerate(items) if "kept_workers" in getattr(item, "fixturenames", ())]
    first = next((i for i in kept if items[i].get_closest_marker("fresh_workers")), None)
    if kept and first is not None and first != kept[0]:
        items.insert(kept[0], items.pop(first))


#: the session's kept workers, and the node id of the last test that uses them (``pytest_runtest_teardown``)
KEPT = pytest.StashKey[object]()
LAST_ON_KEPT = pytest.StashKey[str]()


def pytest_collection_finish(session):
    on_kept = [item.nodeid for item in session.items if "kept_workers" in getattr(item, "fixturenames", ())]
    session.config.stash[LAST_ON_KEPT] = on_kept[-1] if on_kept else ""


def pytest_runtest_teardown(item, nextitem):
    """The kept workers end after the last test that uses them (directly or through a fixture), not at the
    session's end: the tests after it start workers of their own, and an idle vLLM rollouter is not free — vLLM's
    thirteen gloo groups on CPU each wake every 10 ms (≈ 3 % of a core per rollouter, measured by its threads' CPU
    time)."""
    kept = item.config.stash.get(KEPT, None)
    if kept is not None and item.nodeid == item.config.stash.get(LAST_ON_KEPT, ""):
        kept.release()


@pytest.fixture
def user_data(tmp_path, monkeypatch):
    """A copy of the shipped data folder that ``BIDIRL_DATA`` points at (user presets and configs)."""
    import shutil
    from bidirl.job import presets
    root = tmp_path / "data"
    shutil.copytree(presets.data_dir(), root)
    monkeypatch.setenv("BIDIRL_DATA", str(root))
    return root


@pytest.fixture(scope="session")
def model_dir():
    """The built-in tiny model, from the project's cache root (``$BIDIRL_CACHE`` or ``~/.cache/bidirl``, where
    ``make demo`` and the notebooks find it too): built and warm-started on first use only. Its folder is named by
    a hash of everything that determines its weights and is renamed into place only when complete, under a lock
    (``bootstrap.ensure_tiny_model``), so a cached folder is the model a build would write, and xdist workers and
    the parts of ``make test`` build it once between them."""
    from bidirl.rl.bootstrap import ensure_tiny_model
    return ensure_tiny_model()


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for every integration test that runs on Ray in this process; each test's runs start their own
    placement group on it. 12 GPU slots: the largest job a test runs (8) beside the set of engine workers the
    session keeps (``kept_workers``: tiny-cpu's 4), which holds its slots between runs. A ``bidirl run`` in a
    subprocess gets that process's own embedded Ray, or joins this one as a driver of its own
    (``ray_session_env``)."""
    ray = pytest.importorskip("ray")
    from bidirl.cluster.slots import workers_at_driver_priority
    os.environ.setdefault("RAY_enable_metrics_collection", "0")
    workers_at_driver_priority()          # as the library's embedded Ray: engines at pytest's priority
    ray.shutdown()
    for attempt in range(3):           # a loaded machine may miss Ray's fixed 30 s node-registration deadline
        try:
            ray.init(num_cpus=4, resources={"gpu_slot": 12.0}, include_dashboard=False, log_to_driver=False,
                     namespace="bidirl-tests")
            break
        except Exception as exc:
            if "timed out during startup" not in str(exc) or attempt == 2:
                raise
            ray.shutdown()
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def kept_workers(ray_session, request):
    """Engine workers kept for the session (``bidirl.cluster.kept_workers.KeptWorkers``, the library's own reuse that
    notebooks and side-by-side runs use): a test's run takes the set started for its shape, reset to a fresh
    engine's state, so a shape's engines start once per session, not once per run. One set is held at a time, and
    none after the last test that uses them (``pytest_runtest_teardown``)."""
    from bidirl.cluster.kept_workers import KeptWorkers
    with KeptWorkers(capacity=1) as kept:
        request.config.stash[KEPT] = kept
        yield kept


@dataclass(frozen=True)
class ReferenceRun:
    """The result of the reference run, the folder of its checkpoints and what its driver put through Ray."""
    result: object           # bidirl.results.run_result.RunResult
    checkpoints: Path        # step-000001 ... step-000010, every one kept
    meter: object            # bidirl.cluster.engines.object_store_meter.ObjectStoreMeter, polled after every call

    def of(self, config, policy: str) -> "ReferenceRun":
        """This run, after checking that it is the run of ``config`` under ``policy`` a test means to read (a test
        that changed its job would otherwise compare against another job's run)."""
        got = (self.result.config, self.result.policy)
        assert got == (config, policy), f"the reference run is of another job or policy ({got[1]!r}, not {policy!r})"
        return self


@pytest.fixture(scope="session")
def reference_run(model_dir, kept_workers, tmp_path_factory):
    """One fault-free run of the shared job (``engine_jobs.reference()``: s = 0, a recovery snapshot every 3 steps)
    under ``opportunistic`` for 10 steps on the kept workers, checkpointed after every step, with the driver's Ray
    traffic metered. Three tests would each run exactly this run: the chaos runs' and the killed driver's reference
    (``test_chaos.py``) and the borrowing side of borrowing against no borrowing (``test_engine_driver.py``);
    they share it, and the runs between them are unaffected by it: a kept run resets every worker first."""
    import engine_jobs
    from bidirl.cluster.engines.driver import EngineDriver
    from bidirl.cluster.engines.object_store_meter import ObjectStoreMeter

    cfg, steps = engine_jobs.reference(), engine_jobs.REFERENCE_STEPS
    folder = tmp_path_factory.mktemp("reference-run")
    driver = EngineDriver(cfg, engine_jobs.REFERENCE_POLICY, steps, cfg.seed, model_dir=str(model_dir),
                          kept_workers=kept_workers, checkpoint_dir=str(folder), keep=steps)
    with ObjectStoreMeter() as meter:
        result = driver.run(kill=lambda d: meter.poll())
    return ReferenceRun(result, folder, meter)


@pytest.fixture
def ray_session_env(ray_session):
    """The environment of a ``bidirl run --address auto`` subprocess that joins the session's Ray as a driver of its
    own (``RAY_ADDRESS``, the session's GCS): its job's actors and placement group end when that process ends, the
    session's kept workers are the pytest process's and stay."""
    return dict(os.environ, RAY_ADDRESS=ray_session.get_runtime_context().gcs_address)
