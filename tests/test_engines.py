"""The real engines on CPU: vLLM rollout (in-process), torch trainer, FSDP2 gangs over gloo, Ray actor wrappers.

Integration tests (``-m integration``): they load vLLM, spawn processes and start a local Ray. The tiny
model comes from the project's cache (``$BIDIRL_CACHE`` or ``~/.cache/bidirl``, built on first use:
``tests/conftest.py``); one vLLM engine is shared by the in-process tests, which reset its weights where they
change them.
Tolerances, fp32 throughout, each derived from the arithmetic in ``tests/rounding.py`` (none from one machine's
output): vLLM's sampled-token log-probs and the trainer's recomputed ones on the same weights differ in rounding
only, ≤ 2·2ρ·Z_max (``rounding.run_logprob_tolerance``: ≈ 4e-3 for the tiny models, whose logits are bounded by
≈ 11; measured ≈ 2e-6 on an AMD EPYC), for both built-in architectures (Qwen2 with a tied head, Llama with an
untied one); a two-rank FSDP2 gang and one process agree on the gradient within 2·ρ_g·max|g| (ρ_g: the forward
path, its transpose and the sum over the batch's tokens) and, after one AdamW step from the same state, on every
updated weight within its own bound (``rounding.same_step``, none exempt); ``tests/test_trainer_fsdp.py`` has the
multi-step comparison.
"""

from __future__ import annotations

import importlib.util
import math
import os

import numpy as np
import pytest
import torch

from bidirl.cluster.engines.workers.rollout import GroupRequest, RolloutEngine, request_seed
from bidirl.cluster.engines.sync_grpo import requests_for, run_grpo
from bidirl.cluster.engines.workers.trainer import TrainerEngine
from bidirl.rl import grpo
from bidirl.rl.bootstrap import ensure_tiny_model
from bidirl.rl.model_folder import TINY_MARKER
from bidirl.rl.samples import Sample, samples_from_groups
from bidirl.rl.tasks import ArithmeticTask
from bidirl.rl.tiny_model import TINY_LLAMA

import rounding
from gang_rendezvous import join_gang, spawn_gang

pytestmark = pytest.mark.integration
# checked without importing vllm: the DP test's spawned workers import this module and must stay light
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="the rollout engine needs vllm (pip install -e .[cpu])")

TASK = ArithmeticTask(seed=0)


def _logprob_tol(model_dir, weights) -> float:
    """vLLM against the trainer on ``weights`` (the rounding bound of ``tests/rounding.py``)."""
    return rounding.run_logprob_tolerance(model_dir, weights, lr=0.0, steps=0)


@pytest.fixture(scope="module")
def initial_state(model_dir):
    return TrainerEngine(model_dir).state_dict()


@pytest.fixture(scope="module")
def engine(model_dir):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("the rollout engine needs vllm (pip install -e .[cpu])")
    torch.manual_seed(1234)
    expected = torch.rand(2)
    torch.manual_seed(1234)
    eng = RolloutEngine(model_dir, seed=0, max_model_len=32, reward_fn=TASK.reward)
    assert torch.equal(torch.rand(2), expected), "starting vLLM in-process must leave the global RNG alone"
    yield eng
    eng.shutdown()


@pytest.fixture
def fresh(engine, initial_state):
    """The shared engine with the checkpoint's weights (version 0) and nothing in flight."""
    if engine.offloaded:
        engine.onload()
    engine.interrupt()
    engine.load_weights(initial_state, version=0)
    return engine


@pytest.fixture(scope="module")
def llama_dir(model_dir):
    """The built-in tiny Llama (untied head, no biases), built and warm-started once beside the Qwen2 model."""
    return ensure_tiny_model(cache_dir=model_dir.parent, cfg=TINY_LLAMA)


@pytest.fixture(scope="module")
def llama_engine(llama_dir):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("the rollout engine needs vllm (pip install -e .[cpu])")
    eng = RolloutEngine(llama_dir, seed=0, max_model_len=32, reward_fn=TASK.reward)
    yield eng
    eng.shutdown()


@pytest.fixture(params=["qwen2", "llama"])
def synced(request, fresh, model_dir):
    """(engine, model folder) of each built-in architecture, the engine at the checkpoint's weights."""
    if request.param == "qwen2":
        return fresh, model_dir
    engine, folder = request.getfixturevalue("llama_engine"), request.getfixturevalue("llama_dir")
    engine.interrupt()
    engine.load_weights(TrainerEngine(folder).state_dict(), version=0)
    return engine, folder


