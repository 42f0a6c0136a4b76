"""The engine runs' shared log checks (``tests/engine_log_checks.py``) pass on a log that keeps their rule and fail on
each defect they guard, on hand-built logs (no engine). Every figure is an integer count or a span end on one clock,
compared exactly: no tolerance."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine_log_checks import AUX, PRIMARY, aux_chunks_after_refreshes, one_mini_batch_between_optimizer_steps

MINI = 4          # samples a mini-batch


def span(kind, worker, start, end, step=0, **detail):
    return SimpleNamespace(kind=kind, worker=worker, start=start, end=end, step=step, detail=detail)


def chunk(start, end, samples, worker=PRIMARY):
    return span("chunk", worker, start, end, stage="actor_update", samples=samples)


def optimizer(start, end):
    return span("optimizer", PRIMARY, start, end)


def run(*spans):
    return SimpleNamespace(log=SimpleNamespace(spans=list(spans)))


def _mini_batches(res):
    opt = [sp for sp in res.log.spans if sp.kind == "optimizer"]
    return one_mini_batch_between_optimizer_steps(res, opt, 0, MINI)


def test_one_mini_batch_between_optimizer_steps_passes_on_one_mini_batch_per_step():
    res = run(chunk(0, 1, 2), chunk(1, 2, 2, worker=AUX), optimizer(2, 3), chunk(3, 4, 4), optimizer(4, 5))
    assert len(_mini_batches(res)) == 3


@pytest.mark.parametrize("spans", [
    # a chunk running across the first optimizer step: the first mini-batch counts 2 samples, not 4
    (chunk(0, 1, 2), chunk(1.5, 2.5, 2), optimizer(2, 3), chunk(3, 4, 2), optimizer(4, 5)),
    # the updates of two mini-batches in one optimizer span: 8 samples before it
    (chunk(0, 1, 4), chunk(1, 2, 4), optimizer(2, 3)),
])
def test_one_mini_batch_between_optimizer_steps_fails_on_a_chunk_across_a_step_or_a_missing_step(spans):
    with pytest.raises(AssertionError):
        _mini_batches(run(*spans))


def test_aux_chunks_after_refreshes_passes_on_chunks_after_a_refresh_that_followed_the_step():
    res = run(chunk(0, 1, 4, worker=AUX), optimizer(1, 2), span("weight_refresh", AUX, 2, 2.5),
              chunk(3, 4, 4, worker=AUX), optimizer(4, 5))
    assert aux_chunks_after_refreshes(res, 0) == {0, 1}


@pytest.mark.parametrize("refresh", [
    None,                                          # no refresh: the chunk ran on the version's weights
    span("weight_refresh", AUX, 1.5, 2.5),         # a refresh that began before the optimizer step had ended
    span("weight_refresh", AUX, 2, 3.5),           # a refresh still running when the chunk started
    span("weight_refresh", PRIMARY, 2, 2.5),       # another gang's refresh
])
def test_aux_chunks_after_refreshes_fails_on_a_chunk_without_a_refresh_after_the_step(refresh):
    spans = [chunk(0, 1, 4, worker=AUX), optimizer(1, 2), chunk(3, 4, 4, worker=AUX)]
    with pytest.raises(AssertionError):
        aux_chunks_after_refreshes(run(*spans, *([refresh] if refresh else [])), 0)
