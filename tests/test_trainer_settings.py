"""The trainer engine's job settings on the unsharded CPU engine: token-budget micro-batches
(``rl.max_tokens_per_micro_batch``) and parameter / optimizer offload (``rl.param_offload`` /
``rl.optimizer_offload``). The sharded gang runs the same code under ``tests/test_trainer_fsdp.py``.

Tolerances (fp32, u = 2**-24), derived from the arithmetic, never from one machine's output:
- token-budget micro-batches vs one pass over the share: every micro-batch divides by the same normaliser, so the
  two compute the same sum of per-token terms, blocked differently. Two roundings differ: (a) a micro-batch is
  padded to its own longest sample instead of the share's, which changes the shapes of the forward's inner products
  — bounded as the chunked head is in ``tests/test_trainer_device_paths.py`` (``_head_bound``: λ·√n·u per inner
  product, Higham & Mary 2019, λ = 6), ×4 for the forward, its transpose and the gradient's reductions, relative to
  the largest gradient entry G; (b) the k micro-batches' gradients are summed into ``p.grad`` one after another:
  per element ≤ (k − 1)·u·Σ|g_j| over the micro-batches' own gradients g_j (recursive summation). The bound is
  their sum. The defect it guards — each micro-batch normalised by its own token count — changes the gradient by a
  factor of order one (a micro-batch of n tokens weighs N/n times too much), far above it: the test shows so.
- offload: the state moves by byte copies (``HostStash``), so the weights and AdamW moments after each step equal
  the engine's without offload bit for bit (``torch.equal``).
"""

from __future__ import annotations

import torch
import pytest
from hypothesis import given, settings, strategies as st

from bidirl.cluster.engines.workers.trainer.micro_batches import merge_stats, token_micro_batches
from bidirl.rl import grpo

from gang_rendezvous import join_gang, spawn_gang
from test_trainer_device_paths import U, _engine, _head_bound, _samples


# --------------------------------------------------------------------------------------------------
# packing
# --------------------------------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 64), min_size=0, max_size=40), st.integers(64, 400))
def test_micro_batches_hold_every_sample_once_within_the_padded_budget(widths, budget):
    batches = token_micro_batches(widths, budget)
    assert sorted(i for b in batches for i in b) == list(range(len(widths)))
    for b in batches:
        assert b and len(b) * max(widths[i] for i in b) <= budget
    # no two neighbouring runs could have been one (each run is as long as it fits)
    for a, b in zip(batches, batches[1:]):
        assert (len(a) + 1) * max(widths[i] for i in a + b[:1]) > budget


def test_a_sample_over_the_budget_is_refused_by_the_key():
    with pytest.raises(ValueError, match="rl.max_tokens_per_micro_batch"):
        token_micro_batches([10, 300], 256)
    with pytest.raises(ValueError, match="positive"):
        token_micro_batches([10], 0)


def test_merged_statistics_sum_losses_and_weight_means_by_tokens():
    a = dict(grpo.empty_stats(), loss=0.5, pg_loss=0.25, kl=0.1, clip_frac=0.5, ratio_mean=1.0, tokens=10, sequences=2)
    b = dict(a, loss=0.25, pg_loss=0.5, kl=0.4, clip_frac=0.0, ratio_mean=2.0, tokens=30, sequences=3)
    m = merge_stats([a, grpo.empty_stats(), b])
    assert m["loss"] == 0.75 and m["pg_loss"] == 0.75 and m["tokens"] == 40 and m["sequences"] == 5
    assert m["kl"] == pytest.approx((0.1 * 10 + 0.4 * 30) / 40) and m["ratio_mean"] == pytest.approx(70 / 40)
    assert merge_stats([]) == grpo.empty_stats()


# --------------------------------------------------------------------------------------------------
# the engine's passes
# --------------------------------------------------------------------------------------------------

def _passes(engine) -> list:
    """Record the padded ``[B, T]`` of every forward pass of the actor model."""
    seen = []
    engine.model.register_forward_pre_hook(lambda m, args, kw: seen.append(tuple(kw["input_ids"].shape)),
                                           with_kwargs=True)
    return seen


def _budget(samples) -> int:
    """A budget that holds two of the longest samples: several micro-batches for eight samples."""
    return 2 * max(len(s.prompt_ids) + len(s.response_ids) for s in samples)