def _requests(engine, n, start=0, group_size=4, max_tokens=8, **kw):
    return [GroupRequest(p.index, tuple(engine.tokenizer(p.text)["input_ids"]), group_size, max_tokens, p.answer, **kw)
            for p in TASK.prompts(n, start)]


def _max_diff(samples, logprobs):
    return max(float((torch.tensor(s.logprobs) - lp).abs().max()) for s, lp in zip(samples, logprobs))


def test_warm_started_model_is_partly_right(model_dir):
    import json
    info = json.loads((model_dir / TINY_MARKER).read_text())
    stats = info["warm_start_stats"]
    assert 0.2 <= stats["sample_reward"] <= 0.7, stats        # room for GRPO to improve, and signal to do it
    assert stats["last_loss"] < stats["first_loss"]
    assert ensure_tiny_model(cache_dir=model_dir.parent) == model_dir     # cached: same folder, no rebuild


def test_vllm_logprobs_match_the_trainer_after_weight_sync(synced):
    fresh, model_dir = synced
    # lr 3e-3: one AdamW step moves every weight by ≈ lr, so the pre-update weights' log-probs stand clear of the
    # rounding bound (at tiny-cpu's 3e-4 one step moves them by about the bound itself)
    trainer = TrainerEngine(model_dir, lr=3e-3, threads=1)
    groups = fresh.generate(_requests(fresh, 8))
    samples = samples_from_groups(groups)
    assert _max_diff(samples, trainer.logprobs(samples)) <= _logprob_tol(model_dir, trainer.state_dict())
    # one GRPO update, then sync: vLLM must now sample from the new weights (tied lm_head included)
    adv = grpo.group_advantages([s.reward for s in samples], group_size=4).float()
    trainer.apply([trainer.chunk_gradients(samples, adv, trainer.logprobs(samples))])
    seconds = fresh.load_weights(trainer.state_dict(), version=trainer.version)
    assert seconds >= 0 and fresh.version == 1
    after = samples_from_groups(fresh.generate(_requests(fresh, 8, start=100)))
    assert all(s.version == 1 for s in after)
    tol = _logprob_tol(model_dir, trainer.state_dict())
    assert _max_diff(after, trainer.logprobs(after)) <= tol
    stale = TrainerEngine(model_dir)                                 # the pre-update weights
    assert _max_diff(after, stale.logprobs(after)) > 2 * tol


def test_weight_sync_takes_wrapped_names_and_refuses_another_models_weights(fresh, model_dir, llama_dir,
                                                                           initial_state):
    from bidirl.rl.model_folder import checkpoint_shapes
    assert "lm_head.weight" not in checkpoint_shapes(model_dir)      # the tied head is stored once
    assert "lm_head.weight" in checkpoint_shapes(llama_dir)          # the Llama's is its own
    trainer = TrainerEngine(model_dir, lr=3e-4, threads=1)
    samples = samples_from_groups(fresh.generate(_requests(fresh, 4)))
    trainer.apply([trainer.chunk_gradients(samples, [1.0, -1.0, 0.5, -0.5] * 4, trainer.logprobs(samples))])
    # names as a compiled, data-parallel wrapper would give them, tied head left out: mapped to checkpoint names
    wrapped = {f"module._orig_mod.{k}": v for k, v in trainer.state_dict().items() if k != "lm_head.weight"}
    fresh.load_weights(wrapped, version=1)
    after = samples_from_groups(fresh.generate(_requests(fresh, 8, start=100)))
    # the tied head was refreshed too
    assert _max_diff(after, trainer.logprobs(after)) <= _logprob_tol(model_dir, trainer.state_dict())
    llama_state = TrainerEngine(llama_dir).state_dict()
    with pytest.raises(ValueError, match=r"do not match the checkpoint: missing names \['model.layers.0.self_attn"):
        fresh.load_weights(llama_state)
    bad = dict(initial_state, **{"model.norm.weight": torch.zeros(7)})
    with pytest.raises(ValueError, match=r"shape mismatches \['model.norm.weight \(7,\) != \(128,\)'\]"):
        fresh.load_weights(bad)
    with pytest.raises(ValueError, match="missing keys"):
        trainer.load_state_dict(llama_state)
    assert fresh.version == 1                                            # nothing was loaded by the refused calls


