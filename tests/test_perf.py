"""Stage-time models (paper appendix): formulas against hand-computed values, vectorised features against a
direct transcription of the appendix, monotonic properties, defaults, switch costs and workload draws."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bidirl.job import presets
from bidirl.job.presets import HardwareSpec, ModelSpec
from bidirl.perf import (RolloutModel, RolloutParams, TrainerModel, TrainerParams, default_rollout_params,
                         default_trainer_params, derive_switch_costs, derive_weight_sync, forward_flops,
                         overlap, prefill_flops, sample_groups, sample_lengths, stage_multiplier)
from bidirl.perf import memory
from bidirl.perf.costs import (PAGEABLE_FRACTION, SLEEP_FIXED, WAKE_FIXED, state_layout,
                               trainer_offload_reload_time)
from bidirl.perf.balance import serpentine
from bidirl.perf.workload import mean_response, step_jitter


def toy_model(**kw) -> ModelSpec:
    """L = 2, H = 4, V = 10, N_nonemb = 100, b_kv = 2·L·H_kv·d_head·b = 2·2·1·1·1 = 4 bytes per token."""
    spec = dict(name="toy", layers=2, hidden=4, intermediate=8, heads=1, kv_heads=1, head_dim=1, vocab=10,
                tie_word_embeddings=True, params_total=140.0, params_nonembedding=100.0, dtype_bytes=1)
    spec.update(kw)
    return ModelSpec(**spec)


def toy_hw(**kw) -> HardwareSpec:
    spec = dict(name="toyhw", memory_bytes=1e6, peak_flops=1e6, memory_bandwidth=1e4, intra_node_bandwidth=1e3,
                inter_node_bandwidth=1e2, host_bandwidth=1e3, gpus_per_node=8, train_mfu=0.5, decode_mbu=0.5,
                prefill_mfu=0.5, memory_utilization=1.0)
    spec.update(kw)
    return HardwareSpec(**spec)


A6000 = presets.hardware("a6000")
Q4B = presets.model("qwen3-vl-4b")
Q2B = presets.model("qwen3-vl-2b")


# --------------------------------------------------------------------------------------------------
# overlap and FLOPs
# --------------------------------------------------------------------------------------------------

def test_overlap_hand_values():
    assert overlap(3.0, 4.0, 2.0) == pytest.approx(5.0)
    assert overlap(3.0, 4.0, 1.0) == pytest.approx(7.0)
    assert overlap(3.0, 4.0, 200.0) == pytest.approx(4.0, rel=1e-2)
    assert overlap(0.0, 0.0, 2.0) == 0.0
    assert overlap(5.0, 0.0, 3.0) == pytest.approx(5.0)
    np.testing.assert_allclose(overlap(np.array([3.0, 6.0]), np.array([4.0, 8.0]), 2.0), [5.0, 10.0])
    # huge magnitudes stay finite (scaled computation)
    assert overlap(1e300, 1e300, 4.0) == pytest.approx(1e300 * 2 ** 0.25)


def test_overlap_rejects_bad_exponent():
    with pytest.raises(ValueError, match="r must be"):
        overlap(1.0, 1.0, 0.5)


def test_forward_flops_by_hand():
    # p = [1, 2], r = [3, 1] → p + r = [4, 3]
    # 2·N·Σ(p+r) = 2·100·7 = 1400; causal half of 4·L·H·Σ(p+r)² = ½·4·2·4·(16 + 9) = 400;
    # 2·H·V·Σr = 2·4·10·4 = 320
    assert forward_flops(toy_model(), [1, 2], [3, 1]) == pytest.approx(2120.0)


def test_prefill_flops_by_hand():
    # 2·N·Σp = 2·100·3 = 600; causal half of 4·L·H·Σp² = ½·32·(1 + 4) = 80; 2·H·V·B = 80·2 = 160
    assert prefill_flops(toy_model(), [1, 2]) == pytest.approx(840.0)


def test_causal_attention_halves_only_the_quadratic_term():
    """The causal mask's mechanism: a 1,000-token sample's attention term drops from 4·L·H·s² to 2·L·H·s², the
    linear and head terms stay (FlashAttention-2 skips the masked blocks; bidirl.perf.flops module doc)."""
    from bidirl.perf import flops as F
    m = toy_model()
    s = 1000
    linear, head = 2 * 100 * s, 2 * 4 * 10 * (s - 10)
    full_square = 4 * 2 * 4 * s * s
    assert F.CAUSAL_ATTENTION_FRACTION == 0.5
    assert forward_flops(m, [10], [s - 10]) == pytest.approx(linear + full_square / 2 + head, rel=1e-12)
    assert prefill_flops(m, [s]) - prefill_flops(m, [0]) == pytest.approx(2 * 100 * s + full_square / 2, rel=1e-12)


def test_stage_multipliers():
    assert [stage_multiplier(s) for s in ("old_logprob", "ref_logprob", "actor_update")] == [1, 1, 3]
    with pytest.raises(ValueError, match="actor_update"):
        stage_multiplier("backward")


def test_lengths_are_validated():
    with pytest.raises(ValueError, match="response_lens"):
        forward_flops(toy_model(), [1, 2], [3, -1])
    with pytest.raises(ValueError, match="one entry per sample"):
        forward_flops(toy_model(), [1, 2], [3])
    with pytest.raises(ValueError, match="whole token counts"):
        prefill_flops(toy_model(), [1.5])
    assert prefill_flops(toy_model(), np.array([1.0, 2.0])) == pytest.approx(840.0)


# --------------------------------------------------------------------------------------------------
# trainer model
# --------------------------------------------------------------------------------------------------

def toy_trainer(layout=1, **params) -> TrainerModel:
    # α chosen so that α·F = 4 s for the hand micro-batch (F = 2120, test_forward_flops_by_hand)
    values = dict(tau=0.5, alpha=4.0 / 2120.0, r=2.0, alpha_comm=3.0, beta_comm=0.0)
    values.update(params)
    return TrainerModel(toy_model(), toy_hw(), layout=layout, params=TrainerParams.uniform(**values))


def test_microbatch_time_by_hand():
    m = toy_trainer()
    # old_logprob: τ + (4² + 3²)^½ = 0.5 + 5
    assert m.microbatch_time("old_logprob", [1, 2], [3, 1]) == pytest.approx(5.5)
    # actor_update: m_s = 3 → τ + (12² + 3²)^½
    assert m.microbatch_time("actor_update", [1, 2], [3, 1]) == pytest.approx(0.5 + math.sqrt(153.0))
    assert m.microbatch_time("old_logprob", [], []) == 0.0


def test_replica_time_is_the_ordered_sum():
    m = toy_trainer()
    mbs = [("old_logprob", [1, 2], [3, 1]), ("ref_logprob", [1, 2], [3, 1]), ("actor_update", [1, 2], [3, 1])]
    assert m.replica_time(mbs) == pytest.approx(5.5 + 5.5 + 0.5 + math.sqrt(153.0))
    with pytest.raises(ValueError, match="triples"):
        m.replica_time([("old_logprob", [1])])


def test_message_bytes_fsdp():
    model = toy_model()                     # W = N_total · b = 140 bytes, N_total = 140
    assert toy_trainer(layout=1).message_bytes("actor_update") == 0.0
    m = toy_trainer(layout=2)
    assert m.message_bytes("old_logprob") == pytest.approx(140 * 0.5)
    assert m.message_bytes("actor_update") == pytest.approx((2 * 140 + 4 * model.params_total) * 0.5)
    # C_s(b) = α_comm + β_comm·n_s with n_s from the layout
    m2 = toy_trainer(layout=2, alpha_comm=1.0, beta_comm=2.0 / 70.0)     # C = 1 + 2 = 3 for the forward stages
    assert m2.microbatch_time("old_logprob", [1, 2], [3, 1]) == pytest.approx(5.5)


def test_stage_time_by_hand():
    # 4 equal samples (p=1, r=3 → F = 2·100·4 + ½·32·16 + 80·3 = 1296), micro-batch 1 per device, 2 replicas:
    # each replica runs 2 micro-batches per stage.
    m = toy_trainer(alpha=1.0 / 1296.0, alpha_comm=0.0)
    t_fwd, t_upd = 0.5 + 1.0, 0.5 + 3.0
    p, r = [1] * 4, [3] * 4
    assert m.stage_time(p, r, d=2, micro_batch_per_device=1) == pytest.approx(2 * (2 * t_fwd + t_upd))
    assert m.stage_time(p, r, d=2, micro_batch_per_device=1, stages=("old_logprob", "actor_update")) == \
        pytest.approx(2 * (t_fwd + t_upd))
    # micro-batches of 2: one micro-batch of F = 2592 per stage and replica
    assert m.stage_time(p, r, d=2, micro_batch_per_device=2) == pytest.approx(2 * (0.5 + 2.0) + 0.5 + 6.0)
    # more replicas than samples: the extra replicas idle
    assert m.stage_time(p, r, d=10, micro_batch_per_device=1) == pytest.approx(2 * t_fwd + t_upd)
    assert m.stage_time([], [], d=3, micro_batch_per_device=1) == 0.0


def test_microbatch_size_scales_with_layout():
    m = toy_trainer(layout=2, alpha=1.0 / 1296.0, alpha_comm=0.0)
    # a 2-GPU replica takes 2 samples per micro-batch at 1 per device: one micro-batch of F = 2592 per stage
    assert m.stage_time([1, 1], [3, 3], d=1, micro_batch_per_device=1, stages=("old_logprob",)) == \
        pytest.approx(0.5 + 2.0)


def test_chunk_time_splits_equally():
    m = toy_trainer(alpha=1.0 / 1296.0, alpha_comm=0.0)
    # 4 equal samples on a gang of 2: each replica one micro-batch of 2 samples (F = 2592)
    assert m.chunk_time("old_logprob", [1] * 4, [3] * 4, 2) == pytest.approx(0.5 + 2.0)
    assert m.chunk_time("actor_update", [1] * 4, [3] * 4, 1) == pytest.approx(0.5 + 12.0)
    assert m.chunk_time("actor_update", [], [], 2) == 0.0
    with pytest.raises(ValueError, match="d \\(number of replicas\\)"):
        m.chunk_time("actor_update", [1], [1], 0)


def test_trainer_params_validation():
    with pytest.raises(ValueError, match="missing stages"):
        TrainerParams(tau={"old_logprob": 1.0}, alpha={}, r={}, alpha_comm={}, beta_comm={})
    with pytest.raises(ValueError, match="r must be finite and ≥ 1"):
        TrainerParams.uniform(tau=1, alpha=1, r=0.5, alpha_comm=0, beta_comm=0)
    with pytest.raises(ValueError, match="tau"):
        TrainerParams.uniform(tau=-1, alpha=1, r=2, alpha_comm=0, beta_comm=0)


# --------------------------------------------------------------------------------------------------
# rollout model
# --------------------------------------------------------------------------------------------------

def toy_rollout(kv_budget, **params) -> RolloutModel:
    values = dict(tau_pre=1.0, alpha_pre=0.001, tau_dec=0.1, beta_tok=0.01, beta_hist=0.001, r=2.0)
    values.update(params)
    return RolloutModel(toy_model(), toy_hw(), params=RolloutParams(**values), kv_budget_bytes=kv_budget)


def test_kv_bytes_and_n_max_by_hand():
    m = toy_rollout(kv_budget=24.0)
    assert m.kv_bytes_per_token == 4.0                       # 2·L·H_kv·d_head·b = 2·2·1·1·1
    assert RolloutModel(toy_model(kv_heads=2), toy_hw(), tp=2).kv_bytes_per_token == 4.0
    assert m.n_max(2) == 3                                   # ⌊24 / (4·2)⌋
    assert m.n_max(7) == 1                                   # ⌊24/28⌋ = 0 → 1
    np.testing.assert_array_equal(m.n_max(np.array([1.0, 3.0, 6.0])), [6, 2, 1])
    assert RolloutModel(toy_model(), toy_hw(), kv_budget_bytes=1e9, max_seqs=5).n_max(1) == 5


def test_decode_features_by_hand():
    # p = [2, 2], r = [1, 3]; H_dec = (1·2 + 0) + (3·2 + 3) = 11, N_tok = 4
    loose = toy_rollout(kv_budget=1e6)
    assert loose.decode_features([2, 2], [1, 3]) == (3.0, 4.0, 11.0)        # one wave per step
    # B_kv = 24: b_kv·ℓ at t=1 is 4·2 = 8 → N_max = 3 ≥ 2 → 1 wave; every later step has one request
    assert toy_rollout(kv_budget=24.0).decode_features([2, 2], [1, 3]) == (3.0, 4.0, 11.0)
    # B_kv = 12: t=1 ℓ=2 → N_max = 1 → 2 waves; t=2 (ℓ=3) and t=3 (ℓ=4): 1 request, 1 wave → W_dec = 4
    assert toy_rollout(kv_budget=12.0).decode_features([2, 2], [1, 3]) == (4.0, 4.0, 11.0)


def test_replica_time_by_hand():
    m = toy_rollout(kv_budget=12.0)
    # prefill: N_pre = min(2, N_max(2) = 1) = 1 → W_pre = 2; F_pre([2, 2]) = 2·100·4 + ½·32·8 + 80·2 = 1088
    p_pre = 1.0 * 2 + 0.001 * 1088
    p_dec = 0.1 * 4 + 0.01 * 4 + 0.001 * 11
    assert m.prefill_time([2, 2]) == pytest.approx(p_pre)
    assert m.replica_time([2, 2], [1, 3]) == pytest.approx(p_pre + p_dec)
    # communication: C_pre = c_pre·Σp, C_dec = c_dec·N_tok, p-norm overlapped
    mc = toy_rollout(kv_budget=12.0, c_pre=0.5, c_dec=0.25, r=2.0)
    assert mc.replica_time([2, 2], [1, 3]) == pytest.approx(math.hypot(p_pre, 2.0) + math.hypot(p_dec, 1.0))


def naive_decode_waves(model: RolloutModel, p, r) -> float:
    """The appendix's W_dec, transcribed literally (loop over steps and requests)."""
    total = 0
    for t in range(1, max(r, default=0) + 1):
        active = [i for i in range(len(r)) if r[i] >= t]
        if not active:
            continue
        ell = sum(p[i] + t - 1 for i in active) / len(active)
        n_max = max(1, math.floor(model.kv_budget_bytes / (model.kv_bytes_per_token * ell))) if ell > 0 else 10 ** 9
        total += math.ceil(len(active) / min(len(active), n_max))
    return float(total)


