"""One record per admitted borrowing window: the work it ran, or why it ran none (paper §5.2).

An admitted decision (:class:`bidirl.core.protocol.Decision`) lends a pool: the guest role switches in, runs
the other stage's work as auxiliaries (§3.2), then the pool is revoked and switches out. The hot switch is paid
whether or not any work reaches the borrowed pool, so a window that ran none is exactly what the admission rule
exists to prevent; :func:`borrow_windows` makes every admitted window answer for itself from the event log:

* ``work_spans`` / ``work_s`` / ``work`` — the auxiliary work spans on the borrowed pool inside the window (the
  guest stage's kinds: ``generate`` for rollout on the trainer pool, ``chunk`` for training on the rollout pool);
* ``reason`` — empty when the window ran work; otherwise what the log shows happened instead:

  - ``revoked with no work``: the scheduler revoked the lease having sent the guests nothing, and said why in the
    switch out's ``detail["no_work"]`` (``bidirl.core.protocol.Switch.no_work``): the explanation quotes it;
  - ``primaries finished first``: the work the window was admitted for was done by the home pool before the
    switch-in ended (rollout: the step's batch was complete, ``StepRecord.start + wait``; training: the step's
    last primary chunk had ended), so the coordinator revoked the lease on arrival;
  - ``no switch-in``: the log holds the decision but no ``switch_in`` span (the run ended first);
  - ``work never handed over``: the switch-in ended with the work still open and no auxiliary work span followed
    — the log does not hold why (a failure, or a drawing of a log that dropped spans).

Only the event log is read (spans, steps, decisions), so simulated, emulated and measured runs are judged alike.
"""

from __future__ import annotations

import math
from typing import Union

import numpy as np
import pandas as pd

from bidirl.core.protocol import BORROWED_POOL, ROLLOUT_ON_TRAINER_POOL, TRAINER_ON_ROLLOUT_POOL
from bidirl.results.trace import EventLog

#: the guest stage's work span kinds, per direction
WORK_KINDS: dict = {ROLLOUT_ON_TRAINER_POOL: ("generate",), TRAINER_ON_ROLLOUT_POOL: ("chunk",)}
#: the reasons a window ran no work (see the module docstring)
SCHEDULER_SAID = "revoked with no work"
PRIMARIES_FIRST = "primaries finished first"
NO_SWITCH_IN = "no switch-in"
NOT_HANDED = "work never handed over"

WINDOW_COLUMNS = ("direction", "decided_at", "step", "predicted_gain_s", "switch_cost_s", "switch_in_s",
                  "switch_out_s", "start", "end", "work_spans", "work_s", "work", "reason", "explanation")

#: how far apart two times of one driver clock may be and still be the same instant: the log keeps times to
#: 1 ns (``FINGERPRINT_DECIMALS``); drivers add sub-millisecond bookkeeping between a decision and its switch
SAME_INSTANT_S = 1e-3


def _frames(log: Union[EventLog, object]) -> tuple:
    log = getattr(log, "log", log)
    if not isinstance(log, EventLog):
        raise TypeError(f"borrow_windows needs an EventLog or a run result holding one (.log), "
                        f"got {type(log).__name__}")
    return log.spans_df(), log.steps_df(), log.decisions_df()


def _switches(spans: pd.DataFrame, pool: str, kind: str, direction: str) -> pd.DataFrame:
    rows = spans[(spans["pool"] == pool) & (spans["kind"] == kind)]
    mine = rows["detail"].map(lambda d: isinstance(d, dict) and d.get("direction") == direction)
    return rows[mine.to_numpy(bool)].sort_values("start")


def _work_text(work: pd.DataFrame) -> str:
    if work.empty:
        return ""
    if (work["kind"] == "chunk").all():
        stages = work["detail"].map(lambda d: d.get("stage", "?") if isinstance(d, dict) else "?")
        counts = stages.value_counts(sort=False)
        return f"{len(work)} trainer chunks (" + ", ".join(f"{s} {n}" for s, n in counts.items()) + ")"
    workers = work["worker"].nunique()
    return f"{len(work)} generation spans on {workers} auxiliary rollouter{'' if workers == 1 else 's'}"


def _done_by_primaries(direction: str, step: int, spans: pd.DataFrame, steps: pd.DataFrame) -> float:
    """When the home pool had finished the work the window was admitted for (``nan`` if the log cannot say)."""
    if direction == ROLLOUT_ON_TRAINER_POOL:
        row = steps[steps["step"] == step]
        return float(row["start"].iloc[0] + row["wait"].iloc[0]) if len(row) else math.nan
    chunks = spans[(spans["kind"] == "chunk") & (spans["role"] == "primary") & (spans["step"] == step)]
    return float(chunks["end"].max()) if len(chunks) else math.nan


