"""Where a result comes from, in the one set of words every summary, figure and widget uses.

``simulated``: the stage-time models on a virtual clock (``bidirl.sim``); ``emulated``: model-timed workers on
Ray against the wall clock (``bidirl.cluster.emulated``); ``measured``: real engines (``bidirl.cluster.engines``).
"""

from __future__ import annotations

from typing import Optional

#: where a result comes from: the models alone, model-timed workers on Ray, or real engines
PROVENANCE = {"simulated": "simulated (model prediction)", "emulated": "emulated (model-timed workers on Ray)",
              "measured": "measured (real engines)"}


def provenance_text(provenance: Optional[str]) -> str:
    """``simulated (model prediction)`` etc. for a summary's ``provenance`` (:data:`PROVENANCE`, the one source of
    these words); '' for ``None``."""
    if provenance is None:
        return ""
    if provenance not in PROVENANCE:
        raise ValueError(f"provenance must be one of {', '.join(PROVENANCE)}, got {provenance!r}")
    return PROVENANCE[provenance]