@settings(max_examples=60)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 60)), min_size=1, max_size=25),
       st.sampled_from([12.0, 50.0, 400.0, 1e6]))
def test_vectorised_decode_features_match_the_appendix(reqs, budget):
    p = [a for a, _ in reqs]
    r = [b for _, b in reqs]
    m = toy_rollout(kv_budget=budget)
    w, n, h = m.decode_features(p, r)
    assert w == naive_decode_waves(m, p, r)
    assert n == sum(r)
    assert h == pytest.approx(sum(ri * pi + ri * (ri - 1) / 2 for pi, ri in zip(p, r)))
    # the no-wave shortcut agrees with the per-step computation
    rep = np.zeros(len(p), np.int64)
    full = m._decode_waves(np.array(p), np.array(r), rep, 1, shortcut=False)
    assert full[0] == w


@pytest.mark.parametrize("budget", [1e6, 300.0, 40.0])
def test_stepping_decode_iterations_reproduces_p_dec(budget):
    """The simulator's per-iteration cost summed over decode steps equals P_dec (spec: within 1 %)."""
    rng = np.random.default_rng(3)
    p = rng.integers(1, 30, size=40)
    r = rng.integers(0, 80, size=40)
    m = toy_rollout(kv_budget=budget)
    q = m.params
    w, n, h = m.decode_features(p, r)
    p_dec = q.tau_dec * w + q.beta_tok * n + q.beta_hist * h
    stepped = sum(m.decode_iteration_time(p[r >= t] + t - 1) for t in range(1, int(r.max()) + 1))
    assert stepped == pytest.approx(p_dec, rel=1e-9)
    assert m.decode_iteration_time([]) == 0.0


