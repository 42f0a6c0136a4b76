r"""Mapping files: which span of a foreign trace is which bidirl span, on which pool, on how many GPUs.

A map is YAML (shipped maps: ``data/trace_maps/*.yaml``, by name; or any path)::

    name: verl-colocated
    colocated: true                # one pool holds both roles (bidirl's colocated convention: training is
                                   # auxiliary work on the rollout pool, as bidirl.sim.colocated draws it)
    sources: [...]                 # the framework files the rules were written from
    spans:                         # first match wins; `name` is a regular expression searched in the event name,
      - name: 'generate_sequences$'  # `cat` (optional) one searched in its category
        kind: generate             # a bidirl span kind (bidirl.core.protocol.SPAN_KINDS)
        pool: rollout_pool         # the pool the worker running it lives on
        role: primary              # primary (its home pool) | auxiliary (borrowed GPUs); default primary
        stage: actor_update        # chunk spans: the trainer stage (old_logprob | ref_logprob | actor_update)
      - name: 'init_model$'
        ignore: set-up, not part of a step   # known and deliberately left out (counted as ignored, by name)
    workers:                       # optional; first match wins over the worker's span names
      - ran: 'RolloutActor\.'      # the worker ran a span whose name matches ...
        first: 'RolloutActor\.offload$'   # ... and (optional) its first mapped span matches this
        pool: trainer_pool         # then it lives on this pool, all its spans with this role
        role: auxiliary
        label: rollouter           # its lane's name (default: from what it ran)
        gpus: 1                    # GPUs it holds (default: `gpus_per_worker`)
        shares_gpus: false         # true: its GPUs are those of other workers of the pool (a vLLM server actor
                                   # beside the worker processes that hold the GPUs): counted once, in their
                                   # pool's size, never twice
    gpus_per_worker: 1
    steps:
      end: {kind: optimizer}       # a training step ends where a union of these spans (over all workers) ends
    note: ...                      # optional: what a trace read through this map cannot show (said in the notes)

A span that matches no rule is *unmapped*: reported by name with a count, never dropped silently. A worker
whose spans the rules send to two pools, with no worker rule to settle it, raises
:class:`~bidirl.ingest.errors.WorkerPoolConflict`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import yaml

from bidirl.core.protocol import POOLS, PRIMARY, ROLES, SPAN_KINDS, STAGES
from bidirl.ingest.errors import MapError

#: where shipped maps live, relative to the data folder
MAPS_FOLDER = "trace_maps"
#: keys a span rule may have
SPAN_KEYS = frozenset({"name", "cat", "kind", "pool", "role", "stage", "ignore"})
WORKER_KEYS = frozenset({"ran", "first", "pool", "role", "label", "gpus", "shares_gpus"})
#: what a lane is called after its pool: rollout replica, trainer rank, or a process doing both (colocated)
LABELS = ("rollouter", "trainer", "worker")
TOP_KEYS = frozenset({"name", "description", "colocated", "sources", "spans", "workers", "gpus_per_worker", "steps",
                      "note"})


@dataclass(frozen=True)
class SpanRule:
    """One ``spans`` entry (module doc)."""
    index: int
    name: re.Pattern
    cat: Optional[re.Pattern]
    kind: str = ""
    pool: str = ""
    role: str = PRIMARY
    stage: str = ""
    ignore: str = ""

    def matches(self, name: str, cat: str) -> bool:
        return self.name.search(name) is not None and (self.cat is None or self.cat.search(cat) is not None)


@dataclass(frozen=True)
class WorkerRule:
    """One ``workers`` entry (module doc)."""
    index: int
    ran: re.Pattern
    first: Optional[re.Pattern]
    pool: str = ""
    role: str = ""
    gpus: Optional[float] = None
    label: str = ""
    shares_gpus: bool = False


@dataclass(frozen=True)
class TraceMap:
    """A parsed mapping file (module doc); ``path`` is where it came from, for error messages."""
    name: str
    path: str
    spans: tuple
    workers: tuple = ()
    gpus_per_worker: float = 1.0
    colocated: bool = False
    step_end: dict = field(default_factory=lambda: {"kind": "optimizer"})
    sources: tuple = ()
    description: str = ""
    #: what a trace read through this map cannot show (said in every import's notes), e.g. a pool it never records
    note: str = ""

    @property
    def policy(self) -> str:
        """What a timeline read through this map was recorded under: the framework's trainer the map describes (a
        bidirl run's scheduling policy is not in its timeline: ``load_foreign(policy=...)`` names it)."""
        if self.name == "bidirl":
            return "a bidirl policy the timeline does not name (pass --policy)"
        return self.description or f"the trainer of map {self.name}"

    def rule_for(self, name: str, cat: str = "") -> Optional[SpanRule]:
        """The first span rule matching an event, or None (unmapped)."""
        for rule in self.spans:
            if rule.matches(name, cat):
                return rule
        return None


