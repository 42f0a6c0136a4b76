"""veRL's colocated trainer schedule (bidirl.sim.verl_update) and the colocated baseline that runs it."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bidirl.job import config as cfgmod
from bidirl.perf.costs import switch_constants
from bidirl.sim import simulate
from bidirl.sim.verl_update import OPTIMIZER_OFFLOAD_BYTES, PARAM_OFFLOAD_BYTES, VerlUpdate


def _cfg(**rl):
    base = {"model": "qwen3-8b", "hardware": "h100", "seed": 0,
            "cluster": {"gpus": 16, "gpus_per_node": 8, "rollout_tensor_parallel": 2},
            "workload": {"dataset": "gsm8k", "prompts_per_step": 16, "group_size": 4, "max_response_len": 1024,
                         "steps": 2},
            "rl": {"staleness": 0, "partial_rollout": False, "micro_batch_per_device": 1, "reference_model": False,
                   **rl},
            "scheduler": {"policy": "no-borrow"}}
    return cfgmod.from_dict(base)


VERL = dict(max_tokens_per_micro_batch=4096, mini_batch_prompts=4, sequence_parallel=2)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(10, 3000), min_size=64, max_size=64), st.sampled_from([None, 2048, 4096]))
def test_every_sample_runs_once_per_pass_set_and_rounds_respect_the_budget(tokens, budget):
    upd = VerlUpdate.of(_cfg(**{**VERL, "max_tokens_per_micro_batch": budget or 4096}), trainer_layout=2)
    if budget is None:
        upd = VerlUpdate(**{**upd.__dict__, "budget": None})
    tokens = np.array(tokens)
    for stage, passes_expected in (("actor_update", 16 // 4), ("old_logprob", 1)):
        passes = upd.passes(stage, tokens)
        assert len(passes) == passes_expected
        seen = np.concatenate([ix for rounds in passes for ranks in rounds for ix in ranks])
        assert sorted(seen.tolist()) == list(range(tokens.size))
        for rounds in passes:
            assert all(len(ranks) == upd.ranks for ranks in rounds)          # every rank runs every round
            if budget is not None:
                # as many rounds as the fullest rank needs at budget · k tokens per micro-batch (veRL's
                # ⌈tokens / max_token_len⌉, the same count on every rank)
                per_rank = [sum(tokens[ix].sum() for ix in [r[j] for r in rounds]) for j in range(upd.ranks)]
                assert len(rounds) == max(1, max(math.ceil(t / (budget * upd.sp)) for t in per_rank))


def test_data_ranks_are_gpus_over_the_sequence_parallel_degree():
    assert VerlUpdate.of(_cfg(**VERL), trainer_layout=2).ranks == 16 // 2


def test_offload_copies_are_the_shards_over_the_pageable_host_link():
    cfg = _cfg(**VERL, param_offload=True, optimizer_offload=True)
    upd = VerlUpdate.of(cfg, trainer_layout=4)
    hw, n = cfg.hardware_spec, cfg.model_spec.params_total
    rate = hw.host_bandwidth * switch_constants(hw)["pageable_fraction"]
    assert upd.param_copy_time() == pytest.approx(2 * PARAM_OFFLOAD_BYTES * n / 4 / rate)
    assert upd.optimizer_copy_time() == pytest.approx(2 * OPTIMIZER_OFFLOAD_BYTES * n / 4 / rate)
    off = VerlUpdate.of(_cfg(**VERL), trainer_layout=4)
    assert off.param_copy_time() == 0.0 and off.optimizer_copy_time() == 0.0


def _spans(res):
    sp = res.log.spans_df()
    return sp.assign(d=sp["end"] - sp["start"])


def test_the_colocated_baseline_runs_one_optimizer_step_per_mini_batch_and_logs_offload_copies():
    res = simulate(_cfg(**VERL, param_offload=True, optimizer_offload=True), "verl-colocated", steps=2)
    sp = _spans(res)
    assert (sp["kind"] == "optimizer").sum() == 2 * (16 // 4)
    offload = sp[sp["detail"].map(lambda d: isinstance(d, dict) and d.get("direction") == "offload")]
    assert len(offload) == 2 * 2 * 2            # steps × stages (old_logprob, actor_update) × (load, offload)


def test_the_offload_spans_take_the_copies_time():
    """The offload spans of a step add up to the copies (parameters around both stages, the Adam moments around
    the update), up to jitter: each span is scaled by exp(N(0, 0.03)), within exp(±0.12) = 0.89–1.13 at 4 σ, so the
    sum is within 15 % of the nominal copies."""
    from bidirl.job.planner import plan
    cfg = _cfg(**VERL, param_offload=True, optimizer_offload=True)
    res = simulate(cfg, "verl-colocated", steps=1)
    upd = VerlUpdate.of(cfg, trainer_layout=plan(cfg).envelope.trainer_layout)
    copies = 2 * upd.param_copy_time() + upd.optimizer_copy_time()
    sp = _spans(res)
    offload = sp[sp["detail"].map(lambda d: isinstance(d, dict) and d.get("direction") == "offload")]
    assert offload["d"].sum() == pytest.approx(copies, rel=0.15)


def test_the_rollout_replicas_follow_the_configured_tensor_parallelism():
    res = simulate(_cfg(**VERL), "verl-colocated", steps=1)
    rollouters = {w for w in _spans(res).query("kind == 'generate'")["worker"]}
    assert len(rollouters) <= 16 // 2
    res4 = simulate(_cfg(**VERL).with_overrides({"cluster.rollout_tensor_parallel": 4}), "verl-colocated", steps=1)
    assert len({w for w in _spans(res4).query("kind == 'generate'")["worker"]}) <= 16 // 4


def test_each_mini_batch_pays_one_optimizer_update_and_no_offload_copies():
    """An optimizer span of the colocated baseline is one update — the gradient all-reduce across the replicas and
    AdamW over the N/ρ_t shard — with the offload copies only in their own spans: before, each mini-batch's span
    carried every mini-batch's AdamW and the whole step's offload copies again. Jitter scales a span by
    exp(N(0, 0.03)): within exp(±0.15) at 5 σ, so each span lies within 17 % of the nominal update."""
    from bidirl.job.planner import plan
    from bidirl.perf.predictor import gradient_allreduce_time, optimizer_time
    cfg = _cfg(**VERL, param_offload=True, optimizer_offload=True)
    env = plan(cfg).envelope
    m, hw = cfg.model_spec, cfg.hardware_spec
    one = gradient_allreduce_time(m, hw, env.trainer_layout, 16) + optimizer_time(m, hw, env.trainer_layout)
    upd = VerlUpdate.of(cfg, trainer_layout=env.trainer_layout)
    sp = _spans(simulate(cfg, "verl-colocated", steps=1))
    opt = sp[sp["kind"] == "optimizer"]["d"]
    assert len(opt) == 4
    assert opt.between(one * math.exp(-0.15), one * math.exp(0.15)).all()
    assert opt.max() < upd.optimizer_copy_time()          # the copies are not in the optimizer spans