def test_decode_iteration_time_on_a_real_model():
    m = RolloutModel(Q4B, A6000)
    rng = np.random.default_rng(0)
    p, r = sample_groups(presets.workload("geo3k"), 2048, 8, 8, rng)
    q = m.params
    w, n, h = m.decode_features(p, r)
    stepped = sum(m.decode_iteration_time(p[r >= t] + t - 1) for t in range(1, int(r.max()) + 1))
    assert stepped == pytest.approx(q.tau_dec * w + q.beta_tok * n + q.beta_hist * h, rel=0.01)


def test_stage_time_keeps_groups_whole_and_takes_the_replica_max():
    m = toy_rollout(kv_budget=1e6)
    p = np.repeat([5, 6, 7, 8], 3)
    r = np.array([1, 2, 3, 10, 10, 10, 4, 4, 4, 2, 2, 9])
    replica, d_eff = m.partition(p, r, 2, group_size=3)
    assert d_eff == 2
    assert all(len(set(replica[3 * g:3 * g + 3])) == 1 for g in range(4))
    times = [m.replica_time(p[replica == j], r[replica == j]) for j in range(2)]
    assert m.stage_time(p, r, 2, group_size=3) == pytest.approx(max(times))
    assert m.stage_time(p, r, 1, group_size=3) == pytest.approx(m.replica_time(p, r))
    with pytest.raises(ValueError, match="group_size=5"):
        m.stage_time(p, r, 2, group_size=5)
    assert m.stage_time([], [], 4) == 0.0


