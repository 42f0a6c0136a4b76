"""GRPO math by hand, the arithmetic task, the tiny model's files, and the torch trainer engine (no vLLM)."""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest
import torch

from bidirl.core.protocol import GroupState
from bidirl.rl import grpo
from bidirl.rl.samples import GroupPayload, Sample, samples_from_groups
from bidirl.rl.tasks import ALPHABET, ArithmeticTask


# --------------------------------------------------------------------------------------------------
# task
# --------------------------------------------------------------------------------------------------

def test_task_is_deterministic_and_random_access():
    a, b = ArithmeticTask(seed=3), ArithmeticTask(seed=3)
    assert a.prompts(20) == b.prompts(20)
    assert a.prompts(5, start=7) == a.prompts(12)[7:]
    assert a.problem(11) == a.prompts(12)[11]
    assert [p.text for p in ArithmeticTask(seed=4).prompts(20)] != [p.text for p in a.prompts(20)]


def test_task_answers_are_correct_and_written_in_the_alphabet():
    task = ArithmeticTask(seed=0, max_operand=50, ops="+-*")
    for p in task.prompts(200):
        assert p.text == f"{p.a}{p.op}{p.b}="
        assert int(p.answer) == {"+": p.a + p.b, "-": p.a - p.b, "*": p.a * p.b}[p.op]
        assert 0 <= p.a <= 50 and 0 <= p.b <= 50
        assert set(p.text + p.answer) <= set(ALPHABET)
        assert len(p.answer) <= task.max_answer_chars()
        assert len(p.text) <= task.max_prompt_chars()
    assert {p.op for p in task.prompts(200)} == {"+", "-", "*"}


def test_reward_is_exact_match():
    assert ArithmeticTask.reward("19", "19") == 1.0
    assert ArithmeticTask.reward("19", " 19\n") == 1.0
    assert ArithmeticTask.reward("19", "190") == 0.0
    assert ArithmeticTask.reward("19", "1") == 0.0
    assert ArithmeticTask.reward("-4", "-4") == 1.0
    assert ArithmeticTask.reward("19", "") == 0.0
    task = ArithmeticTask()
    np.testing.assert_array_equal(task.rewards(["1", "2", "3"], ["1", "3", "3"]), [1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="one answer per response"):
        task.rewards(["1"], ["1", "2"])


@pytest.mark.parametrize("kwargs, match", [
    ({"seed": -1}, "seed"), ({"max_operand": 0}, "max_operand"), ({"ops": "/"}, "ops"), ({"ops": "++"}, "ops"),
])
def test_task_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ArithmeticTask(**kwargs)


def test_task_rejects_bad_indices():
    with pytest.raises(ValueError, match="non-negative"):
        ArithmeticTask().problem(-1)
    with pytest.raises(ValueError, match="non-negative"):
        ArithmeticTask().prompts(-2)


# --------------------------------------------------------------------------------------------------
# GRPO advantages
# --------------------------------------------------------------------------------------------------

def test_group_advantages_by_hand():
    # group [1, 0, 0, 1]: mean 0.5, sample std sqrt(((.5)^2 * 4) / 3) = sqrt(1/3)
    adv = grpo.group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]]), eps=0.0)
    s = math.sqrt(1 / 3)
    torch.testing.assert_close(adv[0], torch.tensor([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s]))
    torch.testing.assert_close(adv[1], torch.zeros(4))          # no relative signal
    # population std: 0.5 -> advantages ±1
    pop = grpo.group_advantages([1.0, 0.0, 0.0, 1.0], group_size=4, eps=0.0, unbiased=False)
    torch.testing.assert_close(pop, torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=pop.dtype))
    # eps enters the denominator
    e = grpo.group_advantages([1.0, 0.0], group_size=2, eps=0.5)
    std = math.sqrt(0.5)
    torch.testing.assert_close(e, torch.tensor([0.5 / (std + 0.5), -0.5 / (std + 0.5)], dtype=e.dtype))


