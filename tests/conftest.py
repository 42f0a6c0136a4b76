"""Shared test settings: deterministic hypothesis profiles.

``default`` is used on a developer machine, ``ci`` (fewer examples) when ``CI`` is set or when
``HYPOTHESIS_PROFILE=ci``. Both are derandomized (the same examples every run, so a failure reproduces)
and have no deadline (timing is never asserted in tests).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = dict(derandomize=True, deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow])

settings.register_profile("default", max_examples=100, **_COMMON)
settings.register_profile("ci", max_examples=25, **_COMMON)

settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default"))