def test_serpentine_balances_counts():
    rep, rank = serpentine([9, 8, 7, 6, 5, 4, 3], 3)
    np.testing.assert_array_equal(rep, [0, 1, 2, 2, 1, 0, 0])
    np.testing.assert_array_equal(rank, [0, 0, 0, 1, 1, 1, 2])


# --------------------------------------------------------------------------------------------------
# monotonic properties (hypothesis)
# --------------------------------------------------------------------------------------------------

sizes = st.lists(st.tuples(st.integers(1, 300), st.integers(0, 300)), min_size=1, max_size=30)


@given(sizes, st.integers(0, 50), st.integers(0, 29))
def test_longer_responses_never_faster_trainer(reqs, extra, which):
    m = TrainerModel(Q2B, A6000, layout=2)
    p = np.array([a for a, _ in reqs])
    r = np.array([b for _, b in reqs])
    longer = r.copy()
    longer[which % len(r)] += extra
    for stage in ("old_logprob", "actor_update"):
        assert m.microbatch_time(stage, p, longer) >= m.microbatch_time(stage, p, r)
    # all responses longer by the same amount keeps the balanced split: M_t never decreases
    for d in (1, 3):
        assert m.stage_time(p, r + extra, d, 2) >= m.stage_time(p, r, d, 2) - 1e-12