def test_group_advantages_flat_matches_grouped_and_sums_to_zero():
    rng = np.random.default_rng(0)
    r = rng.integers(0, 2, size=(6, 8)).astype(np.float32)
    grouped = grpo.group_advantages(torch.tensor(r))
    flat = grpo.group_advantages(torch.tensor(r.reshape(-1)), group_size=8)
    torch.testing.assert_close(flat.view(6, 8), grouped)
    # a z-scored group of n = 8 has |a_i| ≤ (n − 1)/√n; its fp32 sum rounds by ≤ n·u·Σ|a_i| and the mean it was
    # centred on by ≤ 2·u per element: (n + 2)·u·n·(n − 1)/√n ≈ 1.2e-5
    n, u = 8, 2.0 ** -24
    torch.testing.assert_close(grouped.sum(dim=1), torch.zeros(6), atol=(n + 2) * u * n * (n - 1) / n ** 0.5, rtol=0)


def test_group_advantages_edge_cases_and_errors():
    torch.testing.assert_close(grpo.group_advantages(torch.tensor([[1.0], [0.0]])), torch.zeros(2, 1))
    with pytest.raises(ValueError, match="group_size"):
        grpo.group_advantages([1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="do not split"):
        grpo.group_advantages([1.0, 0.0, 1.0], group_size=2)
    with pytest.raises(ValueError, match="finite"):
        grpo.group_advantages([1.0, float("nan")], group_size=2)
    with pytest.raises(ValueError, match="group_size=3"):
        grpo.group_advantages(torch.zeros(2, 4), group_size=3)


# --------------------------------------------------------------------------------------------------
# policy loss
# --------------------------------------------------------------------------------------------------

def _example():
    # two responses: 2 tokens and 1 token (second token of row 1 is padding)
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -9.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -2.0], [-0.2, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[True, True], [True, False]])
    return logp, old, adv, mask


def test_policy_loss_clipping_by_hand():
    logp, old, adv, mask = _example()
    loss, stats = grpo.policy_loss(logp, old, adv, mask, clip_eps=0.2)
    r00, r01, r10 = math.exp(0.5), 1.0, math.exp(-0.3)
    # token (0,0): A=1, ratio 1.6487 > 1.2 -> clipped term -1.2 is the max of (-1.6487, -1.2)
    # token (0,1): A=1, ratio 1 -> -1
    # token (1,0): A=-2, ratio 0.7408 < 0.8 -> max(2*0.7408, 2*0.8) = 1.6 (clipped)
    per_token = [-1.2, -1.0, 1.6]
    assert loss.item() == pytest.approx(sum(per_token) / 3, abs=1e-6)
    assert stats.pg_loss == pytest.approx(sum(per_token) / 3, abs=1e-6)
    assert stats.clip_frac == pytest.approx(2 / 3)
    assert stats.ratio_mean == pytest.approx((r00 + r01 + r10) / 3, abs=1e-6)
    assert stats.tokens == 3 and stats.sequences == 2 and stats.kl == 0.0
    loss.backward()
    # only the unclipped token (0,1) has gradient: d(-A*ratio)/dlogp = -A*ratio / N = -1/3
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -1 / 3], [0.0, 0.0]]))


def test_policy_loss_asymmetric_clip_and_no_clip_for_unhelpful_side():
    logp, old, adv, mask = _example()
    loss, stats = grpo.policy_loss(logp, old, adv, mask, clip_eps=0.2, clip_eps_high=1.0)
    # with 1 + eps_high = 2, token (0,0) (ratio 1.6487) is no longer clipped
    per_token = [-math.exp(0.5), -1.0, 1.6]
    assert loss.item() == pytest.approx(sum(per_token) / 3, abs=1e-6)
    assert stats.clip_frac == pytest.approx(1 / 3)


def test_policy_loss_seq_mean_token_mean_and_normalizer():
    logp, old, adv, mask = _example()
    loss, _ = grpo.policy_loss(logp, old, adv, mask, loss_agg="seq-mean-token-mean")
    assert loss.item() == pytest.approx(((-1.2 - 1.0) / 2 + 1.6) / 2, abs=1e-6)
    loss, _ = grpo.policy_loss(logp, old, adv, mask, loss_agg="token-mean", normalizer=10)
    assert loss.item() == pytest.approx((-1.2 - 1.0 + 1.6) / 10, abs=1e-6)
    with pytest.raises(ValueError, match="loss_agg"):
        grpo.policy_loss(logp, old, adv, mask, loss_agg="sum")
    with pytest.raises(ValueError, match="normalizer"):
        grpo.policy_loss(logp, old, adv, mask, normalizer=0)