def borrow_windows(log) -> pd.DataFrame:
    """One row per admitted decision of ``log`` (an :class:`EventLog` or a run result), in decision order, with
    the columns of :data:`WINDOW_COLUMNS` (see the module docstring). ``start``/``end`` are the window's
    switch-in start and switch-out end (``nan`` where the log holds none)."""
    spans, steps, decisions = _frames(log)
    admitted = decisions[decisions["admitted"].to_numpy(bool)].sort_values("t", kind="stable")
    rows = []
    for d in admitted.itertuples(index=False):
        pool = BORROWED_POOL[d.direction]
        detail = d.detail if isinstance(d.detail, dict) else {}
        step = int(detail.get("step", -1))
        ins = _switches(spans, pool, "switch_in", d.direction)
        ins = ins[ins["start"] >= d.t - SAME_INSTANT_S]
        row = {"direction": d.direction, "decided_at": float(d.t), "step": step,
               "predicted_gain_s": float(d.predicted_gain), "switch_cost_s": float(d.cost),
               "switch_in_s": math.nan, "switch_out_s": math.nan, "start": math.nan, "end": math.nan,
               "work_spans": 0, "work_s": 0.0, "work": "", "reason": "", "explanation": ""}
        if ins.empty:
            row.update(reason=NO_SWITCH_IN, explanation="the run ended before the pool switched in")
            rows.append(row)
            continue
        sw_in = ins.iloc[0]
        outs = _switches(spans, pool, "switch_out", d.direction)
        outs = outs[outs["start"] >= sw_in["end"] - SAME_INSTANT_S]
        sw_out = outs.iloc[0] if len(outs) else None
        close = float(sw_out["start"]) if sw_out is not None else math.inf
        row.update(switch_in_s=float(sw_in["end"] - sw_in["start"]), start=float(sw_in["start"]),
                   switch_out_s=float(sw_out["end"] - sw_out["start"]) if sw_out is not None else math.nan,
                   end=float(sw_out["end"]) if sw_out is not None else math.nan)
        work = spans[(spans["pool"] == pool) & (spans["role"] == "auxiliary")
                     & spans["kind"].isin(WORK_KINDS[d.direction])
                     & (spans["start"] >= sw_in["end"] - SAME_INSTANT_S) & (spans["start"] < close)]
        if len(work):
            row.update(work_spans=int(len(work)), work_s=float((work["end"] - work["start"]).sum()),
                       work=_work_text(work))
            rows.append(row)
            continue
        said = sw_out["detail"].get("no_work", "") if sw_out is not None and isinstance(sw_out["detail"], dict) else ""
        if said:                                # the scheduler's own reason, logged with the switch out
            row.update(reason=SCHEDULER_SAID, explanation=f"{said} (switch in {row['switch_in_s']:.2f} s, "
                                                          f"gain predicted {d.predicted_gain:.2f} s against a "
                                                          f"{d.cost:.2f} s switch)")
            rows.append(row)
            continue
        done = _done_by_primaries(d.direction, step, spans, steps)
        what = "the step's batch" if d.direction == ROLLOUT_ON_TRAINER_POOL else "the step's last chunk"
        if np.isfinite(done) and done <= sw_in["end"] + SAME_INSTANT_S:
            row.update(reason=PRIMARIES_FIRST,
                       explanation=f"the home pool finished {what} at t = {done:.2f} s, "
                                   f"{sw_in['end'] - done:.2f} s before the {row['switch_in_s']:.2f} s switch-in "
                                   f"ended (gain predicted {d.predicted_gain:.2f} s against a {d.cost:.2f} s switch)")
        else:
            row.update(reason=NOT_HANDED,
                       explanation=f"the switch-in ended at t = {sw_in['end']:.2f} s with {what} still open "
                                   f"and no auxiliary work followed; the log holds no cause")
        rows.append(row)
    return pd.DataFrame(rows, columns=list(WINDOW_COLUMNS))


def idle_windows_text(windows: pd.DataFrame) -> str:
    """The admitted windows in one line: how many ran work, and for those that ran none, each reason counted."""
    if windows.empty:
        return "no borrowing window was admitted"
    empty = windows[windows["work_spans"] == 0]
    line = f"{len(windows) - len(empty)} of {len(windows)} admitted windows ran borrowed work"
    if len(empty):
        line += "; none in " + ", ".join(f"{n} ({r})" for r, n in empty["reason"].value_counts(sort=False).items())
    return line