@given(st.integers(1, 300), st.lists(st.integers(0, 300), min_size=1, max_size=30), st.integers(0, 80),
       st.integers(0, 29), st.sampled_from([2e5, 1e12]))
def test_longer_responses_never_faster_rollout(prompt, r, extra, which, budget):
    """One GRPO group (shared prompt length): W_dec, N_tok and H_dec all grow with any response length."""
    m = RolloutModel(Q2B, A6000, kv_budget_bytes=budget)
    p = np.full(len(r), prompt)
    r = np.array(r)
    longer = r.copy()
    longer[which % len(r)] += extra
    assert m.replica_time(p, longer) >= m.replica_time(p, r)
    for d in (1, 2, 5):
        assert m.stage_time(p, r + extra, d) >= m.stage_time(p, r, d) - 1e-12


@given(sizes, st.integers(0, 29), st.integers(0, 80))
def test_longer_responses_never_faster_rollout_when_kv_holds_the_batch(reqs, which, extra):
    m = RolloutModel(Q2B, A6000, kv_budget_bytes=1e15)
    p = np.array([a for a, _ in reqs])
    r = np.array([b for _, b in reqs])
    longer = r.copy()
    longer[which % len(r)] += extra
    assert m.replica_time(p, longer) >= m.replica_time(p, r)