def _where(path: str, what: str) -> str:
    return f"{Path(path).name}, {what}"


def _regex(value, where: str, key: str) -> re.Pattern:
    if not isinstance(value, str) or not value:
        raise MapError(where, f"{key!r} must be a non-empty regular expression string, got {value!r}",
                       "quote it in YAML, e.g. name: 'generate_sequences$'")
    try:
        return re.compile(value)
    except re.error as exc:
        raise MapError(where, f"{key!r} regular expression {value!r} does not compile ({exc.msg} at position "
                              f"{exc.pos})", "fix the expression (Python `re` syntax)") from None


def _choice(value, allowed, where: str, key: str) -> str:
    if value not in allowed:
        raise MapError(where, f"{key!r} must be one of {', '.join(allowed)}, got {value!r}",
                       f"set {key} to one of them")
    return value


def _gpus(value, where: str, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise MapError(where, f"{key!r} must be a GPU count >= 0, got {value!r}", "give the GPUs the worker holds")
    return float(value)


def _span_rule(i: int, raw, path: str) -> SpanRule:
    where = _where(path, f"spans[{i}]")
    if not isinstance(raw, dict):
        raise MapError(where, f"expected a mapping, got {type(raw).__name__}", "write each rule as name/kind/pool")
    unknown = sorted(set(raw) - SPAN_KEYS)
    if unknown:
        raise MapError(where, f"unknown key(s) {unknown}", f"use {', '.join(sorted(SPAN_KEYS))}")
    name = _regex(raw.get("name"), where, "name")
    cat = _regex(raw["cat"], where, "cat") if "cat" in raw else None
    if raw.get("ignore"):
        return SpanRule(i, name, cat, ignore=str(raw["ignore"]))
    for key in ("kind", "pool"):
        if key not in raw:
            raise MapError(where, f"missing {key!r}", f"give the bidirl span {key} (or ignore: <reason>)")
    kind = _choice(raw["kind"], SPAN_KINDS, where, "kind")
    pool = _choice(raw["pool"], POOLS, where, "pool")
    role = _choice(raw.get("role", PRIMARY), ROLES, where, "role")
    stage = raw.get("stage", "")
    if kind == "chunk":
        stage = _choice(stage, STAGES, where, "stage")
    elif stage:
        raise MapError(where, f"'stage' is for chunk spans, this rule's kind is {kind!r}", "drop the stage")
    return SpanRule(i, name, cat, kind, pool, role, stage)


def _worker_rule(i: int, raw, path: str) -> WorkerRule:
    where = _where(path, f"workers[{i}]")
    if not isinstance(raw, dict):
        raise MapError(where, f"expected a mapping, got {type(raw).__name__}", "write each rule as ran/pool/gpus")
    unknown = sorted(set(raw) - WORKER_KEYS)
    if unknown:
        raise MapError(where, f"unknown key(s) {unknown}", f"use {', '.join(sorted(WORKER_KEYS))}")
    ran = _regex(raw.get("ran"), where, "ran")
    first = _regex(raw["first"], where, "first") if "first" in raw else None
    pool = _choice(raw["pool"], POOLS, where, "pool") if "pool" in raw else ""
    role = _choice(raw["role"], ROLES, where, "role") if "role" in raw else ""
    gpus = _gpus(raw["gpus"], where, "gpus") if "gpus" in raw else None
    label = _choice(raw["label"], LABELS, where, "label") if "label" in raw else ""
    shares = raw.get("shares_gpus", False)
    if not isinstance(shares, bool):
        raise MapError(where, f"'shares_gpus' must be true or false, got {shares!r}",
                       "true when the worker's GPUs are other workers' of the same pool")
    return WorkerRule(i, ran, first, pool, role, gpus, label, shares)


def parse_map(doc, path: str = "(map)") -> TraceMap:
    """A :class:`TraceMap` from a parsed YAML document; raises :class:`MapError` naming the rule and field."""
    if not isinstance(doc, dict):
        raise MapError(Path(path).name, "a map is a YAML mapping with a 'spans' list", "see bidirl.ingest.maps")
    unknown = sorted(set(doc) - TOP_KEYS)
    if unknown:
        raise MapError(Path(path).name, f"unknown key(s) {unknown}", f"use {', '.join(sorted(TOP_KEYS))}")
    spans = doc.get("spans")
    if not isinstance(spans, list) or not spans:
        raise MapError(Path(path).name, "'spans' must be a non-empty list of rules", "add at least one rule")
    workers = doc.get("workers") or []
    if not isinstance(workers, list):
        raise MapError(Path(path).name, "'workers' must be a list of rules", "write workers: [ {ran: ..., pool: ...} ]")
    steps = doc.get("steps") or {"end": {"kind": "optimizer"}}
    end = steps.get("end") if isinstance(steps, dict) else None
    if not isinstance(end, dict) or "kind" not in end:
        raise MapError(_where(path, "steps"), "expected steps: {end: {kind: <span kind>[, stage: <stage>]}}",
                       "say which spans end a training step, e.g. the optimizer step")
    _choice(end["kind"], SPAN_KINDS, _where(path, "steps.end"), "kind")
    if "stage" in end:
        _choice(end["stage"], STAGES, _where(path, "steps.end"), "stage")
    return TraceMap(name=str(doc.get("name") or Path(path).stem), path=str(path),
                    spans=tuple(_span_rule(i, r, path) for i, r in enumerate(spans)),
                    workers=tuple(_worker_rule(i, r, path) for i, r in enumerate(workers)),
                    gpus_per_worker=_gpus(doc.get("gpus_per_worker", 1), Path(path).name, "gpus_per_worker"),
                    colocated=bool(doc.get("colocated", False)), step_end=dict(end),
                    sources=tuple(map(str, doc.get("sources") or ())), description=str(doc.get("description", "")),
                    note=str(doc.get("note") or ""))


def shipped_maps() -> dict:
    """``{name: path}`` of the maps shipped in ``data/trace_maps``."""
    from bidirl.job.presets import data_dir
    folder = data_dir() / MAPS_FOLDER
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))}