def test_k3_kl_by_hand_and_in_the_loss():
    lp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -2.0]])
    d = -0.5
    torch.testing.assert_close(grpo.kl_k3(lp, ref), torch.tensor([[math.exp(d) - d - 1, 0.0]]))
    assert (grpo.kl_k3(torch.randn(50), torch.randn(50)) >= 0).all()
    logp, old, adv, mask = _example()
    ref = torch.tensor([[-1.0, -1.0], [-0.5, -3.0]])
    loss, stats = grpo.policy_loss(logp, old, adv, mask, ref_logprobs=ref, kl_coef=0.1)
    kl = [0.0, math.exp(1.0) - 1.0 - 1, 0.0]
    assert stats.kl == pytest.approx(sum(kl) / 3, abs=1e-6)
    assert loss.item() == pytest.approx((-1.2 - 1.0 + 1.6 + 0.1 * sum(kl)) / 3, abs=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo.policy_loss(logp, old, adv, mask, kl_coef=0.1)


def test_policy_loss_shape_errors():
    logp, old, adv, mask = _example()
    with pytest.raises(ValueError, match="old_logprobs"):
        grpo.policy_loss(logp, old[:, :1], adv, mask)
    with pytest.raises(ValueError, match="advantages"):
        grpo.policy_loss(logp, old, torch.ones(3), mask)
    with pytest.raises(ValueError, match="kl_coef"):
        grpo.policy_loss(logp, old, adv, mask, kl_coef=-1.0)


def test_chunk_losses_with_step_normalizer_add_up_to_the_batch_loss():
    g = torch.Generator().manual_seed(0)
    B, T = 8, 5
    logp = -torch.rand(B, T, generator=g) * 3
    old = logp + 0.1 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    lengths = torch.tensor([5, 3, 1, 4, 2, 5, 1, 3])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    for agg in grpo.LOSS_AGGS:
        full, _ = grpo.policy_loss(logp, old, adv, mask, loss_agg=agg)
        norm = grpo.loss_normalizer(lengths.tolist(), agg)
        parts = sum(grpo.policy_loss(logp[s], old[s], adv[s], mask[s], loss_agg=agg, normalizer=norm)[0]
                    for s in (slice(0, 3), slice(3, 8)))
        assert parts.item() == pytest.approx(full.item(), abs=1e-6)
    assert grpo.loss_normalizer([3, 0, 2], "token-mean") == 5.0
    assert grpo.loss_normalizer([3, 0, 2], "seq-mean-token-mean") == 2.0


# --------------------------------------------------------------------------------------------------
# samples
# --------------------------------------------------------------------------------------------------

def _group(gid=0, done=(True, True), rewards=(1.0, 0.0)):
    payload = GroupPayload(prompt_ids=(4, 13, 5, 16), token_ids=((6, 1), (7, 8, 1)),
                           logprobs=((-0.1, -0.2), (-1.0, -0.5, -0.3)), versions=(2, 1),
                           finish_reasons=("stop", "stop"), max_tokens=8, texts=("3", "45"), rewards=rewards)
    return GroupState(gid, 4, (2, 3), done, 1, payload)


def test_samples_from_groups_flattens_in_group_order():
    samples = samples_from_groups([_group(0), _group(5)])
    assert [(s.group_id, s.index) for s in samples] == [(0, 0), (0, 1), (5, 0), (5, 1)]
    assert samples[1].response_ids == (7, 8, 1) and samples[1].logprobs == (-1.0, -0.5, -0.3)
    assert samples[1].version == 1 and samples[0].reward == 1.0 and samples[1].response_len == 3


def test_samples_from_groups_rejects_incomplete_or_unscored_groups():
    with pytest.raises(ValueError, match="not complete"):
        samples_from_groups([_group(done=(True, False))])
    with pytest.raises(ValueError, match="reward_fn"):
        samples_from_groups([_group(rewards=None)])
    with pytest.raises(ValueError, match="GroupPayload"):
        samples_from_groups([GroupState(0, 4, (1,), (True,), 0, payload={"x": 1})])


# --------------------------------------------------------------------------------------------------
# tiny model files (no warm start) and the trainer engine
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from bidirl.rl import tiny_model
    return tiny_model.create(tmp_path_factory.mktemp("tiny") / "m", seed=0)


def test_tokenizer_round_trips_the_task_alphabet(model_dir):
    from bidirl.rl import tiny_model
    tok = tiny_model.load_tokenizer(model_dir)
    assert len(tok) == tiny_model.TinyConfig().vocab_size
    ids = tok("12+7=")["input_ids"]
    assert len(ids) == 5 and tok.eos_token_id == tiny_model.vocabulary()[tiny_model.EOS]
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == "12+7="
    assert tok.decode(tok("3-45*6")["input_ids"]) == "3-45*6"


def test_create_is_byte_identical_per_seed_and_leaves_global_rng_alone(model_dir, tmp_path):
    from bidirl.rl import tiny_model
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    again = tiny_model.create(tmp_path / "again", seed=0)
    assert torch.equal(torch.rand(3), before)                    # create() forks the RNG
    other = tiny_model.create(tmp_path / "other", seed=1)
    digest = lambda d: hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()
    assert digest(again) == digest(model_dir)
    assert digest(other) != digest(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["hidden_size"] == 128 and cfg["tie_word_embeddings"]
    with pytest.raises(ValueError, match="seed"):
        tiny_model.create(tmp_path / "bad", seed=-1)


def test_parameter_counts_match_the_model_and_the_preset(model_dir):
    from transformers import Qwen2ForCausalLM

    from bidirl.job import presets
    from bidirl.rl import tiny_model
    model = Qwen2ForCausalLM.from_pretrained(model_dir)
    counts = tiny_model.parameter_counts()
    assert sum(p.numel() for p in model.parameters()) == counts["params_total"]
    spec = presets.model("tiny")
    cfg = tiny_model.TinyConfig()
    assert spec.params_total == counts["params_total"] and spec.params_nonembedding == counts["params_nonembedding"]
    assert (spec.layers, spec.hidden, spec.intermediate, spec.vocab) == \
        (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size)
    assert (spec.heads, spec.kv_heads, spec.head_dim) == \
        (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads)


def _samples(n=6, seed=0):
    from bidirl.rl import tiny_model
    tok = tiny_model.build_tokenizer()
    task = ArithmeticTask(seed=seed)
    rng = np.random.default_rng(seed)
    out = []
    for i, p in enumerate(task.prompts(n)):
        answer = p.answer if i % 2 == 0 else str(int(p.answer) + 1)
        resp = tok(answer)["input_ids"] + ([tok.eos_token_id] if rng.random() < 0.7 else [])
        out.append(Sample(i // 2, i % 2, tuple(tok(p.text)["input_ids"]), tuple(resp), (),
                          float(i % 2 == 0), 0))
    return out


@pytest.fixture
def trainer(model_dir):
    from bidirl.cluster.engines.workers.trainer import TrainerEngine
    return TrainerEngine(model_dir, lr=1e-3, seed=0)


def test_trainer_logprobs_match_a_direct_forward(trainer):
    samples = _samples()
    lps = trainer.logprobs(samples)
    s = samples[3]
    ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids)])
    with torch.no_grad():
        logits = trainer.model(input_ids=ids).logits[0].float()
    P = len(s.prompt_ids)
    expect = torch.log_softmax(logits, -1)[P - 1:P - 1 + len(s.response_ids)].gather(
        -1, torch.tensor(s.response_ids)[:, None]).squeeze(-1)
    # the same weights and arithmetic but the head's matmul blocked differently (response rows only, in chunks):
    # a logit z rounds by ≤ λ·√h·u·|z| on each side, logsumexp over V adds λ·√V·u (tests/rounding.py; λ = 6)
    cfg = trainer.model.config
    bound = 2 * 2 * 6 * 2.0 ** -24 * (cfg.hidden_size ** 0.5 + cfg.vocab_size ** 0.5) * float(logits.abs().max())
    torch.testing.assert_close(lps[3], expect, atol=bound, rtol=0)
    assert [len(x) for x in lps] == [s.response_len for s in samples]


