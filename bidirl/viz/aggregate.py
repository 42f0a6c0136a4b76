"""Thin a spans table out for drawing when it has too many rectangles for a browser to stay interactive.

A plotly bar is an SVG path: past about :data:`MAX_BARS` (20,000) rectangles a Gantt pans and hovers slowly, and
past :data:`MAX_LANES` (64) lanes its rows are thinner than a line of text. Above either threshold:

* **lanes** — the workers of one pool and label (``rollout_pool/rollouter/…``) are drawn in buckets of ``k``
  consecutive workers, ``k`` the smallest that brings the lanes to at most :data:`MAX_LANES`; a bucket's lane is
  busy when any of its workers is (the union of their spans);
* **time** — on each lane, spans of one ``(kind, role)`` closer than ``Δ`` are merged into one bar, ``Δ`` starting
  at the time axis over :data:`TIME_BINS` (about a pixel of a 1000 px figure's plot area) and doubling until at most
  :data:`MAX_BARS` bars remain; a merged bar's ``detail`` says how many spans it holds.

Only the drawing is thinned: idle, bubbles and every metric read the full log.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from bidirl.core.protocol import POOLS
from bidirl.results.metrics import union_intervals

#: above this many spans a Gantt is thinned (module doc)
MAX_BARS = 20_000
#: above this many lanes workers are bucketed (module doc)
MAX_LANES = 64
#: the first merge distance is the time axis over this many bins
TIME_BINS = 2_000


@dataclass(frozen=True)
class Thinned:
    """The thinned spans (a spans table), its lanes in order with their tick labels, and what was done."""
    spans: pd.DataFrame
    lanes: list
    labels: list
    bucket: int
    merge_s: float
    original: int

    @property
    def note(self) -> str:
        if self.bucket == 1 and self.merge_s == 0:
            return ""
        parts = [f"{self.original:,} spans drawn as {len(self.spans):,} bars"]
        if self.bucket > 1:
            parts.append(f"lanes of {self.bucket} workers (busy when any is)")
        if self.merge_s > 0:
            parts.append(f"gaps under {self.merge_s:.3g} s merged")
        return "aggregated for drawing: " + ", ".join(parts)


def _split(worker: str) -> tuple:
    parts = str(worker).split("/")
    index = int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else -1
    return parts[0], parts[1] if len(parts) > 1 else "", index


def _lane_sort(lane: str) -> tuple:
    pool, label, index = _split(lane)
    return (POOLS.index(pool) if pool in POOLS else len(POOLS), label, index, lane)


def thin(spans: pd.DataFrame, max_bars: int = MAX_BARS, max_lanes: int = MAX_LANES) -> Thinned:
    """The spans to draw (module doc). Below both thresholds the table comes back unchanged."""
    workers = sorted(set(spans["worker"].astype(str)), key=_lane_sort)
    if len(spans) <= max_bars and len(workers) <= max_lanes:
        return Thinned(spans, workers, workers, 1, 0.0, len(spans))
    bucket = max(1, math.ceil(len(workers) / max_lanes))
    lane_of, members = {}, {}
    for w in workers:
        pool, label, index = _split(w)
        lane = f"{pool}/{label}/{(index // bucket) * bucket}" if index >= 0 and bucket > 1 else w
        lane_of[w] = lane
        members.setdefault(lane, []).append(index)
    lanes = sorted(members, key=_lane_sort)
    labels = [f"{lane}–{max(members[lane])} ({len(members[lane])} workers)" if len(members[lane]) > 1 else lane
              for lane in lanes]
    df = spans.assign(worker=spans["worker"].astype(str).map(lane_of))
    t0, t1 = float(df["start"].min()), float(df["end"].max())
    gap = (t1 - t0) / TIME_BINS if len(spans) > max_bars else 0.0
    while True:
        out = _merge(df, gap)
        if len(out) <= max_bars or gap <= 0 or gap > (t1 - t0):
            break
        gap *= 2
    return Thinned(out, lanes, labels, bucket, gap, len(spans))


def _merge(df: pd.DataFrame, gap: float) -> pd.DataFrame:
    """Per lane and (kind, role): the union of the spans with gaps shorter than ``gap`` closed."""
    rows = {k: [] for k in ("worker", "pool", "role", "kind", "start", "end", "step", "version", "detail")}
    for (lane, pool, role, kind), g in df.groupby(["worker", "pool", "role", "kind"], sort=True):
        s = g["start"].to_numpy(dtype=np.float64)
        e = g["end"].to_numpy(dtype=np.float64)
        us, ue = union_intervals(s, e + gap)
        ue = ue - gap
        first = np.searchsorted(np.sort(s), us, side="left")
        counts = np.diff(np.append(first, s.size))
        steps = g["step"].to_numpy() if "step" in g else np.zeros(s.size, dtype=np.int64)
        order = np.argsort(s, kind="stable")
        step_first = steps[order][first] if s.size else steps
        for a, b, n, k in zip(us, np.maximum(ue, us), counts, step_first):
            rows["worker"].append(lane), rows["pool"].append(pool), rows["role"].append(role)
            rows["kind"].append(kind), rows["start"].append(float(a)), rows["end"].append(float(b))
            rows["step"].append(int(k)), rows["version"].append(int(k))
            rows["detail"].append({"spans": int(n)} if n > 1 else {})
    return pd.DataFrame(rows)
