"""A Trainer-on-RolloutPool window that opens at the segment barrier waits for the next segment (paper §5.2).

The gate (Algorithm 2, lines 1-6) admits a window for the step's whole remaining stage-ordered workload U, the
actor-update segment included; after admission the auxiliaries lazily pull "the next chunk only when they are ready
to execute it". When the switch in ends while the primaries run the forward segment's last chunks, nothing of the
forward segment is left to send, but the actor-update segment opens at the barrier a moment later: the window must
wait for it, not be given back as having no work (which pays C_in + C_out for nothing and leaves the whole update
to the primaries).
"""

from __future__ import annotations

from bidirl.core import protocol as P
from bidirl.experiments.specs import get
from bidirl.sim import simulate


def _barrier_job():
    # H100, Qwen3-VL-4B, 8-8, max response 1K, s = 1: the rollout pool idles from ~10 s into each ~27 s step, and
    # in steps 2 and 3 its window's switch in (1.2 s) ends while the primaries run the last ref_logprob chunks
    spec = get("e2e-h100-response")
    return spec.config(spec.point("1K"))


def test_a_window_opening_at_the_segment_barrier_runs_the_next_segments_chunks():
    run = simulate(_barrier_job(), "bidirl", steps=4, seed=0)
    spans = run.log.spans
    tor = P.TRAINER_ON_ROLLOUT_POOL
    outs = [s for s in spans if s.kind == "switch_out" and s.detail.get("direction") == tor]
    assert outs
    for out in outs:
        if not out.detail.get("no_work"):
            continue
        # a window given back with no work: no chunk of the step may have been sent to the primaries after its
        # switch in ended (else that chunk was work the window could have pulled)
        switch_in = max((s for s in spans if s.kind == "switch_in" and s.detail.get("direction") == tor
                         and s.end <= out.start), key=lambda s: s.end)
        later = [s for s in spans if s.kind == "chunk" and s.role == P.PRIMARY and s.pool == P.TRAINER_POOL
                 and s.start >= switch_in.end and s.step == out.step]
        assert not later, (f"window of step {out.step} given back at {out.start:.2f} s with no work "
                           f"({out.detail['no_work']}) while {len(later)} primary chunks of the step started after "
                           f"its switch in ended at {switch_in.end:.2f} s")
    # every admitted window of this job ran borrowed chunks
    aux = [s for s in spans if s.kind == "chunk" and s.role == P.AUXILIARY and s.pool == P.ROLLOUT_POOL]
    admitted = [d for d in run.log.decisions_df().itertuples() if d.admitted and d.direction == tor]
    assert {s.step for s in aux} >= {d.detail["step"] for d in admitted}
