"""Shared test settings: deterministic hypothesis profiles.

``default`` is used on a developer machine, ``ci`` (fewer examples) when ``CI`` is set or when
``HYPOTHESIS_PROFILE=ci``. Both are derandomized (the same examples every run, so a failure reproduces)
and have no deadline (timing is never asserted in tests).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

_COMMON = dict(derandomize=True, deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow])

settings.register_profile("default", max_examples=100, **_COMMON)
settings.register_profile("ci", max_examples=25, **_COMMON)

settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default"))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """The built-in tiny model, created and warm-started once per session (``$BIDIRL_CACHE`` when set)."""
    from bidirl.rl.bootstrap import ensure_tiny_model
    cache = os.environ.get("BIDIRL_CACHE")
    if not cache:
        # the xdist workers of one session share its temporary folder, so the model is built once (under the
        # builder's own lock: bootstrap.ensure_tiny_model), not once per worker
        base = tmp_path_factory.getbasetemp()
        cache = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "bidirl-cache"
    return ensure_tiny_model(cache_dir=cache)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for every integration test that runs on Ray in this process; each test's runs start their own
    placement group on it. 12 GPU slots: the largest job a test runs (8) beside the set of engine workers the
    session keeps (``kept_workers``: tiny-cpu's 4), which holds its slots between runs. Tests that start
    ``bidirl run`` in a subprocess get that process's own embedded Ray."""
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_enable_metrics_collection", "0")
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
def kept_workers(ray_session):
    """Engine workers kept for the whole session (``bidirl.cluster.pool.KeptWorkers``, the library's own reuse
    that notebooks and side-by-side runs use): a test's run takes the set started for its shape, reset to a fresh
    engine's state, so a shape's engines start once per session, not once per run. One set is held at a time."""
    from bidirl.cluster.pool import KeptWorkers
    with KeptWorkers(capacity=1) as kept:
        yield kept


@pytest.fixture
def ray_head():
    """A cluster of ``ray start --head --block`` (4 CPUs, 4 GPU slots) for ``bidirl run --address auto``: yields
    the environment that points ``auto`` at it (``RAY_ADDRESS``). The head runs in its own session, stopped by
    signalling that process group only (``ray stop`` would stop every Ray instance on the machine)."""
    ray_cli = Path(sys.executable).parent / "ray"
    env = dict(os.environ, RAY_enable_metrics_collection="0")
    for attempt in range(3):           # a loaded machine may miss Ray's fixed 30 s node-registration deadline
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ray_tmp = tempfile.mkdtemp(prefix="ray")      # short: Ray's socket paths must stay under 108 bytes
        head = subprocess.Popen([str(ray_cli), "start", "--head", "--block", f"--port={port}", "--num-cpus=4",
                                 '--resources={"gpu_slot": 4}', f"--temp-dir={ray_tmp}", "--include-dashboard=false",
                                 "--disable-usage-stats"], env=env, start_new_session=True, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        lines, started = [], threading.Event()

        def pump(out=head.stdout, lines=lines, started=started):
            for line in out:
                lines.append(line)
                if "Ray runtime started" in line:
                    started.set()
        threading.Thread(target=pump, daemon=True).start()
        deadline = time.time() + 300
        while not started.wait(1) and head.poll() is None and time.time() < deadline:
            pass
        if started.is_set() or attempt == 2:
            break
        _stop_group(head, ray_tmp)
    try:
        assert started.is_set(), "ray start --head did not start:\n" + "".join(lines)[-3000:]
        yield dict(env, RAY_ADDRESS=f"127.0.0.1:{port}")
    finally:
        _stop_group(head, ray_tmp)


def _stop_group(head, ray_tmp: str) -> None:
    """Stop a ``ray start --head --block`` process and its session's processes, and remove its temp folder."""
    import shutil
    try:
        os.killpg(head.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        head.wait(5)            # it stops its session's processes; the group is killed below in any case
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(60)
    try:                                              # stragglers of the group (workers that outlive the head)
        os.killpg(head.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    shutil.rmtree(ray_tmp, ignore_errors=True)
