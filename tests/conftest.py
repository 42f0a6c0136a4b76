"""Shared test settings: deterministic hypothesis profiles.

``default`` is used on a developer machine, ``ci`` (fewer examples) when ``CI`` is set or when
``HYPOTHESIS_PROFILE=ci``. Both are derandomized (the same examples every run, so a failure reproduces)
and have no deadline (timing is never asserted in tests).
"""

from __future__ import annotations

import os

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
    cache = os.environ.get("BIDIRL_CACHE") or tmp_path_factory.mktemp("bidirl-cache")
    return ensure_tiny_model(cache_dir=cache)
