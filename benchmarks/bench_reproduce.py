"""``bidirl reproduce`` end to end (every panel, claims check, report, figures), on both cores.

* ``reproduce_quick``: ``--quick`` into a fresh run cache (``cold``: every run simulated), then the same again
  (``warm``: every run answered by the cache, only the report rebuilt);
* ``reproduce_full``: the full evaluation into a fresh cache (with ``--quick`` this benchmark runs the quick
  variant, so ``bidirl bench --quick`` stays short).

Seconds of wall time, measured.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path


def _reproduce(quick: bool, root: Path, name: str) -> float:
    from bidirl.experiments import reproduce
    t0 = time.perf_counter()
    reproduce(root / name, quick=quick, progress=False, cache_dir=root / "cache")
    return time.perf_counter() - t0


def bench_quick(_quick: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="bidirl-bench-") as tmp:
        root = Path(tmp)
        cold = _reproduce(True, root, "cold")
        warm = _reproduce(True, root, "warm")
    return {"cold_seconds": (cold, "s"), "warm_seconds": (warm, "s")}


def bench_full(quick: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="bidirl-bench-") as tmp:
        return {"cold_seconds": (_reproduce(quick, Path(tmp), "cold"), "s")}


BENCHMARKS = {"reproduce_quick": bench_quick, "reproduce_full": bench_full}