def test_prompts_beyond_a_steps_token_budget_generate_whole_on_cpu(fresh):
    """256 responses with 30-token prompts (7,680 prompt tokens) exceed a CPU engine's step budget of 4,096: vLLM
    would split a prompt over two steps, and with seeded requests its rewind of a CPU generator raises (vLLM
    0.32). CPU engines schedule whole prompts (``rollout.cpu_scheduling``): every response completes, with the
    tokens it gets when its group runs alone (position-keyed sampling)."""
    sched = fresh.engine.vllm_config.scheduler_config
    assert not sched.enable_chunked_prefill and sched.max_num_batched_tokens == 4096
    prompt = tuple(fresh.tokenizer("12+34=")["input_ids"]) * 5
    prompt = prompt[:30]
    reqs = [GroupRequest(g, prompt, 8, 2) for g in range(32)]
    assert len(prompt) * 8 * len(reqs) > sched.max_num_batched_tokens
    out = fresh.generate(reqs)
    assert len(out) == 32 and all(g.complete for g in out)
    alone = fresh.generate([GroupRequest(5, prompt, 8, 2)])
    assert [g.payload.token_ids for g in out if g.group_id == 5] == [alone[0].payload.token_ids]


def test_same_seeds_give_the_same_tokens(fresh):
    a = fresh.generate(_requests(fresh, 6, group_size=4))
    b = fresh.generate(_requests(fresh, 6, group_size=4))
    assert [g.payload.token_ids for g in a] == [g.payload.token_ids for g in b]
    assert [g.payload.logprobs for g in a] == [g.payload.logprobs for g in b]
    # responses of a group draw from different streams: not all groups collapse to one answer
    assert any(len(set(g.payload.token_ids)) > 1 for g in a)
    assert len({request_seed(0, 3, i) for i in range(8)}) == 8
    assert request_seed(0, 3, 1) != request_seed(1, 3, 1)
    for g in a:
        assert g.complete and g.payload.texts is not None
        assert all(r in (0.0, 1.0) for r in g.payload.rewards)
        assert g.generated == tuple(len(t) for t in g.payload.token_ids)


def test_interrupt_and_resume_keep_the_prefix_and_complete_to_length(fresh, model_dir, initial_state):
    reqs = _requests(fresh, 4, start=200, group_size=3, max_tokens=12, ignore_eos=True)
    fresh.start(reqs)
    assert fresh.busy
    assert fresh.step_until(max_steps=3) == []
    states = fresh.interrupt()
    assert not fresh.busy and fresh.group_ids == []
    assert [s.group_id for s in states] == [r.group_id for r in reqs]
    for s in states:
        assert not any(s.done) and all(0 < n < 12 for n in s.generated)
        assert all(len(t) == len(lp) for t, lp in zip(s.payload.token_ids, s.payload.logprobs))
    # a weight sync between interrupt and resume: new tokens come from version 1, the prefix stays version 0
    trainer = TrainerEngine(model_dir, lr=3e-4, threads=1)
    fresh.load_weights(trainer.state_dict(), version=1)
    resumed = [GroupRequest(s.group_id, s.payload.prompt_ids, 3, 12, s.payload.meta, resume=s, ignore_eos=True)
               for s in states]
    fresh.start(resumed)
    final = sorted(fresh.step_until(), key=lambda g: g.group_id)
    for before, after in zip(states, final):
        assert after.complete and after.version == 0
        for i, (old, new) in enumerate(zip(before.payload.token_ids, after.payload.token_ids)):
            assert len(new) == 12 and after.payload.finish_reasons[i] == "length"
            assert new[:len(old)] == old                                             # never regenerated
            assert after.payload.logprobs[i][:len(old)] == before.payload.logprobs[i]
    # the stitched responses are consistent samples of the (unchanged) weights: vLLM == trainer
    samples = [Sample(g.group_id, i, g.payload.prompt_ids, t, lp, 0.0, 0)
               for g in final for i, (t, lp) in enumerate(zip(g.payload.token_ids, g.payload.logprobs))]
    assert _max_diff(samples, trainer.logprobs(samples)) <= _logprob_tol(model_dir, trainer.state_dict())
    # natural (EOS-ending) groups resume too; a group already complete comes straight back
    fresh.start(_requests(fresh, 3, start=300, group_size=4, max_tokens=8))
    fresh.step_until(max_steps=1)
    part = fresh.interrupt()
    fresh.start([GroupRequest(s.group_id, s.payload.prompt_ids, 4, 8, s.payload.meta, resume=s) for s in part])
    done = sorted(fresh.step_until(), key=lambda g: g.group_id)
    assert [g.group_id for g in done] == [s.group_id for s in part] and all(g.complete for g in done)
    for s, g in zip(part, done):
        for old, new in zip(s.payload.token_ids, g.payload.token_ids):
            assert new[:len(old)] == old
    fresh.start([GroupRequest(g.group_id, g.payload.prompt_ids, 4, 8, g.payload.meta, resume=g) for g in done[:1]])
    assert not fresh.busy and fresh.step_until() == done[:1]