def test_chunk_gradients_add_up_to_the_batch_gradient(trainer):
    samples = _samples(8)
    adv = grpo.group_advantages([s.reward for s in samples], group_size=2).float()
    old = trainer.logprobs(samples)
    full = trainer.chunk_gradients(samples, adv, old)
    norm = grpo.loss_normalizer([s.response_len for s in samples])
    parts = [trainer.chunk_gradients(samples[a:b], adv[a:b], old[a:b], normalizer=norm) for a, b in ((0, 3), (3, 8))]
    # the same per-token terms summed in two parts then added: a sum of N terms regrouped rounds by
    # ≤ λ·√N·u of its magnitude on each side, + one addition (u); magnitude taken as max|g| (λ = 6)
    N, u = sum(s.response_len for s in samples), 2.0 ** -24
    bound = 2 * (6 * N ** 0.5 + 1) * u * float(full.flat.abs().max())
    torch.testing.assert_close(parts[0].flat + parts[1].flat, full.flat, atol=bound, rtol=0)
    assert full.flat.shape == (trainer.numel,) and full.flat.abs().sum() > 0
    assert full.tokens == sum(s.response_len for s in samples) and full.samples == 8
    with pytest.raises(ValueError, match="advantages"):
        trainer.chunk_gradients(samples, adv[:3], old)
    with pytest.raises(ValueError, match="old_logprobs"):
        trainer.chunk_gradients(samples, adv, old[:-1])


