"""The paper's reported numbers (``data/paper/claims.yaml``) and the tolerance rule that judges a reproduction.

:func:`load_claims` reads and validates the file; :func:`judge` decides whether a reproduced value matches
the paper's under the claim's stated tolerance (the policy is written in the YAML file's header). ``judge``
is a pure function of the two values, so a report's ``match`` column is always computed, never written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

KINDS = ("speedup_range", "ratio", "choice", "table", "error", "gap")
#: fit: the number calibrated a model (bidirl.experiments.paper_fit); held-out: a prediction
ROLES = ("fit", "held-out")
#: what a range claim means, in the one sentence claims.yaml's header and the report both carry (a test checks)
RANGE_RULE = ("A range claim matches when every reproduced per-point speedup lies inside the paper's range, each "
              "end widened by the claim's tolerance (containment): the paper's range bounds the speedups of its "
              "settings, and the reproduction predicts those speedups at the settings it ran, so a reproduction of "
              "some of the points need not reach both ends.")
#: a claim of each kind needs one of these tolerance keys
TOLERANCE_KEYS = {"speedup_range": ("gain_rel", "abs", "rel"), "ratio": ("gain_rel", "abs", "rel"),
                  "choice": ("exact",), "table": ("factor",), "error": ("abs_pp",), "gap": ("not_checkable",)}


@dataclass(frozen=True)
class Claim:
    """One number the paper reports (§7), with how it is checked and how close is close enough."""
    id: str
    section: str
    kind: str
    value: Any
    compares: str
    statement: str
    check: dict
    tolerance: dict
    role: str = "held-out"

    @property
    def panels(self) -> tuple:
        return tuple(self.check.get("panels", ()))

    @property
    def metric(self) -> str:
        return self.check["metric"]

    def tolerance_text(self) -> str:
        t = self.tolerance
        if any(k in t for k in ("gain_rel", "rel", "abs")):
            parts = []
            if t.get("gain_rel"):
                parts.append(f"{100 * t['gain_rel']:g} % of the gain")
            if t.get("rel"):
                parts.append(f"{100 * t['rel']:g} % of the value")
            if t.get("abs"):
                parts.append(f"{t['abs']:g}")
            return "± " + " + ".join(parts)
        if "abs_pp" in t:
            return f"±{t['abs_pp']:g} percentage points"
        if "factor" in t:
            return f"within a factor of {t['factor']:g} per cell"
        if t.get("exact"):
            return "exact"
        return "not checkable in simulation"


#: libyaml's safe loader where PyYAML has it (the same documents, parsed about ten times faster: the report reads
#: the claims once per figure), else PyYAML's own
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def default_path() -> Path:
    from bidirl.job.presets import data_dir
    return data_dir() / "paper" / "claims.yaml"


def load_claims(path: Optional[Path] = None) -> list:
    """All claims of ``path`` (default ``data/paper/claims.yaml``), validated; a bad entry raises ValueError
    naming the claim and the field."""
    path = Path(path) if path is not None else default_path()
    raw = yaml.load(path.read_text(), Loader=_LOADER)
    if not isinstance(raw, dict) or not isinstance(raw.get("claims"), list):
        raise ValueError(f"{path}: expected a top-level 'claims:' list — see the file header for the schema")
    out, seen = [], set()
    for i, item in enumerate(raw["claims"]):
        where = f"{path.name}: claims[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where}: expected a mapping, got {item!r}")
        missing = [k for k in ("id", "section", "kind", "value", "compares", "check", "tolerance", "role")
                   if k not in item]
        if missing:
            raise ValueError(f"{where} ({item.get('id', '?')}): missing {missing} — add them (schema in the header)")
        cid = item["id"]
        if cid in seen:
            raise ValueError(f"{where}: duplicate id {cid!r} — ids must be unique")
        seen.add(cid)
        if item["kind"] not in KINDS:
            raise ValueError(f"{where} ({cid}): kind {item['kind']!r} is not one of {KINDS}")
        if item["role"] not in ROLES:
            raise ValueError(f"{where} ({cid}): role {item['role']!r} is not one of {ROLES} — 'fit' when the number "
                             "calibrated a model, 'held-out' when it is predicted")
        need = TOLERANCE_KEYS[item["kind"]]
        if not isinstance(item["tolerance"], dict) or not any(k in item["tolerance"] for k in need):
            raise ValueError(f"{where} ({cid}): a {item['kind']} claim needs tolerance.{' / tolerance.'.join(need)}")
        if not isinstance(item["check"], dict) or "metric" not in item["check"]:
            raise ValueError(f"{where} ({cid}): check must be a mapping with a 'metric'")
        if item["kind"] == "speedup_range":
            v = item["value"]
            if not (isinstance(v, list) and len(v) == 2 and v[0] <= v[1]):
                raise ValueError(f"{where} ({cid}): a speedup_range value is [lo, hi] with lo ≤ hi, got {v!r}")
        out.append(Claim(cid, str(item["section"]), item["kind"], item["value"], str(item["compares"]),
                         str(item.get("statement", "")), dict(item["check"]), dict(item["tolerance"]),
                         item["role"]))
    return out


@dataclass(frozen=True)
class Limit:
    """A stated limit of the models that bears on some claims (``data/paper/limits.yaml``)."""
    id: str
    title: str
    text: str
    claims: tuple


def load_limits(path: Optional[Path] = None, claims: Optional[list] = None) -> list:
    """The model limits of ``path`` (default ``data/paper/limits.yaml``), validated against ``claims`` (default
    :func:`load_claims`): every limit names known claims. ValueError naming the limit and the field."""
    if path is None:
        from bidirl.job.presets import data_dir
        path = data_dir() / "paper" / "limits.yaml"
    path = Path(path)
    raw = yaml.load(path.read_text(), Loader=_LOADER)
    if not isinstance(raw, dict) or not isinstance(raw.get("limits"), list):
        raise ValueError(f"{path}: expected a top-level 'limits:' list — see the file header for the schema")
    known = {c.id for c in (load_claims() if claims is None else claims)}
    out, seen = [], set()
    for i, item in enumerate(raw["limits"]):
        where = f"{path.name}: limits[{i}]"
        missing = [k for k in ("id", "title", "text", "claims") if not isinstance(item, dict) or k not in item]
        if missing:
            raise ValueError(f"{where}: missing {missing} — every limit has id, title, text and claims")
        if item["id"] in seen:
            raise ValueError(f"{where}: duplicate id {item['id']!r}")
        seen.add(item["id"])
        unknown = [c for c in item["claims"] if c not in known]
        if unknown:
            raise ValueError(f"{where} ({item['id']}): claims {unknown} are not in claims.yaml — fix the ids")
        out.append(Limit(str(item["id"]), str(item["title"]), " ".join(str(item["text"]).split()),
                         tuple(item["claims"])))
    return out


# --------------------------------------------------------------------------------------------------
# The verdict
# --------------------------------------------------------------------------------------------------

def allowed_deviation(target: float, tolerance: dict) -> float:
    """How far a reproduced number may be from ``target``: ``abs + gain_rel·|target − 1| + rel·|target|``."""
    t = float(target)
    return (tolerance.get("abs", 0.0) + tolerance.get("gain_rel", 0.0) * abs(t - 1.0)
            + tolerance.get("rel", 0.0) * abs(t))


def _within(x: float, target: float, tolerance: dict) -> bool:
    return abs(float(x) - float(target)) <= allowed_deviation(target, tolerance) + 1e-12


def _cells(paper: dict, reproduced: dict):
    """(paper, reproduced) numeric pairs of a table claim (directions × cost kinds × models)."""
    for direction, row in paper.items():
        if not isinstance(row, dict):
            continue
        for key, values in row.items():
            got = reproduced.get(direction, {}).get(key)
            if got is None:
                yield values, None
                continue
            for p, r in zip(values, got):
                yield p, r


def judge(kind: str, paper: Any, reproduced: Any, tolerance: dict) -> Optional[bool]:
    """Whether ``reproduced`` matches ``paper`` under ``tolerance`` (``None``: nothing to judge).

    * ``speedup_range``: containment (:data:`RANGE_RULE`): the reproduced [min, max] inside the paper's
      [lo, hi] widened at each end by :func:`allowed_deviation` of that end (``abs`` + ``gain_rel``·|paper − 1|
      + ``rel``·|paper|);
    * ``ratio``: the reproduced number (or every number of a reproduced [min, max]) within the same;
    * ``choice``: equality (lists compared as sets);
    * ``table``: every cell within a factor ``factor`` (a missing cell fails);
    * ``error``: within ``abs_pp`` percentage points;
    * ``gap``: always ``None`` — not checkable in simulation.
    """
    if reproduced is None or kind == "gap":
        return None
    if kind == "speedup_range":
        lo, hi = reproduced
        return bool(float(lo) >= paper[0] - allowed_deviation(paper[0], tolerance) - 1e-12
                    and float(hi) <= paper[1] + allowed_deviation(paper[1], tolerance) + 1e-12)
    if kind == "ratio":
        values = reproduced if isinstance(reproduced, (list, tuple)) else [reproduced]
        return all(_within(v, paper, tolerance) for v in values)
    if kind == "choice":
        if isinstance(paper, list):
            return isinstance(reproduced, (list, tuple, set)) and sorted(map(str, paper)) == sorted(map(str, reproduced))
        return reproduced == paper
    if kind == "table":
        f = tolerance["factor"]
        pairs = list(_cells(paper, reproduced))
        return bool(pairs) and all(r is not None and r > 0 and 1 / f <= r / p <= f for p, r in pairs)
    if kind == "error":
        return abs(float(reproduced) - float(paper)) <= tolerance["abs_pp"] + 1e-12
    raise ValueError(f"unknown claim kind {kind!r}; use one of {KINDS}")


__all__ = ["RANGE_RULE", "Claim", "Limit", "load_limits", "KINDS", "ROLES", "load_claims", "judge", "allowed_deviation", "default_path"]