@given(st.integers(1, 400), st.integers(1, 600), st.integers(1, 64), st.integers(1, 16), st.integers(1, 8))
def test_more_replicas_never_slower_on_balanced_work(prompt, response, n, d, mb):
    p, r = np.full(n, prompt), np.full(n, response)
    trainer = TrainerModel(Q4B, A6000, layout=2)
    rollout = RolloutModel(Q4B, A6000, kv_budget_bytes=5e8)       # tight: waves appear
    assert trainer.stage_time(p, r, d + 1, mb) <= trainer.stage_time(p, r, d, mb) + 1e-12
    assert rollout.stage_time(p, r, d + 1) <= rollout.stage_time(p, r, d) + 1e-12
    assert trainer.chunk_time("actor_update", p, r, d + 1) <= trainer.chunk_time("actor_update", p, r, d) + 1e-12


# --------------------------------------------------------------------------------------------------
# the planner's all-counts evaluations equal one count at a time (hypothesis)
# --------------------------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2 ** 32 - 1), st.integers(1, 40), st.integers(1, 8),
       st.sampled_from([(30.0, None), (400.0, 6), (4000.0, 64), (1e9, None)]), st.booleans())
def test_rollout_stage_times_equal_one_count_at_a_time(seed, n_groups, group_size, kv, communication):
    """Every count's M_r, from the deals of all counts at once (groups alone shared, the slowest replicas picked
    by their groups' shares, KV overflows stepped through), is exactly what stage_time gives."""
    rng = np.random.default_rng(seed)
    p = np.repeat(rng.integers(0, 60, n_groups), group_size)
    r = rng.integers(0, int(rng.choice([3, 40, 300])), n_groups * group_size)
    comm = dict(c_pre=0.003, c_dec=0.02, r=3.0) if communication else {}
    m = RolloutModel(toy_model(), toy_hw(), params=RolloutParams(tau_pre=1.0, alpha_pre=0.001, tau_dec=0.1,
                                                                 beta_tok=0.01, beta_hist=0.001, **comm),
                     kv_budget_bytes=kv[0], max_seqs=kv[1])
    ds = sorted({int(d) for d in rng.integers(1, n_groups + 3, 6)} | {1, n_groups})
    np.testing.assert_array_equal(m.stage_times(p, r, ds, group_size),
                                  [m.stage_time(p, r, d, group_size) for d in ds])


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2 ** 32 - 1), st.integers(1, 300), st.integers(1, 3), st.integers(1, 5),
       st.sampled_from(["default", "no communication", "communication-bound"]))
def test_trainer_stage_times_equal_one_count_at_a_time(seed, n, layout, mb, params):
    """Every gang size's M_t, from the serpentine deals of all sizes at once and only the busiest replicas
    timed, is exactly what stage_time gives."""
    rng = np.random.default_rng(seed)
    p, r = rng.integers(1, 400, n), rng.integers(0, 600, n)
    chosen = {"default": None, "no communication": TrainerParams.uniform(0.01, 1e-12, 2.0, 0.0, 0.0),
              "communication-bound": TrainerParams.uniform(0.01, 1e-16, 2.0, 50.0, 1e-9)}[params]
    m = TrainerModel(Q2B, A6000, layout=layout, params=chosen)
    stages = ("old_logprob", "ref_logprob", "actor_update")
    ds = sorted({int(d) for d in rng.integers(1, n + 3, 8)} | {1, n})
    np.testing.assert_array_equal(m.stage_times(p, r, ds, mb, stages), [m.stage_time(p, r, d, mb, stages)
                                                                        for d in ds])


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2 ** 32 - 1), st.integers(2, 200), st.integers(1, 12))
def test_span_times_equal_chunk_time_of_each_span(seed, n, d):
    rng = np.random.default_rng(seed)
    p, r = rng.integers(1, 400, n).tolist(), rng.integers(0, 600, n).tolist()
    starts = rng.integers(0, n - 1, 6)
    stops = np.minimum(n, starts + rng.integers(1, 40, 6))
    m = TrainerModel(Q2B, A6000, layout=2)
    got = m.span_times("actor_update", p, r, starts, stops, d)
    assert got == [m.chunk_time("actor_update", p[a:b], r[a:b], d) for a, b in zip(starts, stops)]


# --------------------------------------------------------------------------------------------------
# preset-derived defaults
# --------------------------------------------------------------------------------------------------