def test_apply_sums_in_order_and_moves_the_weights(trainer, model_dir):
    from bidirl.cluster.engines.workers.trainer import TrainerEngine
    samples = _samples(8)
    adv = grpo.group_advantages([s.reward for s in samples], group_size=2).float()
    old = trainer.logprobs(samples)
    norm = grpo.loss_normalizer([s.response_len for s in samples])
    parts = [trainer.chunk_gradients(samples[a:b], adv[a:b], old[a:b], normalizer=norm) for a, b in ((0, 4), (4, 8))]
    twin = TrainerEngine(model_dir, lr=1e-3, seed=0)
    twin.apply([parts[0].flat + parts[1].flat])
    before = trainer.state_dict()
    out = trainer.apply(parts)
    assert out["version"] == 1 and out["chunks"] == 2 and trainer.version == 1
    after = trainer.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    for k, v in twin.state_dict().items():
        # identical gradients (the same two operands added in the same order: IEEE addition is deterministic)
        # and the same AdamW arithmetic; 1e-7 ≈ one rounding of a weight below 2 (u·2 = 1.2e-7) absorbs an FMA
        # contracted on one path and not the other
        torch.testing.assert_close(after[k], v, atol=1e-7, rtol=0)
    # the update raises the log-probs of positive-advantage responses
    new = trainer.logprobs(samples)
    gain = [float(n.sum() - o.sum()) for n, o in zip(new, old)]
    assert np.mean([g for g, a in zip(gain, adv) if a > 0]) > np.mean([g for g, a in zip(gain, adv) if a < 0])
    with pytest.raises(ValueError, match="no chunk gradients"):
        trainer.apply([])
    with pytest.raises(ValueError, match="values"):
        trainer.apply([torch.zeros(5)])


def test_auxiliary_trainer_computes_but_never_applies(model_dir, trainer):
    from bidirl.cluster.engines.workers.trainer import TrainerEngine
    aux = TrainerEngine(model_dir, role="auxiliary")
    samples = _samples(4)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    g_aux = aux.chunk_gradients(samples, adv, trainer.logprobs(samples))
    g_pri = trainer.chunk_gradients(samples, adv, trainer.logprobs(samples))
    torch.testing.assert_close(g_aux.flat, g_pri.flat, atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="auxiliary"):
        aux.apply([g_aux])
    with pytest.raises(ValueError, match="role"):
        TrainerEngine(model_dir, role="helper")