def test_a_resumed_response_gets_the_tokens_it_would_have_got(fresh, model_dir, initial_state):
    """Position-keyed sampling: interrupting and resuming (here twice) does not change what is sampled."""
    reqs = _requests(fresh, 5, start=300, group_size=4, max_tokens=10, ignore_eos=True)
    whole = fresh.generate(reqs)
    fresh.start(reqs)
    states = fresh.step_until(max_steps=2) + fresh.interrupt()
    for _ in range(2):
        partial = [s for s in states if not s.complete]
        assert partial, "the interrupt must leave unfinished groups to resume"
        fresh.start([GroupRequest(s.group_id, s.payload.prompt_ids, 4, 10, s.payload.meta, resume=s,
                                  ignore_eos=True) for s in partial])
        states = [s for s in states if s.complete] + fresh.step_until(max_steps=2) + fresh.interrupt()
    states = [s for s in states if s.complete] + fresh.generate(
        [GroupRequest(s.group_id, s.payload.prompt_ids, 4, 10, s.payload.meta, resume=s, ignore_eos=True)
         for s in states if not s.complete])
    states.sort(key=lambda s: s.group_id)
    assert [s.payload.token_ids for s in states] == [s.payload.token_ids for s in whole]
    diff = max(abs(a - b) for s, w in zip(states, whole) for x, y in zip(s.payload.logprobs, w.payload.logprobs)
               for a, b in zip(x, y))
    assert diff <= _logprob_tol(model_dir, initial_state)     # prefill of a resumed prefix vs decode: rounding only


def test_position_keyed_noise_samples_the_softmax():
    """Gumbel-max with position-keyed noise draws from softmax(logits / T) (a fixed-seed frequency check)."""
    from bidirl.cluster.engines.workers.sampler import gumbel_noise, position_seed

    assert position_seed(1, 5) == position_seed(1, 5) != position_seed(1, 6) != position_seed(2, 5)
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0])
    for temperature in (1.0, 0.5):
        n = 4000
        picks = torch.stack([torch.argmax(logits / temperature + gumbel_noise(7, pos, 4, "cpu")) for pos in range(n)])
        freq = torch.bincount(picks, minlength=4).float() / n
        expected = torch.softmax(logits / temperature, dim=0)
        assert float((freq - expected).abs().max()) < 0.03, (freq, expected)


