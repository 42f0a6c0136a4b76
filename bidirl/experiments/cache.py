"""A cache of simulated runs, so a second ``bidirl reproduce`` (or a notebook re-run) does not simulate again.

A run is keyed by what determines it: the job's config (its full dict), the policy, steps and seed, and a
**code version** — a hash of bidirl's source files and of the shipped data (presets, configs) — so any change to
a model, the scheduler or a preset invalidates every entry instead of serving a stale result. An entry holds
what the run produced for the report (its summary values, or how it failed) and how long it took.

Entries are small pickle files, ``<root>/runs/<key[:2]>/<key>.pkl``, written atomically (a temporary file
renamed into place), so two worker processes never see half an entry. The root is ``$BIDIRL_CACHE`` or
``~/.cache/bidirl`` (as for the tiny model), or the folder a caller passes (``bidirl reproduce --cache-dir``).
Only the real simulator's runs are cached; an injected ``simulate_fn`` is not covered by the code version.
``bidirl reproduce`` also keeps its figures' PNGs under ``<root>/png``, keyed by the figure's content
(:func:`bidirl.viz.export.write_pngs`), since rendering them is most of a re-run's time.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import bidirl


def cache_root(cache_dir: Optional[Union[str, Path]] = None) -> Path:
    """``cache_dir``, else ``$BIDIRL_CACHE``, else ``~/.cache/bidirl``."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("BIDIRL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "bidirl"


def code_version() -> str:
    """A hash of every source file of the package and every shipped data file (models, presets, configs):
    what a simulated run's result depends on."""
    from bidirl.job import presets
    digest = hashlib.sha256(bidirl.__version__.encode())
    for root, pattern in ((Path(bidirl.__file__).parent, "*.py"), (presets.data_dir(), "*.yaml")):
        for path in sorted(root.rglob(pattern)):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def run_key(config: dict, policy: str, steps: int, seed: int, version: str) -> str:
    """The cache key of one simulated run under code ``version`` (module doc)."""
    blob = json.dumps({"config": config, "policy": policy, "steps": int(steps), "seed": int(seed),
                       "code": version}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass(frozen=True)
class RunCache:
    """Simulated runs on disk under ``root / "runs"``, for the code ``version`` they were made with."""
    root: Path
    version: str

    @classmethod
    def at(cls, cache_dir: Optional[Union[str, Path]] = None) -> "RunCache":
        """The cache in ``cache_dir`` (default: :func:`cache_root`) for the code as it is now."""
        return cls(cache_root(cache_dir), code_version())

    def key(self, config: dict, policy: str, steps: int, seed: int) -> str:
        return run_key(config, policy, steps, seed, self.version)

    def _path(self, key: str) -> Path:
        return self.root / "runs" / key[:2] / f"{key}.pkl"

    def get(self, key: str) -> Optional[Any]:
        """The entry stored under ``key``, or None (missing, or unreadable: then it is simply recomputed)."""
        try:
            with open(self._path(key), "rb") as f:
                return pickle.load(f)
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError):
            return None

    def put(self, key: str, entry: Any) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                pickle.dump(entry, f)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


__all__ = ["RunCache", "cache_root", "code_version", "run_key"]