@pytest.mark.parametrize("given_normalizer", [True, False])
def test_token_budget_micro_batches_give_the_one_pass_gradient(model_dir, given_normalizer):
    samples = _samples(model_dir)
    adv = grpo.group_advantages([s.reward for s in samples], group_size=2).float()
    norm = grpo.loss_normalizer([s.response_len for s in samples]) if given_normalizer else None
    ref = _engine(model_dir)
    old = ref.logprobs(samples)
    whole = ref.chunk_gradients(samples, adv, old, normalizer=norm)
    budget = _budget(samples)
    e = _engine(model_dir, max_tokens_per_micro_batch=budget)
    passes = _passes(e)
    got = e.chunk_gradients(samples, adv, old, normalizer=norm)
    batches = token_micro_batches([len(s.prompt_ids) + len(s.response_ids) for s in samples], budget)
    assert len(batches) >= 3 and len(passes) == len(batches)
    assert all(b * t <= budget for b, t in passes)                 # the activations of one pass: ≤ budget tokens
    assert got.samples == 8 and got.tokens == whole.tokens
    # the micro-batches' own gradients, for the summation term of the bound (module docstring)
    step_norm = grpo.loss_normalizer([s.response_len for s in samples])
    parts = [ref.chunk_gradients([samples[i] for i in b], adv[b], [old[i] for i in b], normalizer=step_norm).flat
             for b in batches]
    g = whole.flat.abs().max()
    tol = _head_bound(ref, samples) * g * 4 + (len(batches) - 1) * U * torch.stack(parts).abs().sum(0)
    assert bool(((got.flat - whole.flat).abs() <= tol).all())
    assert got.stats["loss"] == pytest.approx(whole.stats["loss"], rel=1e-5, abs=1e-7)   # fp32 sums of ≤ 8 terms
    # the defect the bound guards: each micro-batch normalised by its own tokens
    wrong = sum(ref.chunk_gradients([samples[i] for i in b], adv[b], [old[i] for i in b]).flat for b in batches)
    assert bool(((wrong - whole.flat).abs() > tol).any())


def test_token_budget_log_probs_match_one_pass(model_dir):
    samples = _samples(model_dir)
    ref = _engine(model_dir)
    e = _engine(model_dir, max_tokens_per_micro_batch=_budget(samples))
    passes = _passes(e)
    want, got = ref.logprobs(samples), e.logprobs(samples)
    assert len(passes) >= 3
    tol = _head_bound(ref, samples)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=tol, rtol=0)
    assert e.logprobs([]) == []


def test_token_budget_accumulates_and_steps_like_one_pass(model_dir):
    samples = _samples(model_dir)
    adv = grpo.group_advantages([s.reward for s in samples], group_size=2).float()
    norm = grpo.loss_normalizer([s.response_len for s in samples])
    e = _engine(model_dir, max_tokens_per_micro_batch=_budget(samples))
    old = e.logprobs(samples)
    e.chunk_gradients(samples[:5], adv[:5], old[:5], normalizer=norm, accumulate=True, chunk_id=0)
    e.chunk_gradients(samples[5:], adv[5:], old[5:], normalizer=norm, accumulate=True, chunk_id=1)
    assert e.accumulated == [0, 1]
    with pytest.raises(ValueError, match="normalizer"):
        e.chunk_gradients([], [], [])
    assert e.apply()["chunks"] == 2 and e.version == 1


def test_bad_settings_name_the_engine_field(model_dir):
    for kw, field in (({"max_tokens_per_micro_batch": 0}, "max_tokens_per_micro_batch"),
                      ({"max_tokens_per_micro_batch": 12.5}, "max_tokens_per_micro_batch"),
                      ({"param_offload": "yes"}, "param_offload"), ({"optimizer_offload": 1}, "optimizer_offload")):
        with pytest.raises(ValueError, match=field):
            _engine(model_dir, **kw)


# --------------------------------------------------------------------------------------------------
# offload
# --------------------------------------------------------------------------------------------------

def _moments(engine) -> list:
    return [v.clone() for s in engine.optimizer.state.values() for v in s.values() if v.numel() > 1]


def _step(engine, samples, adv, old):
    engine.chunk_gradients(samples, adv, old, accumulate=True, chunk_id=0)
    return engine.apply()


