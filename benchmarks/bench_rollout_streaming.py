"""Rollouters that run free (issue #24, part 6): one CPU rollouter polled in 50 ms slices against its stream.

The engine driver used to keep a rollouter generating with ``RolloutActor.step_until(max_seconds=0.05)`` calls,
one after the other: the engine stepped for a slice, returned, and idled for the driver's round trip before the
next one. Now it opens one ``RolloutActor.stream`` call, whose loop steps the engine back to back and yields
groups as they finish. This benchmark runs both on the same actor, on the same requests and seeds, as the driver
runs them (a ``ray.wait`` loop on the driver's side; the polled side sends its next slice as soon as a reply is
in, the streaming side reads each reply as it comes), after one uncounted run of each. Figures (``bidirl bench
--only rollout_streaming``; each call makes ``ROUNDS`` rounds of one run per mode, in an order that alternates, and
reports the rounds' medians):

* ``decode_tokens_per_s_{polled,streaming}`` — tokens generated over the wall time from the ``start`` call to
  the last group received (``GROUPS`` groups × ``GROUP_SIZE`` responses, each response's length drawn once in
  ``[MIN_TOKENS, MAX_TOKENS]`` and forced, so groups finish at many different steps);
* ``streaming_over_polled`` — the median of each round's paired ratio of the two rates (runs seconds apart see
  the same load on a shared machine);
* ``engine_idle_fraction_{polled,streaming}`` — the share of the engine's generation window (first step's start
  to last step's end, the actor's own clock) in which it ran no step: ``1 - Σ generate spans / window``; the
  polled gaps are the driver's round trips between slices;
* ``driver_calls_{polled,streaming}`` — generation calls per run (slices, or streams),
  ``engine_steps_{polled,streaming}`` — the engine steps one run makes, and ``reply_points_streaming`` — the
  replies one stream yields (one per step at which groups finished, none in between: no report interval hit);
* ``same_tokens`` — 1 when both modes generated exactly the same tokens in every round (position-keyed
  sampling), else 0.
"""

from __future__ import annotations

import functools
import os
import statistics
import time

GROUPS, GROUP_SIZE = 16, 8                   # 128 responses in one batch
MIN_TOKENS, MAX_TOKENS = 8, 56               # the tiny model has 64 positions; its prompts are ≤ 6 tokens
QUICK_GROUPS = 4
SLICE_SECONDS = 0.05                         # the polled driver's slice (EngineDriver's former step_seconds)
ROUNDS = 3                                   # runs per mode in one call (1 with --quick)
MAX_MODEL_LEN = 64


@functools.lru_cache(maxsize=1)
def _actor():
    """(ray, actor, tokenizer): one rollout actor for the process (started once, on a local Ray if none)."""
    import ray

    from bidirl.cluster.engines.workers.actors import RolloutActor
    from bidirl.rl.bootstrap import ensure_tiny_model
    from bidirl.rl.tasks import ArithmeticTask
    from bidirl.rl.tiny_model import load_tokenizer

    os.environ.setdefault("RAY_enable_metrics_collection", "0")
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="bidirl-bench")
    model_dir = ensure_tiny_model()
    actor = RolloutActor.remote("rollout_pool/rollouter/0", str(model_dir), 0, max_model_len=MAX_MODEL_LEN,
                                reward_fn=ArithmeticTask.reward)
    ray.get(actor.ready.remote(), timeout=600)
    return ray, actor, load_tokenizer(model_dir)


def _requests(tokenizer, groups: int) -> list:
    import numpy as np

    from bidirl.cluster.engines.workers.rollout import GroupRequest
    from bidirl.rl.tasks import ArithmeticTask

    task = ArithmeticTask(seed=0)
    rng = np.random.default_rng(0)
    out = []
    for g in range(groups):
        p = task.problem(g)
        lengths = tuple(int(n) for n in rng.integers(MIN_TOKENS, MAX_TOKENS + 1, size=GROUP_SIZE))
        out.append(GroupRequest(g, tuple(tokenizer(p.text)["input_ids"]), GROUP_SIZE, MAX_TOKENS, p.answer,
                                response_tokens=lengths))
    return out