def test_position_sampler_follows_the_batch_as_vllm_reorders_it():
    """Rows added, removed, moved and swapped keep their own (seed, prompt length, output tokens)."""
    from types import SimpleNamespace

    from vllm.v1.sample.logits_processor import BatchUpdate
    from vllm.v1.sample.logits_processor.interface import MoveDirectionality

    from bidirl.cluster.engines.workers.sampler import SEED_KEY, PositionKeyedSampler, gumbel_noise

    proc = PositionKeyedSampler(None, torch.device("cpu"), False)
    params = lambda seed: SimpleNamespace(extra_args={SEED_KEY: seed})            # noqa: E731
    outs = {k: [] for k in "abc"}
    proc.update_state(BatchUpdate(3, removed=[], moved=[], added=[
        (0, params(10), [1, 2], outs["a"]), (1, params(11), [1, 2, 3], outs["b"]),
        (2, SimpleNamespace(extra_args=None), [1], outs["c"])]))
    assert sorted(proc.rows) == [0, 1]                   # a request without a seed is left to vLLM
    proc.update_state(BatchUpdate(2, removed=[0], added=[], moved=[(1, 0, MoveDirectionality.UNIDIRECTIONAL)]))
    assert list(proc.rows) == [0] and proc.rows[0][0] == 11
    proc.update_state(BatchUpdate(2, removed=[], moved=[(0, 1, MoveDirectionality.SWAP)],
                                  added=[(1, params(12), [5], outs["a"])]))        # removed, added, then moved
    assert proc.rows[0][0] == 12 and proc.rows[1][0] == 11
    outs["a"].append(4)                                   # the live output list: position = prompt + output
    picked = proc.apply(torch.zeros(2, 6))
    expected = [int(torch.argmax(gumbel_noise(seed, pos, 6, "cpu"))) for seed, pos in ((12, 2), (11, 3))]
    assert [int((row == 0).nonzero()) for row in picked] == expected
    assert torch.isinf(picked).sum() == 2 * 5


def test_interrupt_selected_groups_and_input_errors(fresh):
    fresh.start(_requests(fresh, 3, start=400, max_tokens=12, ignore_eos=True))
    fresh.step_until(max_steps=1)
    first = fresh.interrupt([400])
    assert [s.group_id for s in first] == [400] and fresh.group_ids == [401, 402]
    with pytest.raises(ValueError, match="not on this engine"):
        fresh.interrupt([400])
    with pytest.raises(RuntimeError, match="in flight"):
        fresh.load_weights({"x": torch.zeros(1)})
    with pytest.raises(ValueError, match="already on this engine"):
        fresh.start(_requests(fresh, 1, start=401))
    rest = fresh.step_until()
    assert sorted(g.group_id for g in rest) == [401, 402]
    with pytest.raises(ValueError, match="max_model_len"):
        fresh.start(_requests(fresh, 1, max_tokens=40))
    with pytest.raises(ValueError, match="different prompt"):
        fresh.start([GroupRequest(400, (4, 4, 16), 4, 12, resume=first[0])])


def test_offload_releases_memory_and_onload_restores_the_same_outputs(fresh):
    before = fresh.generate(_requests(fresh, 4, start=500))
    kv = fresh.kv_cache_bytes()
    assert kv > 0
    t_off = fresh.offload()
    assert fresh.offloaded and fresh.kv_cache_bytes() == 0
    assert fresh.last_switch["kv_bytes_released"] == kv
    with pytest.raises(RuntimeError, match="offloaded"):
        fresh.start(_requests(fresh, 1))
    t_on = fresh.onload()
    assert not fresh.offloaded and fresh.kv_cache_bytes() == kv
    assert t_off >= 0 and t_on >= 0
    after = fresh.generate(_requests(fresh, 4, start=500))
    assert [g.payload.token_ids for g in after] == [g.payload.token_ids for g in before]
    fresh.start(_requests(fresh, 1, start=600, max_tokens=12, ignore_eos=True))
    with pytest.raises(RuntimeError, match="in flight"):
        fresh.offload()
    fresh.interrupt()