def test_offloaded_state_round_trips_bit_for_bit_and_leaves_the_device(model_dir):
    samples = _samples(model_dir)
    adv = grpo.group_advantages([s.reward for s in samples], group_size=2).float()
    plain = _engine(model_dir)
    off = _engine(model_dir, param_offload=True, optimizer_offload=True)
    weights = sum(p.numel() * p.element_size() for p in plain.params)
    for step in range(3):
        old_p, old_o = plain.logprobs(samples), off.logprobs(samples)
        assert off.params_on_host and all(torch.equal(a, b) for a, b in zip(old_p, old_o))
        out_p, out_o = _step(plain, samples, adv, old_p), _step(off, samples, adv, old_o)
        assert out_o["grad_norm"] == out_p["grad_norm"]
        assert off.params_on_host and off.optimizer_state_on_host
        moments = sum(t.numel() * t.element_size() for t in _moments(plain))
        # between uses the device holds neither: what it keeps drops by the weights and both moments
        assert off.resident_bytes() == plain.resident_bytes() - weights - moments == 0
        if step == 1:                       # a hot switch meanwhile moves what is resident, and gives it back
            off.offload()
            off.onload()
        state = off.train_state_shard()["state"]          # a snapshot brings both back first
        assert not off.optimizer_state_on_host and not off.params_on_host
        assert all(torch.equal(a, b) for a, b in zip(off.params, plain.params))
        assert all(torch.equal(a, b) for a, b in zip(_moments(off), _moments(plain)))
        assert state["optim"] and off.version == plain.version == step + 1
    off.reset()
    assert not off.params_on_host and not off.optimizer_state_on_host and off.version == 0


def test_offload_waits_for_the_snapshot_copy_it_would_free(model_dir, tmp_path):
    samples = _samples(model_dir, 4)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    e = _engine(model_dir, param_offload=True, optimizer_offload=True)
    old = e.logprobs(samples)
    _step(e, samples, adv, old)
    e.save_snapshot(tmp_path, 1)                           # the copy runs beside the next call
    e.logprobs(samples)
    assert "param_offload" in e.snapshot_waits and e.params_on_host
    assert e.flush_snapshot()["version"] == 1


# --------------------------------------------------------------------------------------------------
# a sharded gang (integration: two spawned processes over gloo)
# --------------------------------------------------------------------------------------------------

def _budget_gang_worker(rank, world, addr, model_dir, out_dir, budget):
    """One rank of a two-rank FSDP2 gang with a token budget and both offloads: every chunk dealt wholly to rank 0
    (several micro-batches there, none on rank 1, which must join each round with an empty share)."""
    import os

    from bidirl.cluster.engines.workers.trainer import TrainerEngine, rank_shares
    from test_trainer_fsdp import CHUNKS, LR, _advantages, _samples as gang_samples

    trainer = TrainerEngine(model_dir, lr=LR, seed=0, threads=1, precision="fp32", max_tokens_per_micro_batch=budget,
                            param_offload=True, optimizer_offload=True)
    join_gang(rank, world, addr)
    trainer.init_process_group(rank, world, addr)
    try:
        samples = gang_samples(model_dir)
        adv = _advantages(samples)
        norm = grpo.loss_normalizer([s.response_len for s in samples])
        out = {"norms": [], "logprobs": [], "states": [], "on_host": []}
        for _ in range(2):
            lps = {}
            for c, (a, b) in enumerate(CHUNKS):
                idx = list(range(a, b))
                mine = rank_shares(idx, len(idx), world)[rank]
                old = trainer.logprobs([samples[k] for k in mine])
                lps.update(dict(zip(mine, old)))
                trainer.chunk_gradients([samples[k] for k in mine], adv[mine] if mine else [], old, normalizer=norm,
                                        accumulate=True, chunk_id=c)
            out["norms"].append(trainer.apply()["grad_norm"])
            out["on_host"].append((trainer.params_on_host, trainer.optimizer_state_on_host))
            out["logprobs"].append(lps)
            out["states"].append(trainer.state_dict())
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        trainer.destroy_process_group()


