"""A starter map for a framework bidirl has no map for: ``bidirl trace map suggest FILE``.

From a Ray timeline's span names (:func:`bidirl.ingest.chrome.read_chrome_trace`), one rule per distinct name,
most frequent first, each with a comment giving its count and how many workers ran it. A rule is a *guess* from the
name's words (generation, log-probs, update, weight sync, offload / reload) or, where the name says nothing, an
``ignore`` whose reason asks the user to decide — never a silent default: every guessed rule says ``guess`` in its
comment, and the file says at the top that it must be checked against the framework's source. Ray's own names
(task phases, ``submit_task``) get the rules every shipped map has. Workers: one ``workers`` rule per class that ran
a guessed GPU span, holding ``gpus: 1`` for the user to set.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from bidirl.ingest.chrome import read_chrome_trace
from bidirl.ingest.maps import RAY_OWN, parse_map

#: (pattern over the lower-cased name, rule fields) in order: the first that matches is the guess
GUESSES: tuple = (
    (r"offload|sleep", {"kind": "switch_out", "pool": "rollout_pool"}),
    (r"reload|onload|wake_?up", {"kind": "switch_in", "pool": "rollout_pool"}),
    (r"sync.*weight|weight.*(sync|update)|update_weight|broadcast|load_weights|receive_weights",
     {"kind": "sync", "pool": "rollout_pool"}),
    (r"ref.*log_?prob|reference", {"kind": "chunk", "stage": "ref_logprob", "pool": "trainer_pool"}),
    (r"log_?prob|forward|compute_values", {"kind": "chunk", "stage": "old_logprob", "pool": "trainer_pool"}),
    (r"update|train|fit|backward|optimi[sz]", {"kind": "chunk", "stage": "actor_update", "pool": "trainer_pool"}),
    (r"generat|rollout|sample|decode", {"kind": "generate", "pool": "rollout_pool"}),
)
HEADER = """\
# A STARTER map drafted by `bidirl trace map suggest` from {file}: {names} span names, {events} events, {workers}
# workers. Every rule below is a guess from the name's words or an `ignore` awaiting your decision — check each
# against the framework's source (which method runs on which GPUs) before trusting an import through it, then
# list those files under `sources`. Rename it, set `colocated`, each worker's `gpus` (a replica's tensor-parallel
# size), and what ends a training step (`steps.end`).
"""


def _guess(name: str) -> dict:
    method = name.rsplit(".", 1)[-1].lower()
    for pattern, fields in GUESSES:
        if re.search(pattern, method):
            return dict(fields)
    return {}


def suggest_map(path, name: str = "") -> str:
    """The YAML text of a starter map for the Ray timeline at ``path`` (module doc); it parses as a map."""
    raw = read_chrome_trace(path)
    ev = raw.events
    counts = ev.groupby("label").agg(count=("label", "size"), workers=("worker", "nunique")).reset_index()
    counts = counts.sort_values(["count", "label"], ascending=[False, True], kind="stable")
    rules, comments, gpu_classes = [], [], {}
    for label, count, workers in counts.itertuples(index=False):
        if RAY_OWN.search(label):
            continue
        guess = _guess(label)
        rule = {"name": f"^{re.escape(label)}$"}
        if guess:
            rule.update(guess)
            comments.append(f"guess from the name: {count}× on {workers} worker(s)")
            ran = f"^{re.escape(label.rsplit('.', 1)[0])}\\." if "." in label else f"^{re.escape(label)}$"
            gpu_classes.setdefault(ran, guess["pool"])
        else:
            rule["ignore"] = "TODO: not GPU work? (no guess from the name) — or give kind/pool"
            comments.append(f"{count}× on {workers} worker(s)")
        rules.append(rule)
    rules += [{"name": "^task:(execute|deserialize_arguments|store_outputs)$",
               "ignore": "a phase inside the task's own span"},
              {"name": "^submit_task$", "ignore": "the driver submitting a task (not GPU work)"}]
    comments += ["Ray's own", "Ray's own"]
    has_training = any(r.get("kind") == "chunk" for r in rules)
    doc = {"name": name or Path(str(path)).stem.split(".")[0] + "-draft",
           "description": f"starter map drafted from {Path(str(path)).name} — check every rule",
           "colocated": False, "gpus_per_worker": 1, "sources": [],
           "spans": rules,
           "workers": [{"ran": ran, "pool": pool, "gpus": 1} for ran, pool in gpu_classes.items()],
           "steps": {"end": {"kind": "chunk", "stage": "actor_update"} if has_training else {"kind": "optimizer"}}}
    parse_map(doc, f"{Path(str(path)).name} (suggested)")            # what is written is a valid map
    lines = []
    body = yaml.safe_dump({k: v for k, v in doc.items() if k not in ("spans", "workers", "steps")}, sort_keys=False,
                          allow_unicode=True, width=120)
    lines.append(body.rstrip())
    lines.append("spans:")
    for rule, comment in zip(rules, comments):
        text = yaml.safe_dump(rule, default_flow_style=True, sort_keys=False, allow_unicode=True, width=1000).strip()
        lines.append(f"  - {text}    # {comment}")
    lines.append(yaml.safe_dump({"workers": doc["workers"], "steps": doc["steps"]}, sort_keys=False,
                                default_flow_style=None, width=120).rstrip() if doc["workers"] else
                 yaml.safe_dump({"steps": doc["steps"]}, sort_keys=False, default_flow_style=None).rstrip())
    head = HEADER.format(file=Path(str(path)).name, names=len(rules) - 2, events=len(ev), workers=ev["worker"].nunique())
    return head + "\n".join(lines) + "\n"
