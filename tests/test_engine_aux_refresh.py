"""An engine run whose auxiliary trainer gang works across optimizer mini-batches (``rl.mini_batch_prompts``):
after each mini-batch's optimizer step the primaries' weights are loaded into it (``RefreshWeights``, the
``load_state_dict`` call a switch in loads a version with) before it computes the next mini-batch's chunks. Real vLLM
rollouters and torch trainer gangs on the tiny model (``tiny-cpu``). Integration test (``-m integration``).

At s = 0 the reproducible mode sums each mini-batch's chunk gradients in one order whichever gang computed them, so
the borrowing run's final weights equal the run without borrowing bit for bit (``rounding.exact_weights``) only if
every auxiliary gradient of a later mini-batch was computed on the weights that mini-batch's predecessor's optimizer
step made: one computed on the version's weights (no refresh) changes every tensor.
"""

from __future__ import annotations

import importlib.util

import pytest

import engine_jobs
import rounding
from engine_log_checks import AUX, aux_chunks_after_refreshes
from test_engine_driver import FULL_LENGTH, _check_log, _run

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="engine runs need vllm (pip install -e .[cpu])")]

STEPS = 2
MINI = 8


def test_a_refreshed_auxiliary_gang_computes_later_mini_batches_on_the_stepped_weights(model_dir, kept_workers):
    cfg = engine_jobs.borrowing(**{"rl.staleness": 0, **FULL_LENGTH, "rl.mini_batch_prompts": MINI})
    assert cfg.rl.reproducible_on
    per_step = cfg.workload.prompts_per_step // MINI
    borrowed = _run(cfg, "opportunistic", model_dir, STEPS, kept_workers)
    plain = _run(cfg, "no-borrow", model_dir, STEPS, kept_workers)
    _check_log(borrowed, STEPS)
    spans = borrowed.log.spans
    opt = [sp for sp in spans if sp.kind == "optimizer" and sp.worker == "trainer_pool/trainer"]
    assert len(opt) == STEPS * per_step, len(opt)
    refreshes = [sp for sp in spans if sp.kind == "weight_refresh"]
    assert refreshes and all(sp.worker == AUX for sp in refreshes)
    # the auxiliary gang works in at least two mini-batches of a step, each later one after a refresh that followed
    # the optimizer step before it
    worked = {(step, m) for step in range(STEPS) for m in aux_chunks_after_refreshes(borrowed, step)}
    assert any(m > 0 for _, m in worked), f"the auxiliary gang ran no later mini-batch: {sorted(worked)}"
    assert [sorted(ids) for _, _, ids in borrowed.view.batches] == [sorted(ids) for _, _, ids in plain.view.batches]
    differ = rounding.exact_weights(borrowed.weights, plain.weights)
    assert not differ, f"{len(differ)} tensors differ from the run without borrowing: {differ[:5]}"