def test_default_trainer_params_from_the_preset():
    q = default_trainer_params(Q4B, A6000, layout=4)
    assert q.alpha["actor_update"] == pytest.approx(1.0 / (4 * A6000.peak_flops * A6000.train_mfu))
    assert q.tau["actor_update"] == pytest.approx(3 * q.tau["old_logprob"])
    assert q.beta_comm["old_logprob"] == pytest.approx(1.0 / A6000.intra_node_bandwidth)   # 4 GPUs: one node
    # 16 GPUs span two nodes: FSDP's ring crosses each node's network once per channel, so it runs at the node's
    # 200 Gb/s NIC (8 GPUs × the preset's 3.125 GB/s per-GPU share = 25 GB/s), not at one GPU's share of it
    assert default_trainer_params(Q4B, A6000, layout=16).beta_comm["old_logprob"] == pytest.approx(1 / 25e9)
    assert 1 / default_trainer_params(Q4B, A6000, layout=16).beta_comm["old_logprob"] < A6000.intra_node_bandwidth
    one = default_trainer_params(Q4B, A6000, layout=1)
    assert all(v == 0 for v in one.alpha_comm.values())


def test_default_rollout_params_from_the_preset():
    q = default_rollout_params(Q4B, A6000)
    decoder_bytes = (Q4B.params_total - Q4B.vision_params) * 2
    mbu, bw = A6000.decode_mbu, A6000.memory_bandwidth
    assert q.tau_dec == pytest.approx(decoder_bytes / (bw * mbu) + 1e-3)
    assert q.alpha_pre == pytest.approx(1 / (A6000.peak_flops * A6000.prefill_mfu))
    assert q.beta_hist > Q4B.kv_bytes_per_token() / (bw * mbu)
    assert q.c_pre == q.c_dec == 0.0
    tp2 = default_rollout_params(Q4B, A6000, tp=2)
    assert tp2.c_dec > 0 and tp2.alpha_pre == pytest.approx(q.alpha_pre / 2)


def test_kv_budget_default_is_memory_left_after_weights():
    m = RolloutModel(Q4B, A6000)
    expected = (A6000.memory_bytes * A6000.memory_utilization - Q4B.params_total * 2
                - memory.PREFILL_CHUNK_TOKENS * 2 * (8 * Q4B.hidden + 4 * Q4B.intermediate))
    assert m.kv_budget_bytes == pytest.approx(expected)


# --------------------------------------------------------------------------------------------------
# switch costs
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["qwen3-vl-2b", "qwen3-vl-4b"])
def test_derived_switch_costs_within_2x_of_table_3(model):
    measured = A6000.measured_switch_costs[model]
    derived = derive_switch_costs(A6000, presets.model(model))
    for direction, values in measured.items():
        for key, value in values.items():
            got = getattr(derived[direction], key)
            if value == 0:
                assert got == 0
            else:
                assert 0.5 <= got / value <= 2.0, (model, direction, key, got, value)


def test_switch_costs_grow_with_the_model_and_fall_with_bandwidth():
    small = derive_switch_costs(A6000, Q2B)
    big = derive_switch_costs(A6000, presets.model("qwen3-8b"))
    for d in small:
        assert big[d].c_in > small[d].c_in and big[d].c_out > small[d].c_out
    fast = derive_switch_costs(presets.hardware("h100"), Q2B)
    assert fast["rollout_on_trainer_pool"].c_in < small["rollout_on_trainer_pool"].c_in
    assert derive_weight_sync(A6000, Q4B) > derive_weight_sync(A6000, Q2B) > 0


