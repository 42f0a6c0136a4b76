"""Rollouters that run free: ``RolloutActor.stream`` steps its vLLM engine back to back and hands groups back as
they finish, while the actor's other calls pause it (keeping its requests) and run in the order sent.

Integration tests (``-m integration``): one real rollout actor (the tiny model on CPU vLLM) on the session's local
Ray, shared by the tests of this module. Nothing here reads a clock: the properties are structural — which calls
ran, which steps a call covered, what each reply held — and tokens are compared exactly (sampling is
position-keyed, so a response's tokens do not depend on which steps it shared with others or on an interrupt).
"""

from __future__ import annotations

import importlib.util

import pytest

from bidirl.cluster.engines.workers.rollout import GroupRequest
from bidirl.rl.tasks import ArithmeticTask

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="the rollout engine needs vllm (pip install -e .[cpu])")]

TASK = ArithmeticTask(seed=0)
MAX_MODEL_LEN = 64                # the tiny model's positions
NAME = "rollout_pool/rollouter/0"


@pytest.fixture(scope="module")
def rollouter(model_dir, ray_session):
    """(ray, actor, tokenizer): one rollout actor for the module; its start numbers continue from test to test."""
    ray = ray_session
    from bidirl.cluster.engines.workers.actors import RolloutActor
    from bidirl.rl.tiny_model import load_tokenizer

    actor = RolloutActor.options(num_cpus=0.5).remote(NAME, str(model_dir), 0, max_model_len=MAX_MODEL_LEN,
                                                      reward_fn=TASK.reward)
    ray.get(actor.ready.remote(), timeout=600)
    yield ray, actor, load_tokenizer(model_dir)
    ray.kill(actor)


class Starts:
    """The driver's numbering of start calls (``RolloutActor.start(requests, seq)``), kept across the module."""
    n = 0

    @classmethod
    def next(cls) -> int:
        cls.n += 1
        return cls.n


def _requests(tokenizer, lengths, resume=None):
    """One group of 4 responses per entry of ``lengths`` (group ``g``: problem ``g``), each response forced to that
    many tokens; ``resume``: group id -> the state an interrupt returned."""
    longest = max(n for n in lengths if n is not None)
    out = []
    for g, n in enumerate(lengths):
        if n is not None:
            p = TASK.problem(g)
            out.append(GroupRequest(g, tuple(tokenizer(p.text)["input_ids"]), 4, longest, p.answer,
                                    resume=(resume or {}).get(g), response_tokens=(n,) * 4))
    return out


def _polled(ray, actor, requests) -> dict:
    """The old way: the driver asks for one engine step per call until every group is back. Returns
    {group id: tokens} and checks that each call made exactly one step (the engine waited for the driver in
    between)."""
    ray.get(actor.start.remote(requests, Starts.next()))
    groups, calls = [], 0
    before = ray.get(actor.status.remote())["steps"]
    while True:
        reply = ray.get(actor.step_until.remote(max_steps=1))
        calls += 1
        groups += reply.value
        detail = reply.spans[0]["detail"]
        if not detail["busy"]:
            break
        assert detail["steps"] == 1
    assert calls == ray.get(actor.status.remote())["steps"] - before       # one driver round trip per engine step
    return {s.group_id: s.payload.token_ids for s in groups}


def _streamed(ray, gen) -> list:
    return [ray.get(ref) for ref in gen]


def _max_prompt(tokenizer, n) -> int:
    return max(len(tokenizer(TASK.problem(g).text)["input_ids"]) for g in range(n))


def test_a_stream_runs_the_engine_without_the_driver_and_hands_each_group_back_as_it_finishes(rollouter):
    ray, actor, tok = rollouter
    lengths = [8, 16, 24, 32]                  # group g finishes at its own step: 8·(g+1) tokens per response
    assert _max_prompt(tok, 4) + max(lengths) <= MAX_MODEL_LEN
    reference = _polled(ray, actor, _requests(tok, lengths))

    before = ray.get(actor.status.remote())["steps"]
    seq = Starts.next()
    ray.get(actor.start.remote(_requests(tok, lengths), seq))
    gen = actor.stream.remote(seq)
    # the driver reads nothing until the stream has ended: the engine ran every step of the four groups on its own
    ray.get(gen.completed(), timeout=600)
    status = ray.get(actor.status.remote())
    assert not status["busy"] and status["groups"] == []
    steps = status["steps"] - before
    assert steps >= max(lengths)               # at least one step per token of the longest response

    replies = _streamed(ray, gen)
    # one reply per finishing point, in order of length, none in between (no report interval): the groups came back
    # as they finished, the last reply says the engine holds no requests
    assert [s.group_id for r in replies for s in r.value["groups"]] == [0, 1, 2, 3]
    assert all(r.value["groups"] for r in replies)
    assert [r.value["busy"] for r in replies] == [True] * (len(replies) - 1) + [False]
    assert all(r.value["starts"] == seq for r in replies)
    assert [r.value["report"] for r in replies] == sorted({r.value["report"] for r in replies})
    # its spans cover every step the engine made, back to back: one span per reply (nothing paused the loop), each
    # starting where the previous one ended or later, never overlapping
    spans = [sp for r in replies for sp in r.spans]
    assert len(spans) == len(replies) and {sp["kind"] for sp in spans} == {"generate"}
    assert sum(sp["detail"]["steps"] for sp in spans) == steps
    assert sum(sp["detail"]["completed"] for sp in spans) == 4
    assert all(a["end"] <= b["start"] for a, b in zip(spans, spans[1:]))
    # the same tokens as the polled run (position-keyed sampling)
    for r in replies:
        for s in r.value["groups"]:
            assert s.complete and s.payload.token_ids == reference[s.group_id]
            assert all(len(t) == lengths[s.group_id] for t in s.payload.token_ids)