@pytest.fixture(scope="module")
def block32_engine(model_dir):
    """An engine with 32-token KV blocks, which the tiny model's 64 positions can fill. Kept to the module's end
    like the others: shutting an in-process vLLM engine down tears down the process's parallel groups, which the
    shared engine still uses."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("the rollout engine needs vllm (pip install -e .[cpu])")
    eng = RolloutEngine(model_dir, seed=0, max_model_len=64, block_size=32)
    yield eng
    eng.shutdown()


def test_prefix_caching_reuses_a_shared_prompt_and_never_serves_stale_keys_and_values(block32_engine, model_dir,
                                                                                      initial_state):
    """Prefix caching is on; a cached block must hold the current weights' keys and values of its tokens. The
    default 128-token CPU block is longer than the tiny model's 64 positions, so this engine uses 32-token blocks
    and a 40-token prompt (one full block to share). Checked: the group's responses share the prompt's block, and
    after a weight load, after the KV storage is freed and restored (offload / onload) and across an interrupt
    and resume, vLLM's log-probs equal the trainer's recomputation with the weights in place (a stale or zeroed
    block shifts them by far more than the rounding bound, ≈ 4e-3: 1.8 and 2.4 measured with the resets after a load and
    around the KV release removed) and the tokens are the uninterrupted ones."""
    eng = block32_engine
    assert eng.prefix_caching and eng.enforce_eager and eng.kv_block_tokens == 32
    prompt = tuple(eng.tokenizer("3+4=" * 10)["input_ids"])
    assert len(prompt) == 40

    def group(gid):
        return [GroupRequest(gid, prompt, 4, 16, ignore_eos=True)]

    def check(states, trainer):
        samples = [Sample(g.group_id, i, g.payload.prompt_ids, t, lp, 0.0, 0)
                   for g in states for i, (t, lp) in enumerate(zip(g.payload.token_ids, g.payload.logprobs))]
        assert _max_diff(samples, trainer.logprobs(samples)) <= _logprob_tol(model_dir, trainer.state_dict())

    trainer = TrainerEngine(model_dir, threads=1)
    base = eng.generate(group(0))
    assert eng.prefix_cached_tokens >= 3 * 32              # three responses reuse the first one's block
    hits = eng.prefix_cached_tokens
    assert [g.payload.token_ids for g in eng.generate(group(0))] == [g.payload.token_ids for g in base]
    assert eng.prefix_cached_tokens - hits == 4 * 32        # now all four, from the cache
    check(base, trainer)
    # new weights (keys and values of every layer scaled): the cached block of the old ones must go
    changed = {k: v * 1.5 if ("k_proj" in k or "v_proj" in k) else v for k, v in initial_state.items()}
    trainer.load_state_dict(changed, version=1)
    eng.load_weights(changed, version=1)
    after_load = eng.generate(group(0))
    check(after_load, trainer)
    assert [g.payload.token_ids for g in after_load] != [g.payload.token_ids for g in base]
    # the KV storage freed and re-allocated (zeroed): no block may still be taken for cached
    eng.offload()
    eng.onload(kv=False)
    eng.onload()
    after_switch = eng.generate(group(0))
    check(after_switch, trainer)
    assert [g.payload.token_ids for g in after_switch] == [g.payload.token_ids for g in after_load]
    # interrupt and resume: the resumed prompt + prefix shares cached blocks; the tokens stay the same
    whole = eng.generate(group(1))
    eng.start(group(1))
    eng.step_until(max_steps=3)
    parked = eng.interrupt()
    assert not parked[0].complete
    hits = eng.prefix_cached_tokens
    resumed = eng.generate([GroupRequest(1, prompt, 4, 16, resume=parked[0], ignore_eos=True)])
    assert eng.prefix_cached_tokens > hits
    assert resumed[0].payload.token_ids == whole[0].payload.token_ids
    check(resumed, trainer)


def test_a_kv_cache_below_one_sequence_is_refused_before_vllm_starts(model_dir):
    with pytest.raises(ValueError, match=r"holds 0 tokens .* fewer than one max_model_len=64 sequence"):
        RolloutEngine(model_dir, seed=0, max_model_len=64, kv_cache_gib=1e-5)


def test_vllm_has_the_sleep_and_wake_calls_the_gpu_switch_makes():
    """The GPU switch path (``tests/test_rollout_memory.py`` records its calls) against this vLLM's API: sleep
    levels up to 2, wake by tags ``weights`` / ``kv_cache``, a prefix-cache reset that says whether it worked."""
    import inspect

    from vllm import LLM
    from vllm.v1.executor.abstract import SLEEP_TAGS

    assert {"level", "mode"} <= set(inspect.signature(LLM.sleep).parameters)
    assert "Level 2" in LLM.sleep.__doc__ and "tags" in inspect.signature(LLM.wake_up).parameters
    assert set(SLEEP_TAGS) == {"weights", "kv_cache"}
    assert inspect.signature(LLM.reset_prefix_cache).return_annotation in (bool, "bool")


def test_short_grpo_loop_raises_the_mean_reward(fresh, model_dir):
    trainer = TrainerEngine(model_dir, lr=3e-4, seed=0, threads=1)
    history = run_grpo(fresh, trainer, TASK, steps=16, prompts_per_step=8, group_size=8, max_tokens=8,
                       chunk_size=16, prompt_pool=16)
    rewards = np.array([h.reward_mean for h in history])
    q = len(rewards) // 4
    first, last = rewards[:q].mean(), rewards[-q:].mean()
    assert last > first + 0.05, rewards.round(3).tolist()
    assert [h.version for h in history] == list(range(1, 17)) and fresh.version == 16
    assert all(h.samples == 64 for h in history)


# --------------------------------------------------------------------------------------------------
# a sharded gang over gloo: two FSDP2 ranks equal one process on the same samples
# --------------------------------------------------------------------------------------------------

def _dp_samples(model_dir):
    from bidirl.rl.tiny_model import load_tokenizer
    tok = load_tokenizer(model_dir)
    out = []
    for i, p in enumerate(TASK.prompts(8, start=700)):
        answer = p.answer if i % 3 else str(int(p.answer) + 1)
        out.append(Sample(i // 4, i % 4, tuple(tok(p.text)["input_ids"]),
                          tuple(tok(answer)["input_ids"] + [tok.eos_token_id]), (), float(i % 3 != 0), 0))
    return out


def _dp_worker(rank, world, addr, model_dir, out_dir):
    trainer = TrainerEngine(model_dir, lr=1e-3, seed=0, threads=1)
    join_gang(rank, world, addr)
    trainer.init_process_group(rank, world, addr)
    try:
        samples = _dp_samples(model_dir)
        adv = grpo.group_advantages([s.reward for s in samples], group_size=4).float()
        old = trainer.logprobs(samples)
        shard = slice(rank * 4, rank * 4 + 4)
        grad = trainer.chunk_gradients(samples[shard], adv[shard], old[shard])      # normaliser summed over the gang
        full = trainer.full_gradient(grad.flat)                                      # this rank's shard, gathered
        trainer.apply([grad])
        torch.save({"grad": full, "state": trainer.state_dict()}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        trainer.destroy_process_group()


def _dp1_reference(_rank, model_dir, path):
    """DP=1 accumulating the same two micro-batches, in a process of its own: in-process vLLM (earlier tests)
    binds torch's threads in the pytest process, after which the reference's reductions would split over other
    threads than the gang's (see tests/test_trainer_fsdp.py)."""
    samples = _dp_samples(model_dir)
    adv = grpo.group_advantages([s.reward for s in samples], group_size=4).float()
    ref = TrainerEngine(model_dir, lr=1e-3, seed=0, threads=1)
    old = ref.logprobs(samples)
    full = ref.chunk_gradients(samples, adv, old)
    norm = grpo.loss_normalizer([s.response_len for s in samples])
    parts = [ref.chunk_gradients(samples[a:a + 4], adv[a:a + 4], old[a:a + 4], normalizer=norm) for a in (0, 4)]
    ref.apply(parts)
    from bidirl.rl.model_folder import hf_name
    torch.save({"grad": full.flat, "state": ref.state_dict(), "max_grad_norm": ref.max_grad_norm,
                "params": [(hf_name(n), tuple(p.shape)) for n, p in ref.model.named_parameters()]}, path)