def test_only_the_rollout_engine_pays_the_wake_and_sleep_latency():
    # a trainer's state moves as a plain host copy (benchmarks/trainer_scale.md: 45.0 GB offloaded in 1.00 s on an
    # H200, the copy at bus speed); vLLM's sleep/wake latency is the rollout engine's alone. One more second of
    # wake latency therefore adds exactly 1 s to the switch that wakes the rollout engine (ToR C_out, RoT C_in)
    # and nothing to the others; likewise for sleep (ToR C_in, RoT C_out).
    h100 = presets.hardware("h100")
    base = derive_switch_costs(h100, Q4B)
    woke = derive_switch_costs(h100, Q4B, constants={"wake_fixed": WAKE_FIXED + 1.0})
    slept = derive_switch_costs(h100, Q4B, constants={"sleep_fixed": SLEEP_FIXED + 1.0})
    tor, rot = "trainer_on_rollout_pool", "rollout_on_trainer_pool"
    assert woke[tor].c_out - base[tor].c_out == pytest.approx(1.0) and woke[tor].c_in == base[tor].c_in
    assert woke[rot].c_in - base[rot].c_in == pytest.approx(1.0) and woke[rot].c_out == base[rot].c_out
    assert slept[tor].c_in - base[tor].c_in == pytest.approx(1.0) and slept[tor].c_out == base[tor].c_out
    assert slept[rot].c_out - base[rot].c_out == pytest.approx(1.0) and slept[rot].c_in == base[rot].c_in
    # the trainer's side of ToR C_in: the auxiliary trainer's 8·N/ρ_t bytes at the pageable rate, no latency
    rho = state_layout(h100, Q4B)
    pageable = h100.host_bandwidth * PAGEABLE_FRACTION
    expected = (SLEEP_FIXED + Q4B.dtype_bytes * Q4B.params_total / h100.host_bandwidth
                + 8 * Q4B.params_total / rho / pageable
                + Q4B.dtype_bytes * Q4B.params_total / (rho * h100.inter_node_bandwidth))
    assert base[tor].c_in == pytest.approx(expected, rel=1e-12)
    # ROLL's per-step offload and reload: two pageable copies of 12·N/ρ_t bytes
    assert trainer_offload_reload_time(h100, Q4B) == pytest.approx(2 * 12 * Q4B.params_total / rho / pageable)


def test_presets_fall_back_to_derived_costs():
    h100 = presets.hardware("h100")
    assert h100.switch_costs("rollout_on_trainer_pool", Q4B) == derive_switch_costs(h100, Q4B)["rollout_on_trainer_pool"]
    assert h100.weight_sync_time(Q4B, rollout_tp=1) == pytest.approx(derive_weight_sync(h100, Q4B))


# --------------------------------------------------------------------------------------------------
# workload draws and memory
# --------------------------------------------------------------------------------------------------

def test_sample_lengths_seeded_and_bounded():
    stats = presets.workload("geo3k")
    a = sample_lengths(stats, 2048, 4000, np.random.default_rng(7))
    b = sample_lengths(stats, 2048, 4000, np.random.default_rng(7))
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    p, r = a
    assert p.min() >= stats.prompt_min and p.max() <= stats.prompt_max
    assert r.min() >= 1 and r.max() <= 2048 and (r == 2048).any()
    assert abs(p.mean() - stats.prompt_mean) < 5
    # mean of the clipped log-normal is a little below the unclipped mean
    assert 0.85 * mean_response(stats, 2048) < r.mean() < 1.02 * mean_response(stats, 2048)


def test_sample_groups_share_prompts_and_drift():
    stats = presets.workload("geo3k")
    p, r = sample_groups(stats, 2048, 50, 8, np.random.default_rng(1))
    assert p.shape == r.shape == (400,)
    assert (p.reshape(50, 8) == p.reshape(50, 8)[:, :1]).all()
    assert step_jitter(stats, 0) == 1.0
    assert step_jitter(stats, 5) == step_jitter(stats, 5) != 1.0
    ratio = mean_response(stats, 2048, 50) / (mean_response(stats, 2048, 0) * step_jitter(stats, 50))
    assert ratio == pytest.approx((1 + stats.response_drift_per_step) ** 50)


def test_sample_lengths_rejects_bad_input():
    stats = presets.workload("geo3k")
    with pytest.raises(ValueError, match="max_response_len"):
        sample_lengths(stats, 0, 4, np.random.default_rng(0))
    with pytest.raises(ValueError, match="step"):
        sample_lengths(stats, 16, 4, np.random.default_rng(0), step=-1)


def test_layout_candidates():
    assert memory.layout_candidates(8, 32) == [1, 2, 4, 8, 16, 24, 32]
    assert memory.layout_candidates(8, 6) == [1, 2, 4]
    assert memory.layout_candidates(6, 12) == [1, 2, 4, 6, 12]
