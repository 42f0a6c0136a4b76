"""Checks of an engine run's event log that several engine tests share (``tests/test_engine_log_checks.py`` shows
each fails on the defect it guards, on hand-built logs).

* :func:`one_mini_batch_between_optimizer_steps`: between two optimizer steps the update chunks hold exactly one
  mini-batch's samples (integer counts, compared exactly);
* :func:`aux_chunks_after_refreshes`: an auxiliary gang's chunk after an optimizer step starts after a refresh of its
  weights that began once that optimizer step had ended (span ends on one clock, compared exactly).
"""

from __future__ import annotations

AUX = "rollout_pool/trainer"
PRIMARY = "trainer_pool/trainer"


def one_mini_batch_between_optimizer_steps(res, opt, step: int, samples: int) -> list:
    """Check that the update chunks of ``step`` (either gang's) that run between two of its optimizer steps ``opt``
    hold one mini-batch's ``samples``, none running across an optimizer step; return the step's update chunks."""
    steps = sorted((sp.start, sp.end) for sp in opt if sp.step == step)
    chunks = [sp for sp in res.log.spans
              if sp.kind == "chunk" and sp.detail.get("stage") == "actor_update" and sp.step == step]
    before = -float("inf")
    for start, end in steps:
        between = [c for c in chunks if c.start >= before and c.end <= start]
        assert sum(c.detail["samples"] for c in between) == samples, (step, start, len(between))
        before = end
    return chunks


def aux_chunks_after_refreshes(res, step) -> set:
    """The auxiliary gang's chunks of ``step``, as the number of the step's optimizer steps before each; every one
    after an optimizer step starts after a refresh of the gang that began once that optimizer step had ended."""
    spans = res.log.spans
    bounds = sorted(sp.end for sp in spans if sp.kind == "optimizer" and sp.worker == PRIMARY
                    and sp.step == step)
    refreshes = [sp for sp in spans if sp.kind == "weight_refresh" and sp.worker == AUX]
    worked = set()
    for sp in spans:
        if sp.kind == "chunk" and sp.worker == AUX and sp.step == step:
            m = sum(1 for b in bounds if b <= sp.start)
            worked.add(m)
            if m > 0:
                assert any(bounds[m - 1] <= r.start and r.end <= sp.start for r in refreshes), (step, m, sp)
    return worked