class _Seq:
    n = 0


def _next_seq() -> int:
    _Seq.n += 1
    return _Seq.n


def _polled(ray, actor, requests) -> dict:
    t0 = time.perf_counter()
    ray.get(actor.start.remote(requests, _next_seq()))
    groups, spans, calls = [], [], 0
    while True:
        reply = ray.get(actor.step_until.remote(max_seconds=SLICE_SECONDS))
        calls += 1
        groups += reply.value
        spans += [sp for sp in reply.spans if sp["detail"].get("steps")]
        if not reply.spans[0]["detail"]["busy"]:
            break
    return {"seconds": time.perf_counter() - t0, "groups": groups, "spans": spans, "calls": calls}


def _streaming(ray, actor, requests) -> dict:
    t0 = time.perf_counter()
    seq = _next_seq()
    ray.get(actor.start.remote(requests, seq))
    gen = actor.stream.remote(seq, 1.0)
    groups, spans, replies = [], [], 0
    while True:
        ray.wait([gen], num_returns=1)
        try:
            ref = next(gen)
        except StopIteration:
            break
        reply = ray.get(ref)
        replies += 1
        groups += reply.value["groups"]
        spans += [sp for sp in reply.spans if sp["detail"].get("steps")]
    return {"seconds": time.perf_counter() - t0, "groups": groups, "spans": spans, "calls": 1, "replies": replies}


def _figures(run: dict) -> dict:
    spans = sorted(run["spans"], key=lambda sp: sp["start"])
    window = spans[-1]["end"] - spans[0]["start"]
    busy = sum(sp["end"] - sp["start"] for sp in spans)
    tokens = sum(len(t) for g in run["groups"] for t in g.payload.token_ids)
    return {"rate": tokens / run["seconds"], "idle": max(0.0, 1.0 - busy / window),
            "steps": sum(sp["detail"]["steps"] for sp in spans), "calls": run["calls"], "replies": run.get("replies"),
            "tokens": {g.group_id: g.payload.token_ids for g in run["groups"]}}


def bench_rollout_streaming(quick: bool) -> dict:
    ray, actor, tokenizer = _actor()
    requests = _requests(tokenizer, QUICK_GROUPS if quick else GROUPS)
    rounds = 1 if quick else ROUNDS
    out: dict = {"polled": [], "streaming": []}
    modes = {"polled": _polled, "streaming": _streaming}
    for run in modes.values():           # not counted: the first runs of a process fill caches (prefix, allocator)
        run(ray, actor, requests)
    for r in range(rounds):
        order = ["polled", "streaming"] if r % 2 == 0 else ["streaming", "polled"]
        for mode in order:
            out[mode].append(_figures(modes[mode](ray, actor, requests)))
    polled, streaming = out["polled"], out["streaming"]
    same = all(p["tokens"] == s["tokens"] for p, s in zip(polled, streaming))
    med = statistics.median
    return {
        "decode_tokens_per_s_polled": (med(p["rate"] for p in polled), "tokens/s"),
        "decode_tokens_per_s_streaming": (med(s["rate"] for s in streaming), "tokens/s"),
        "streaming_over_polled": (med(s["rate"] / p["rate"] for p, s in zip(polled, streaming)), "x"),
        "engine_idle_fraction_polled": (med(p["idle"] for p in polled), "fraction"),
        "engine_idle_fraction_streaming": (med(s["idle"] for s in streaming), "fraction"),
        "driver_calls_polled": (med(p["calls"] for p in polled), "calls"),
        "driver_calls_streaming": (med(s["calls"] for s in streaming), "calls"),
        "engine_steps_polled": (med(p["steps"] for p in polled), "steps"),
        "engine_steps_streaming": (med(s["steps"] for s in streaming), "steps"),
        "reply_points_streaming": (med(s["replies"] for s in streaming), "replies"),
        "same_tokens": (1.0 if same else 0.0, "bool"),
    }


BENCHMARKS = {"rollout_streaming": bench_rollout_streaming}

if __name__ == "__main__":
    for bench in BENCHMARKS.values():
        for name, (value, unit) in bench(quick=True).items():
            print(f"{name:40s} {value:12.4g} {unit}")
