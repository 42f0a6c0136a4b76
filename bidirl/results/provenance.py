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


#: where stage-time records (observed next to predicted times) come from: real work timed on this machine, or the
#: seeded generator that plays the hardware (a perturbed model plus noise). A figure of records says which.
RECORD_SOURCES = {"measured": "measured", "synthetic": "synthetic (seeded generator, not a measurement)"}


def mark_records(records, source: str, label: str):
    """``records`` (a pandas DataFrame) tagged with where they come from (``source``, one of
    :data:`RECORD_SOURCES`) and how a figure names them (``label``, which must say the source's words and no other
    source's). The tags travel in ``DataFrame.attrs`` through copies, selections and group-bys. Returns
    ``records``."""
    if source not in RECORD_SOURCES:
        raise ValueError(f"record source must be one of {', '.join(RECORD_SOURCES)}, got {source!r}")
    words = RECORD_SOURCES[source].split(" (")[0]
    others = [k for k in RECORD_SOURCES if k != source and k in label]
    if words not in label or others:
        raise ValueError(f"label {label!r} of {source} records must say {words!r}"
                         + (f" and not {others}" if others else ""))
    records.attrs["source"], records.attrs["label"] = source, label
    return records


def records_label(records) -> str:
    """The label :func:`mark_records` gave ``records``; ValueError when they do not say where they come from."""
    source = getattr(records, "attrs", {}).get("source")
    if source not in RECORD_SOURCES:
        raise ValueError("these records do not say where they come from: tag them with "
                         "bidirl.results.provenance.mark_records(records, 'measured' | 'synthetic', label)")
    return records.attrs["label"]