@pytest.mark.integration
def test_a_gang_runs_token_budget_micro_batches_and_offload_like_the_unsharded_trainer(model_dir, tmp_path):
    """Rank 0 runs several micro-batches per chunk, rank 1 none: the ranks agree on the rounds (or the gang would
    hang), and the step equals the unsharded trainer's on the same weights within ``test_trainer_fsdp``'s fp32
    bounds plus the micro-batches' summation, (k − 1)·u relative for k micro-batches of a chunk."""
    from bidirl.cluster.engines.workers.trainer import TrainerEngine
    from test_trainer_fsdp import _fp32_bounds, _in_own_process, _rounding_reference, _samples as gang_samples

    samples = gang_samples(model_dir)
    budget = _budget(samples)
    k = max(len(token_micro_batches([len(s.prompt_ids) + s.response_len for s in samples[a:b]], budget))
            for a, b in ((0, 4), (4, 7), (7, 8)))
    assert k >= 2
    spawn_gang(_budget_gang_worker, 2, str(model_dir), str(tmp_path), budget)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    start = TrainerEngine(model_dir).state_dict()
    redo = _in_own_process(tmp_path, _rounding_reference, str(model_dir), [start, ranks[0]["states"][0]])
    for step in range(2):
        logprob_tol, norm_rtol = _fp32_bounds(model_dir, samples, redo["max_logit"][step])
        for r in ranks:
            assert r["on_host"][step] == (True, True)
            assert r["norms"][step] == pytest.approx(redo["norms"][step], rel=norm_rtol + 2 * (k - 1) * U)
        assert set(ranks[0]["logprobs"][step]) == set(range(8)) and not ranks[1]["logprobs"][step]
        for i, lp in ranks[0]["logprobs"][step].items():
            torch.testing.assert_close(lp, redo["logprobs"][step][i], atol=logprob_tol, rtol=0)


# --------------------------------------------------------------------------------------------------
# the device-memory terms of these settings (bidirl.perf.memory.device_budget)
# --------------------------------------------------------------------------------------------------

def _budget_of(overrides, device="cuda", preset="h100-default"):
    from bidirl.job import config as cfgmod
    from bidirl.job import planner
    cfg = cfgmod.load(preset).with_overrides(overrides)
    return cfg, planner.device_budget(planner.plan(cfg), device=device, windows=1)


def test_optimizer_offload_takes_the_moments_out_of_the_chunk_phase_only():
    _, plain = _budget_of({})
    _, off = _budget_of({"rl.optimizer_offload": True})
    assert off.optimizer_state == plain.optimizer_state > 0             # brought back for the step
    assert off.phase_bytes()["chunk"] == plain.phase_bytes()["chunk"] - plain.optimizer_state
    assert off.phase_bytes()["apply"] == plain.phase_bytes()["apply"]
    assert "optimizer_state" in plain.phases()["chunk"] and "optimizer_state" not in off.phases()["chunk"]
    # parameter offload lowers no phase: a stage brings the weights back before it computes
    _, params = _budget_of({"rl.param_offload": True})
    assert params.phase_bytes() == plain.phase_bytes()


def test_offload_buffers_of_a_cpu_engine_are_its_stashes(model_dir):
    """On CPU the host is the device: the two stashes a CPU engine keeps are the budget's extra offload bytes, byte
    for byte (the tiny preset's params_total is the checkpoint's parameter count)."""
    cfg, plain = _budget_of({}, device="cpu", preset="tiny-cpu")
    _, off = _budget_of({"rl.param_offload": True, "rl.optimizer_offload": True}, device="cpu", preset="tiny-cpu")
    e = _engine(model_dir, param_offload=True, optimizer_offload=True)
    samples = _samples(model_dir, 4)
    _step(e, samples, torch.tensor([1.0, -1.0, 1.0, -1.0]), e.logprobs(samples))
    rho = off.layout
    assert cfg.model_spec.params_total == e.numel
    assert e._param_stash.nbytes == 4 * e.numel and e._moment_stash.nbytes == 8 * e.numel
    assert off.offload_buffer - plain.offload_buffer == (e._param_stash.nbytes + e._moment_stash.nbytes) / rho


def test_a_token_budget_sizes_the_activations_term_by_its_tokens():
    from bidirl.perf import memory
    cfg, b = _budget_of({"rl.max_tokens_per_micro_batch": 4096})
    _, samples = _budget_of({"rl.micro_batch_per_device": 2})
    assert b.activations == memory.trainer_activation_bytes(cfg.model_spec, 4096, True)
    assert samples.activations == memory.trainer_activation_bytes(
        cfg.model_spec, 2 * (cfg.workload_stats.prompt_max + cfg.workload.max_response_len), True)