def test_weight_sync_between_trainers(model_dir, trainer):
    from bidirl.cluster.engines.workers.trainer import TrainerEngine
    samples = _samples(4)
    trainer.apply([trainer.chunk_gradients(samples, torch.tensor([1.0, -1, 1, -1]), trainer.logprobs(samples))])
    aux = TrainerEngine(model_dir, role="auxiliary")
    state = trainer.state_dict()
    assert "lm_head.weight" in state                      # the tied head travels with the weights
    aux.load_state_dict(state, version=trainer.version)
    assert aux.version == 1
    for a, b in zip(aux.logprobs(samples), trainer.logprobs(samples)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    with pytest.raises(ValueError, match="missing keys"):
        aux.load_state_dict({"model.norm.weight": state["model.norm.weight"]})


def test_offload_frees_and_onload_restores_weights_and_optimizer(trainer):
    samples = _samples(4)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    trainer.apply([trainer.chunk_gradients(samples, adv, trainer.logprobs(samples))])   # creates Adam state
    state = trainer.state_dict()
    moments = {k: v.clone() for k, v in trainer.optimizer.state[trainer.params[0]].items()}
    nbytes = trainer.state_bytes()
    assert nbytes >= 3 * trainer.numel * 4                    # weights + two Adam moments in fp32
    assert trainer.offload() >= 0.0 and trainer.offloaded
    assert all(p.untyped_storage().nbytes() == 0 for p in trainer.params)
    assert trainer.state_bytes() == nbytes
    with pytest.raises(RuntimeError, match="onload"):
        trainer.logprobs(samples)
    assert trainer.offload() == 0.0                           # idempotent
    assert trainer.onload() >= 0.0 and not trainer.offloaded
    for k, v in trainer.state_dict().items():
        assert torch.equal(v, state[k])
    for k, v in trainer.optimizer.state[trainer.params[0]].items():
        assert torch.equal(v, moments[k])
    trainer.apply([trainer.chunk_gradients(samples, adv, trainer.logprobs(samples))])   # still trains
    ref = trainer.logprobs(samples, model="reference")          # the reference model travels too
    with_ref = trainer.state_bytes()
    assert with_ref == nbytes + trainer.numel * 4
    trainer.offload()
    assert trainer.reference_model().model.embed_tokens.weight.untyped_storage().nbytes() == 0
    trainer.onload()
    for a, b in zip(trainer.logprobs(samples, model="reference"), ref):
        assert torch.equal(a, b)


def test_trainer_rejects_bad_settings(model_dir, tmp_path):
    from bidirl.cluster.engines.workers.trainer import TrainerEngine
    with pytest.raises(ValueError, match="lr"):
        TrainerEngine(model_dir, lr=0)
    with pytest.raises(ValueError, match="loss_agg"):
        TrainerEngine(model_dir, loss_agg="sum")
    with pytest.raises(ValueError, match="config.json"):
        TrainerEngine(tmp_path)
    with pytest.raises(ValueError, match="kl_coef > 0"):
        TrainerEngine(model_dir, kl_coef=0.1).chunk_gradients(_samples(2), [1.0, -1.0], [[0.0] * 2] * 2)


def test_the_cached_models_key_follows_the_code_that_builds_it(tmp_path, monkeypatch):
    """The tests take the tiny model from the project's cache (``tests/conftest.py``), so a cached folder must be
    what the installed code builds: its key hashes the source of the modules that build it, and changes with it."""
    from bidirl.rl import bootstrap
    key = bootstrap.cache_key()
    assert bootstrap.cache_key() == key                          # the same code and settings: the same folder
    module = tmp_path / "warm_start_variant.py"
    module.write_text("STEPS = 180\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(bootstrap, "BUILD_MODULES", bootstrap.BUILD_MODULES + ("warm_start_variant",))
    with_module = bootstrap.cache_key()
    module.write_text("STEPS = 181\n")                          # read from its file, never imported
    assert len({key, with_module, bootstrap.cache_key()}) == 3, "a change to the building code kept the old key"