def test_an_interrupt_during_a_stream_stops_exactly_the_listed_groups_and_the_others_go_on(rollouter):
    ray, actor, tok = rollouter
    n = MAX_MODEL_LEN - _max_prompt(tok, 4)
    lengths = [n] * 4
    reference = _polled(ray, actor, _requests(tok, lengths))

    seq = Starts.next()
    ray.get(actor.start.remote(_requests(tok, lengths), seq))
    gen = actor.stream.remote(seq, 0.0)       # a reply after every step: the test sees the loop running
    first = ray.get(next(gen))
    assert first.value["busy"] and first.value["groups"] == [] and first.spans[0]["detail"]["steps"] >= 1
    stop = ray.get(actor.interrupt.remote([1, 2]))
    rest = _streamed(ray, gen)

    # exactly groups 1 and 2 stopped, each a prefix of the tokens it would have got
    assert sorted(s.group_id for s in stop.value) == [1, 2]
    partial = {s.group_id: s for s in stop.value}
    for g, s in partial.items():
        assert not any(s.done) and all(0 < len(t) < n for t in s.payload.token_ids)
        assert all(t == r[:len(t)] for t, r in zip(s.payload.token_ids, reference[g]))
    detail = stop.spans[0]["detail"]
    assert detail["stopped"] == 2 and detail["busy"] and detail["starts"] == seq
    # the others went on in the same stream after the interrupt: all their tokens, the same as uninterrupted
    finished = [s for r in [first] + rest for s in r.value["groups"]]
    assert sorted(s.group_id for s in finished) == [0, 3]
    for s in finished:
        assert s.complete and s.payload.token_ids == reference[s.group_id]
    spans = [sp for r in [first] + rest for sp in r.spans]
    interrupt = stop.spans[0]
    assert any(sp["end"] <= interrupt["start"] for sp in spans)          # steps before the pause ...
    assert any(sp["start"] >= interrupt["end"] for sp in spans)          # ... and after it, in the same call
    assert all(sp["end"] <= interrupt["start"] or sp["start"] >= interrupt["end"] for sp in spans)  # none during it
    assert rest[-1].value["busy"] is False
    reports = [r.value["report"] for r in [first] + rest] + [detail["report"]]
    assert len(set(reports)) == len(reports)                             # one count over the stream and the call

    # resumed, the stopped groups complete to the tokens they would have got
    seq = Starts.next()
    ray.get(actor.start.remote(_requests(tok, [None, n, n, None], resume=partial), seq))
    resumed = [s for r in _streamed(ray, actor.stream.remote(seq)) for s in r.value["groups"]]
    assert sorted(s.group_id for s in resumed) == [1, 2]
    for s in resumed:
        assert s.complete and s.payload.token_ids == reference[s.group_id]


def test_a_stream_waits_for_the_start_sent_before_it_and_a_killed_actor_ends_it_with_an_actor_error(rollouter,
                                                                                                       model_dir):
    ray, actor, tok = rollouter
    from ray.exceptions import RayActorError

    from bidirl.cluster.engines.workers.actors import RolloutActor

    # a stream sent before its start has run waits for it (start number), then takes its groups
    seq = Starts.next()
    gen = actor.stream.remote(seq)
    ray.get(actor.start.remote(_requests(tok, [4]), seq))
    assert [s.group_id for r in _streamed(ray, gen) for s in r.value["groups"]] == [0]

    # an actor that dies mid-stream: the stream's next value raises the actor's death (what the driver restarts on)
    other = RolloutActor.options(num_cpus=0.5).remote("rollout_pool/rollouter/1", str(model_dir), 0,
                                                      max_model_len=MAX_MODEL_LEN)
    ray.get(other.ready.remote(), timeout=600)
    n = MAX_MODEL_LEN - _max_prompt(tok, 4)
    ray.get(other.start.remote(_requests(tok, [n] * 4), 1))
    gen = other.stream.remote(1, 0.0)
    ray.get(next(gen))
    ray.kill(other)
    with pytest.raises(RayActorError):
        for ref in gen:
            ray.get(ref)