def load_map(source: Union[str, Path, dict, TraceMap]) -> TraceMap:
    """A map from a shipped name (:func:`shipped_maps`), a YAML path, a parsed document or a TraceMap."""
    if isinstance(source, TraceMap):
        return source
    if isinstance(source, dict):
        return parse_map(source)
    path = Path(source)
    if not path.is_file():
        shipped = shipped_maps()
        if str(source) not in shipped:
            raise MapError(str(source), "no such map file or shipped map",
                           f"pass a YAML path or one of: {', '.join(shipped)}")
        path = shipped[str(source)]
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path.name}, line {mark.line + 1}" if mark is not None else path.name
        raise MapError(where, f"not valid YAML ({getattr(exc, 'problem', exc)})", "fix the YAML syntax") from None
    return parse_map(doc, str(path))


#: span names Ray writes into every timeline (a task's phases, the driver submitting it): they say nothing about
#: which framework ran, so choosing a map ignores them
RAY_OWN = re.compile(r"^(task:(execute|deserialize_arguments|store_outputs)|submit_task)$")
#: frameworks whose Ray timelines name no work a map could place, and why (said when --map auto refuses them)
UNPLACEABLE: tuple = (
    (re.compile(r"^RayRPCServer\.call$"),
     "AReaL on Ray runs every engine call through RayRPCServer.call(method, …) (areal/infra/rpc/ray_rpc_server.py, "
     "lines 23 and 128, at commit 4aef98d): the method — generation, training, weight update — is an argument, "
     "not in the timeline, so no map can tell them apart. AReaL's own trace names it: turn on its perf_tracer "
     "(areal/utils/perf_tracer.py; every engine call is the span rpc.<method>, "
     "infra/rpc/guard/engine_blueprint.py:533), merge the per-rank files with "
     "`python -m areal.tools.perf_trace_converter <trial dir> traces.json` and import that file with --map areal "
     "(its trainer ranks; the inference servers' generation is in no AReaL trace)"),
)
#: a map is chosen when its rules match at least this share of a timeline's distinct span names (Ray's own aside)
AUTO_MIN_MATCHED = 0.9