def test_dp2_over_gloo_matches_dp1(model_dir, tmp_path):
    import torch.multiprocessing as mp
    spawn_gang(_dp_worker, 2, str(model_dir), str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    mp.spawn(_dp1_reference, args=(str(model_dir), str(tmp_path / "ref.pt")), nprocs=1, join=True)
    ref = torch.load(tmp_path / "ref.pt")
    # the gradient: forward path, its transpose and the sum over the batch's tokens, each gang rank's half summed
    # once more (λ·u·(2·path + √tokens) relative to the largest term, both sides: tests/rounding.py)
    from bidirl.rl.model_folder import causal_lm_config
    cfg = causal_lm_config(model_dir, "model_dir")
    samples = _dp_samples(model_dir)
    tokens = sum(len(s.prompt_ids) + s.response_len for s in samples)
    seq = max(len(s.prompt_ids) + s.response_len for s in samples)
    grad_rho = rounding.ROUNDING_LAMBDA * rounding.FP32_UNIT_ROUNDOFF * (2 * rounding.logit_path(cfg, seq)
                                                                        + math.sqrt(tokens))
    atol = 2 * grad_rho * float(ref["grad"].abs().max())
    for r in ranks:
        torch.testing.assert_close(r["grad"], ref["grad"], atol=atol, rtol=0)
    assert ranks[1]["state"] == {}                 # the gathered weights go to rank 0 only
    # one AdamW step from the same weights and a fresh state, every weight within its own bound (none exempt):
    # the applied gradients differ by ≤ 2·atol per element (the gang's against DP=1's full gradient, and DP=1's
    # two micro-batches summed against its full one, the same split of the batch: ≤ atol each)
    bound, offset = {}, 0
    for name, shape in ref["params"]:
        n = math.prod(shape)
        g = ref["grad"][offset:offset + n]
        zero = torch.zeros(n)
        bound[name] = rounding.adamw_step_gap(g, torch.full((n,), 2 * atol, dtype=torch.float64), zero, zero, 1,
                                              ref["state"][name].reshape(-1), 1e-3,
                                              max_grad_norm=ref["max_grad_norm"]).view(shape)
        offset += n
    gap = rounding.same_step(ranks[0]["state"], ref["state"], bound)
    assert gap.ok and gap.compared == ref["grad"].numel(), str(gap)
    assert any(not torch.equal(ranks[0]["state"][k], v) for k, v in TrainerEngine(model_dir).state_dict().items())


# --------------------------------------------------------------------------------------------------
# Ray actor wrappers
# --------------------------------------------------------------------------------------------------

@needs_vllm
def test_ray_actor_wrappers_run_a_step_and_record_spans(model_dir, ray_session):
    ray = ray_session
    from bidirl.cluster.engines.workers.actors import Reply, RolloutActor, TrainerActor

    rollout = RolloutActor.remote("rollout_pool/rollouter/0", str(model_dir), seed=0, max_model_len=32,
                                  reward_fn=ArithmeticTask.reward)
    trainer = TrainerActor.remote("trainer_pool/trainer", str(model_dir), lr=3e-4)
    try:
        replies = ray.get([rollout.ready.remote(), trainer.ready.remote()], timeout=300)
        assert all(isinstance(r, Reply) for r in replies) and replies[1].value == "primary"
        spans = [s for r in replies for s in r.spans]

        from bidirl.rl.tiny_model import load_tokenizer
        reqs = requests_for(TASK, load_tokenizer(model_dir), 0, 4, 4, 8)
        started = ray.get(rollout.start.remote(reqs))
        assert started.value == 16
        groups = []
        for _ in range(50):
            if len(groups) == 4:
                break
            r = ray.get(rollout.step_until.remote(min_groups=1, max_seconds=5.0))
            groups += r.value
            spans += list(started.spans) + list(r.spans)
        samples = samples_from_groups(groups)
        old = ray.get(trainer.logprobs.remote(samples))
        assert _max_diff(samples, old.value) <= _logprob_tol(model_dir, TrainerEngine(model_dir).state_dict())
        adv = grpo.group_advantages([s.reward for s in samples], group_size=4).float()
        grad_ref, _ = trainer.chunk_gradient.remote(0, samples, adv, old.value, keep=True)
        grad = ray.get(grad_ref)
        assert grad.value["samples"] == len(samples)
        again, _ = trainer.chunk_gradient.remote(0, samples, adv, old.value, keep=True)
        with pytest.raises(ray.exceptions.RayTaskError, match="already accumulated"):
            ray.get(again)                  # a chunk accumulated twice would count twice: refused, nothing added
        upd = ray.get(trainer.apply_kept.remote([0]))
        assert upd.value["version"] == 1
        sync = ray.get(rollout.load_weights.remote(trainer.weights.remote(), 1))
        off, on = ray.get(rollout.offload.remote()), ray.get(rollout.onload.remote())
        t_off, t_on = ray.get(trainer.offload.remote()), ray.get(trainer.onload.remote())
        status = ray.get(rollout.status.remote())
        assert status["version"] == 1 and not status["busy"] and not status["offloaded"]
        for r in (old, grad, upd, sync, off, on, t_off, t_on):
            spans += list(r.spans)
        kinds = {s["kind"] for s in spans}
        assert {"start", "generate", "logprob", "chunk", "optimizer", "sync", "offload", "onload"} <= kinds
        for s in spans:
            assert s["worker"] in ("rollout_pool/rollouter/0", "trainer_pool/trainer")
            assert s["start"] <= s["end"]
    finally:
        for actor in (rollout, trainer):
            ray.kill(actor)
