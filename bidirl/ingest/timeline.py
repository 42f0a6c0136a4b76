"""A Ray timeline (any Chrome trace) through a map: foreign spans become bidirl spans on pools and lanes.

Steps: every event is matched against the map's span rules once per distinct ``(Class.method, cat)`` (a trace of 100 k
spans has a few dozen distinct names, so matching costs nothing); each worker (one ``pid``/``tid`` of the trace:
one Ray worker process) gets its pool from a worker rule or from its spans' rules — two pools is a
:class:`~bidirl.ingest.errors.WorkerPoolConflict`; lanes are named ``<pool>/<label>/<i>`` (label ``rollouter``,
``trainer`` or ``worker`` for a process doing both, as veRL's colocated ``WorkerDict`` does), numbered by first
activity. Training steps end where a union of the map's ``steps.end`` spans ends (bidirl's StepRecord: ``start`` =
the previous step's end, ``wait`` = until the step's first training span).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from bidirl.core.protocol import POOLS, StepRecord
from bidirl.ingest.chrome import read_chrome_trace
from bidirl.ingest.errors import WorkerPoolConflict
from bidirl.ingest.maps import TraceMap, choose_map, load_map

#: the --map value that picks a shipped map from the span names (bidirl.ingest.maps.choose_map)
AUTO = "auto"
from bidirl.ingest.run import ImportedRun, count_names
from bidirl.results.metrics import union_intervals
from bidirl.results.trace import EventLog, Span

TRAINING_KINDS = ("chunk", "optimizer", "grad_merge")
US = 1e-6
#: spans per progress-bar update when building records
CHUNK = 20_000


def _rules(labels: list, cats: list, tmap: TraceMap) -> np.ndarray:
    """One entry per event: the index of its rule (-1: unmapped); each distinct (label, cat) is matched once."""
    table: dict = {}
    out = np.empty(len(labels), dtype=np.int64)
    for i, key in enumerate(zip(labels, cats)):
        if key not in table:
            rule = tmap.rule_for(*key)
            table[key] = -1 if rule is None else rule.index
        out[i] = table[key]
    return out


def _worker_pools(workers: list, labels: list, pools: list, order: np.ndarray, tmap: TraceMap, where: str) -> dict:
    """worker key -> (pool, role override or '', gpus, label override or '', shares its GPUs) for every worker with
    mapped spans.
    ``order`` lists the events by start time (a worker's first span is its first in that order)."""
    names: dict = {}
    span_pools: dict = {}
    first: dict = {}
    for i in order:
        w = workers[i]
        first.setdefault(w, labels[i])
        names.setdefault(w, set()).add(labels[i])
        span_pools.setdefault(w, {}).setdefault(pools[i], set()).add(labels[i])
    out = {}
    for key in sorted(names):
        chosen = None
        for rule in tmap.workers:
            if any(rule.ran.search(n) for n in names[key]) and (rule.first is None or rule.first.search(first[key])):
                chosen = rule
                break
        found = sorted(span_pools[key])
        if chosen is not None and chosen.pool:
            pool = chosen.pool
        elif len(found) > 1:
            raise WorkerPoolConflict(f"{where}, worker {key}",
                                     "the map sends this worker's spans to two pools: " +
                                     "; ".join(f"{p} ({', '.join(sorted(span_pools[key][p])[:3])})" for p in found),
                                     "a worker holds its GPUs on one pool: fix the span rules' pools, or add a "
                                     "workers rule (ran/first → pool) that says where this worker lives")
        else:
            pool = found[0]
        gpus = chosen.gpus if chosen is not None and chosen.gpus is not None else tmap.gpus_per_worker
        out[key] = (pool, chosen.role if chosen is not None else "", float(gpus),
                    chosen.label if chosen is not None else "", bool(chosen is not None and chosen.shares_gpus))
    return out


def _label(kinds: set) -> str:
    gen = "generate" in kinds
    train = bool(kinds & set(TRAINING_KINDS))
    return "worker" if gen and train else "rollouter" if gen else "trainer" if train else "worker"


def step_records(spans: pd.DataFrame, end_kind: str, end_stage: str = "") -> list:
    """StepRecords of a mapped spans table: a step ends where a union piece of the ``end_kind`` (and
    ``end_stage``) spans over all workers ends; it starts where the previous one ended (the first: at the first
    span). ``wait``: from the step's start to its first training span; tokens and samples are not in a timeline
    (0)."""
    sel = spans["kind"] == end_kind
    if end_stage:
        sel &= spans["detail"].map(lambda d: d.get("stage") == end_stage)
    _, ends = union_intervals(spans.loc[sel, "start"].to_numpy(), spans.loc[sel, "end"].to_numpy())
    if not len(ends):
        return []
    train = spans[spans["kind"].isin(TRAINING_KINDS)]
    t_starts = np.sort(train["start"].to_numpy())
    out, prev = [], float(spans["start"].min())
    for k, end in enumerate(ends):
        i = np.searchsorted(t_starts, prev, side="left")
        first = float(t_starts[i]) if i < len(t_starts) and t_starts[i] <= end else float(end)
        out.append(StepRecord(step=k, start=prev, end=float(end), tokens=0, samples=0, wait=first - prev,
                              consume=float(end) - first, version=k + 1))
        prev = float(end)
    return out


def import_timeline(path, tmap, *, origin_s=None, pool_gpus_override=None, progress: bool = False) -> ImportedRun:
    """Import a Ray timeline (Chrome trace) with map ``tmap`` (a TraceMap, a shipped map's name or a path).

    ``origin_s``: the trace time (seconds; Ray's are Unix times) that becomes 0 — default the first mapped span's
    start. ``pool_gpus_override``: GPUs per pool when the workers' sum is not the pool (default: the sum)."""
    raw = read_chrome_trace(path)
    ev = raw.events
    labels, cats, workers = ev["label"].tolist(), ev["cat"].tolist(), ev["worker"].tolist()
    why = None
    if isinstance(tmap, str) and tmap == AUTO:
        tmap, why = choose_map(labels, cats)
    tmap = load_map(tmap)
    rule_idx = _rules(labels, cats, tmap)
    rules = tmap.spans
    ignored_rule = np.array([bool(r.ignore) for r in rules] + [False], dtype=bool)    # index -1: unmapped
    mapped = rule_idx >= 0
    ignore = ignored_rule[rule_idx] & mapped
    unmapped = count_names([labels[i] for i in np.flatnonzero(~mapped)])
    ignored = count_names([labels[i] for i in np.flatnonzero(ignore)],
                          [rules[rule_idx[i]].ignore for i in np.flatnonzero(ignore)])
    keep = np.flatnonzero(mapped & ~ignore)
    kept_rules = [rules[rule_idx[i]] for i in keep]
    k_labels = [labels[i] for i in keep]
    k_workers = [workers[i] for i in keep]
    k_pools = [r.pool for r in kept_rules]
    start_us = ev["start_us"].to_numpy()[keep]
    end_us = ev["end_us"].to_numpy()[keep]
    order = np.argsort(start_us, kind="stable")
    name = Path(raw.path).name
    pools = _worker_pools(k_workers, k_labels, k_pools, order, tmap, f"{name} with map {tmap.name}")
    # lanes: <pool>/<label>/<i>, numbered by first activity within (pool, label)
    kinds_of: dict = {}
    for w, r in zip(k_workers, kept_rules):
        kinds_of.setdefault(w, set()).add(r.kind)
    first_seen = list(dict.fromkeys(k_workers[i] for i in order))
    lane, count, rows = {}, {}, []
    for key in first_seen:
        pool, _, gpus, label, shares = pools[key]
        label = label or _label(kinds_of[key])
        i = count.get((pool, label), 0)
        count[(pool, label)] = i + 1
        lane[key] = f"{pool}/{label}/{i}"
        rows.append((lane[key], key, raw.workers.get(key, key), label, pool, gpus, shares))
    workers_df = pd.DataFrame(rows, columns=["worker", "source", "name", "label", "pool", "gpus", "shares_gpus"])
    origin_us = (float(start_us.min()) if len(keep) else 0.0) if origin_s is None else float(origin_s) / US
    starts = (start_us - origin_us) * US
    ends = (end_us - origin_us) * US
    k_kinds = [r.kind for r in kept_rules]
    table = pd.DataFrame({"kind": np.array(k_kinds, dtype=object), "start": starts, "end": ends,
                          "detail": [{"stage": r.stage} for r in kept_rules]})
    steps = step_records(table, tmap.step_end["kind"], tmap.step_end.get("stage", ""))
    step_of = step_index(steps, starts).tolist()
    spans = []
    cols = zip(k_workers, kept_rules, starts.tolist(), ends.tolist(), step_of, k_labels)
    for key, rule, a, b, k, label in tqdm(cols, total=len(keep), disable=not progress, desc="mapping spans",
                                          unit="span", miniters=CHUNK):
        pool, role, _, _, _ = pools[key]
        detail = {"name": label, "stage": rule.stage} if rule.stage else {"name": label}
        spans.append(Span(lane[key], pool, role or rule.role, rule.kind, a, b, k, k, detail))
    log = EventLog(spans=spans, steps=steps)
    # a worker whose GPUs are other workers' of its pool (shares_gpus) adds none to the pool's size
    holders = workers_df[~workers_df["shares_gpus"].astype(bool)]
    pool_gpus = {p: float(holders.loc[holders["pool"] == p, "gpus"].sum()) for p in POOLS}
    if pool_gpus_override is not None:
        pool_gpus = {p: float(pool_gpus_override.get(p, 0.0)) for p in POOLS}
    notes = [why] if why else []
    if tmap.note:
        notes.append(tmap.note)
    if tmap.colocated:
        notes.append("colocated: one pool holds every GPU; training is drawn as auxiliary work on the generation "
                     "GPUs (bidirl's convention for veRL's colocated trainer)")
    if len(unmapped):
        notes.append(f"{int(unmapped['count'].sum())} events matched no rule of map {tmap.name} "
                     f"({len(unmapped)} names; see unmapped): they are not drawn or counted as busy")
    if not steps:
        notes.append(f"no {tmap.step_end['kind']} spans: the trace has no complete training step, so there is no "
                     "per-step breakdown")
    return ImportedRun(log=log, source=str(path), format="ray-timeline", map_name=tmap.name,
                       pool_gpus=pool_gpus, gpus_per_worker=dict(zip(workers_df["worker"], workers_df["gpus"])),
                       unmapped=unmapped, ignored=ignored, workers=workers_df, origin_s=origin_us * US,
                       resolution_s=US, coarse=False, colocated=tmap.colocated, notes=notes,
                       policy=tmap.policy)


def step_index(steps: list, starts) -> np.ndarray:
    """The step each span starting at ``starts`` belongs to: the first step ending after it starts (spans after
    the last step end belong to the last step); zeros when there are no steps."""
    starts = np.asarray(starts, dtype=np.float64)
    if not steps:
        return np.zeros(starts.size, dtype=np.int64)
    ends = np.array([s.end for s in steps])
    return np.minimum(np.searchsorted(ends, starts, side="right"), len(steps) - 1).astype(np.int64)


__all__ = ["import_timeline", "step_records", "step_index", "TRAINING_KINDS"]