def _coverage(tmap: TraceMap, names: dict) -> tuple:
    """``(matched names, placed names, placed events, unmatched names, switches)`` of ``names`` (name -> (cat,
    count)); ``switches``: whether the map places any name as a switch (offload / onload, sleep / wake-up)."""
    matched, placed, events, unmatched, switches = 0, 0, 0, [], False
    for name, (cat, count) in names.items():
        rule = tmap.rule_for(name, cat)
        if rule is None:
            unmatched.append(name)
            continue
        matched += 1
        if not rule.ignore:
            placed += 1
            events += count
            switches |= rule.kind in ("switch_in", "switch_out")
    return matched, placed, events, unmatched, switches


def choose_map(labels, cats) -> tuple:
    """``(map, why)``: the shipped map whose rules match the most of a timeline's distinct span names (at least
    :data:`AUTO_MIN_MATCHED` of them, Ray's own names aside, and placing some on a pool), ties broken by the events
    it places; ``why`` says which map and why, beside the runner-up. Raises :class:`MapError` naming the names no
    shipped map places when none qualifies."""
    names: dict = {}
    for label, cat in zip(labels, cats):
        if not RAY_OWN.search(label):
            c, n = names.get(label, (cat, 0))
            names[label] = (c, n + 1)
    if not names:
        raise MapError("--map auto", "the timeline has no span names besides Ray's own (task phases, submit_task)",
                       "pass --map with the map of the framework that ran")
    scored = []
    for name in shipped_maps():
        tmap = load_map(name)
        matched, placed, events, unmatched, switches = _coverage(tmap, names)
        # a colocated job switches its GPUs between roles; a disaggregated one need not: when two maps match the
        # same names (a framework's colocated and separate placements), the one that agrees with the switches wins
        agrees = switches == tmap.colocated
        scored.append((matched / len(names), agrees, events, placed, tmap, unmatched))
    scored.sort(key=lambda s: (s[0], s[1], s[2]), reverse=True)
    share, agrees, events, placed, best, unmatched = scored[0]
    if share < AUTO_MIN_MATCHED or placed == 0:
        known = [why for pattern, why in UNPLACEABLE if any(pattern.search(n) for n in names)]
        if known:
            raise MapError("--map auto", f"this timeline cannot be placed by its span names: {known[0]}",
                           "import the framework's step log instead (--format verl-log reads veRL's), or write a map "
                           "if your build names its methods (`bidirl trace map suggest FILE`)")
        top = sorted(unmatched, key=lambda n: -names[n][1])[:8]
        raise MapError("--map auto", f"no shipped map places this timeline: the closest, {best.name}, matches "
                       f"{share:.0%} of its {len(names)} span names and leaves out "
                       + ", ".join(f"{n} ({names[n][1]}×)" for n in top)
                       + (" …" if len(unmatched) > len(top) else ""),
                       "write a map for it: `bidirl trace map suggest FILE` drafts one from the span names")
    runner = scored[1] if len(scored) > 1 else None
    why = (f"--map auto chose {best.name}: its rules match {share:.0%} of the timeline's {len(names)} span names "
           f"(Ray's own aside) and place {events:,} events on pools")
    if runner is not None:
        why += f"; the next best, {runner[4].name}, matches {runner[0]:.0%}"
        if runner[0] == share:
            why += (" too, but the timeline " + ("has" if best.colocated else "has no") + " role switches (sleep / "
                    "offload), as a " + ("colocated" if best.colocated else "separate-pool") + " job")
    if unmatched:
        why += f"; unmatched: {', '.join(sorted(unmatched)[:5])}"
    return best, why
