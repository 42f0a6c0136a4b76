"""The online profiler (paper §5.1): execution records, measured switch costs, model recalibration.

Every completed unit gives a record ``(k, x, π, X, d, T̂)``: stage ``k`` (``r`` rollout / ``t`` trainer),
role ``x`` (primary / auxiliary), pool ``π``, workload ``X`` (the unit's prompt and response lengths, and the
trainer stage), active replicas ``d`` and observed time ``T̂``, stored with the model's prediction for the same
work. At weight-sync boundaries (outside any worker's critical path) :meth:`Profiler.recalibrate` updates the
models and the switch costs:

* **refit** — when the predictor can (``predictor.refit(records)``: the stage-time predictor refits the appendix
  models' parameters, τ, α, β and the overlap exponents, with the same least-squares code as ``bidirl
  calibrate``, :mod:`bidirl.perf.fit`) and the recent records disagree with it by more than
  ``tolerance`` (median relative error), the models are refitted on the last ``window`` records. The core
  itself never imports the fitting code: the predictor is handed in.
* otherwise a (stage, role) correction factor is set to the median observed / predicted ratio of the records
  since the last calibration (the fallback for predictors that cannot refit);
* switch costs follow a moving average of their measurements.

Recent response lengths form the representative workload of M_r.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from bidirl.core.protocol import ROLES, SwitchCosts


@dataclass(frozen=True)
class ProfileRecord:
    t: float
    k: str            # "r" | "t"
    x: str            # "primary" | "auxiliary"
    pool: str
    workload: dict    # X: stage, prompt/response lengths, units
    d: int
    observed: float
    predicted: float


@dataclass
class Profiler:
    costs: dict                                    # direction -> SwitchCosts (start: configured values)
    # (direction, "c_in" | "c_out") -> seconds the yielding trainer engine spends allocating its pinned host buffer
    # before the first such switch of the run (bidirl.perf.costs.first_switch_allocation); the engines reserve it in
    # the background from their load (``loaded_at``) on, so what is left of it is charged until that switch is
    # observed
    first_switch: dict = field(default_factory=dict)
    loaded_at: float = 0.0                         # when the trainer engines loaded, on the run's clock (s)
    window: int = 512                              # responses kept for the representative workload
    smoothing: float = 0.5                         # weight of a new cost measurement
    records: list = field(default_factory=list)
    scales: dict = field(default_factory=lambda: {(k, x): 1.0 for k in "rt" for x in ROLES})
    calibrated_upto: int = 0
    tolerance: float = 0.05                        # median relative error above which the models are refitted
    refit_window: int = 256                        # records a refit uses (the most recent)
    refits: int = 0
    cost_samples: dict = field(default_factory=dict)
    errors: list = field(default_factory=list)    # each record's |predicted − observed| / observed, as predicted
    changes: list = field(default_factory=list)   # len(errors) at each model change (a refit or new factors)
    prompt_lens: deque = field(default_factory=deque)
    response_lens: deque = field(default_factory=deque)

    def record(self, rec: ProfileRecord) -> None:
        if rec.observed < 0 or rec.predicted < 0:
            raise ValueError(f"profiling record with negative time: {rec}")
        self.records.append(rec)
        if rec.observed > 0 and rec.predicted > 0:
            predicted = self.scales.get((rec.k, rec.x), 1.0) * rec.predicted
            self.errors.append(abs(predicted - rec.observed) / rec.observed)

    def observe_group(self, prompt_len: int, response_lens) -> None:
        """Keep the group's (prompt, response) lengths, the most recent ``window`` responses in all."""
        responses = [int(r) for r in response_lens]
        self.prompt_lens.extend([int(prompt_len)] * len(responses))
        self.response_lens.extend(responses)
        for _ in range(len(self.response_lens) - self.window):
            self.prompt_lens.popleft()
            self.response_lens.popleft()

    def allocation_left(self, direction: str, which: str, now: float) -> float:
        """Seconds of the first ``direction``/``which`` switch's pinned allocation still ahead at ``now``:
        ``max(0, allocation − (now − loaded_at))`` (``bidirl.perf.costs.pinned_allocation_left``), 0 once that
        switch was observed."""
        first = getattr(self, "first_switch", {})       # (a checkpoint written before it existed has none)
        alloc = first.get((direction, which), 0.0)
        return max(0.0, alloc - max(0.0, float(now) - getattr(self, "loaded_at", 0.0))) if alloc else 0.0

    def charged(self, direction: str, now: float):
        """What ``direction``'s switches starting at ``now`` are expected to take: the steady costs, plus what is left
        at ``now`` of a first switch's allocation (:meth:`allocation_left`). The gates charge these: the engines
        reserve the allocation in the background from their load on, so a window admitted now waits for what is left
        of it, and one admitted later waits for less (none once the reservation is done) — the remainder is the
        cost of lending now, not a cost some window must pay."""
        costs = self.costs[direction]
        extra_in = self.allocation_left(direction, "c_in", now)
        extra_out = self.allocation_left(direction, "c_out", now)
        if not (extra_in or extra_out):
            return costs
        return SwitchCosts(c_in=costs.c_in + extra_in, c_out=costs.c_out + extra_out, c_grad=costs.c_grad)

    def observe_cost(self, direction: str, which: str, seconds: float, now: Optional[float] = None) -> None:
        """A measured C_in / C_out / C_grad for ``direction`` that ended at ``now``; folded in at the next
        recalibration. The first switch of its kind is folded in without what was left of its one-time allocation
        when it started (:meth:`allocation_left` at ``now − seconds``), so the steady cost stays steady."""
        if (direction, which) in getattr(self, "first_switch", {}):
            if now is None:
                raise ValueError(f"Profiler.observe_cost: the first {direction} {which} needs the time it ended "
                                 "(now) to take out what was left of its pinned allocation")
            extra = self.allocation_left(direction, which, float(now) - float(seconds))
            self.first_switch.pop((direction, which))
        else:
            extra = 0.0
        self.cost_samples.setdefault((direction, which), []).append(max(0.0, float(seconds) - extra))

    def recalibrate(self, predictor=None) -> dict:
        """Update the models (refit, or correction factors) and the switch costs from what was measured since
        the last call (module doc). Returns the correction factors."""
        new = self.records[self.calibrated_upto:]
        self.calibrated_upto = len(self.records)
        usable = [r for r in new if r.predicted > 0 and r.observed > 0]
        if predictor is not None and hasattr(predictor, "refit") and usable:
            errors = [abs(r.predicted - r.observed) / r.observed for r in usable]
            if float(np.median(errors)) > self.tolerance:
                refitted = predictor.refit(self.records[-self.refit_window:])
                if refitted is None or refitted:       # {}: too few records of any stage to refit
                    self.refits += 1
                    self.scales = {key: 1.0 for key in self.scales}
                    self.changes.append(len(self.errors))
        else:
            old = dict(self.scales)
            for key in list(self.scales):
                ratios = [r.observed / r.predicted for r in usable if (r.k, r.x) == key]
                if ratios:
                    self.scales[key] = float(np.median(ratios))
            if self.scales != old:
                self.changes.append(len(self.errors))
        for (direction, which), samples in self.cost_samples.items():
            old = self.costs[direction]
            value = (1 - self.smoothing) * getattr(old, which) + self.smoothing * float(np.mean(samples))
            self.costs[direction] = SwitchCosts(**{**old.__dict__, which: value})
        self.cost_samples = {}
        return dict(self.scales)

    def error_summary(self) -> dict:
        """How wrong the stage-time models were, before and after the profiler changed them: the median relative
        error (%) of the predictions made with the models as configured (before the first refit or correction)
        and with the current models (since the last change; ``None`` when nothing changed or nothing was
        recorded since), and how many records each median covers. The correction factors return to 1.0 after a
        refit, so they alone cannot say this."""
        first = self.changes[0] if self.changes else len(self.errors)
        last = self.changes[-1] if self.changes else len(self.errors)
        before, after = self.errors[:first], self.errors[last:]
        return {"median_error_pct_before": 100 * float(np.median(before)) if before else None,
                "records_before": len(before),
                "median_error_pct_after": 100 * float(np.median(after)) if after and self.changes else None,
                "records_after": len(after) if self.changes else 0,
                "changes": len(self.changes), "tolerance_pct": 100 * self.tolerance}

    def summary(self) -> dict:
        """Plain data for run summaries: measured/predicted stage-time factors, record count, refits, the models'
        median error before and after the changes (:meth:`error_summary`), charged costs."""
        return {"scales": {f"{'rollout' if k == 'r' else 'trainer'}/{x}": v for (k, x), v in self.scales.items()},
                "records": len(self.records), "refits": self.refits, **self.error_summary(),
                "switch_costs": {d: dict(vars(c)) for d, c in self.costs.items()}}

    def response_sample(self, prior: tuple) -> np.ndarray:
        """Recent response lengths (the prior's until responses were seen): what remaining-length estimates use."""
        return np.asarray(self.response_lens if self.response_lens else prior[1], dtype=float)

    def typical_prompt(self, prior: tuple) -> int:
        """The median recent prompt length (the prior's until prompts were seen)."""
        return int(np.median(self.prompt_lens if self.prompt_lens else prior[0]))

    def representative(self, n_responses: int, prior: tuple) -> tuple:
        """``n_responses`` (prompt, response) lengths at evenly spaced quantiles of the recent window."""
        if self.response_lens:
            p, r = np.asarray(self.prompt_lens), np.asarray(self.response_lens)
        else:
            p, r = np.asarray(prior[0]), np.asarray(prior[1])
        if n_responses <= 0:
            return np.zeros(0, int), np.zeros(0, int)
        q = (np.arange(n_responses) + 0.5) / n_responses
        order = np.argsort(r, kind="stable")
        idx = order[np.minimum((q * len(r)).astype(int), len(r) - 1)]
        return p[idx], r[idx]
