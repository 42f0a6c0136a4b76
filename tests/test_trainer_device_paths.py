"""The trainer's device-resident paths (issue #23) on the unsharded CPU engine: gradients accumulated into
``p.grad`` and stepped there, the LM head on response positions only in chunks, activation checkpointing, the
offload host buffer allocated once, the reference loaded at start. (The sharded gang runs the same code under
``tests/test_trainer_fsdp.py``.)

Tolerances (fp32, u = 2**-24), derived from the arithmetic, never from one machine's output:
- accumulate vs sum-of-vectors: the same chunk gradients, summed in another order or grouping. Per element,
  |Δ| ≤ (k − 1)·u·Σ|g_i| for k chunks; with k = 2 and |g_i| ≤ G = max |gradient entry| this is ≤ 2u·G per element,
  so we bound it by 4u·G (one more rounding for the copy into ``p.grad``). After one AdamW step the weights differ
  by at most lr·|Δm̂/√v̂| where the first step's m̂/√v̂ = g/|g| (Kingma & Ba §2.1): a relative gradient change of
  δ moves a weight by ≤ lr·δ·|g|/(|g| + ε)… ≤ 2·lr for the few entries whose gradient is ≈ 0 (sign flips); every
  other weight by ≤ lr·4u·G/|g|, so we compare the gradients themselves, where the bound is sharp.
- chunked response-only head vs the plain full-logits head: the same inner products, blocked differently. An
  fp32 inner product of length n has error ≤ λ·√n·u·Σ|x_i·y_i| (Higham & Mary 2019, λ = 6: probability of
  exceeding ≤ 2·exp(−18)); a logit of magnitude ≤ Z therefore moves by ≤ λ·√H·u·Z·c where c bounds
  Σ|x_i·y_i| / max(|Σ x_i·y_i|, 1) (the condition of the head's inner products, measured on the model's own
  hidden states and head by ``_head_bound``); the log-prob z_y − logsumexp(z) by twice that, plus logsumexp's own
  sum over V (λ·√V·u). The gradient is bounded the same way, relative to its largest entry, with a factor 4 for
  the forward, its transpose and the two extra roundings of the checkpointed recomputation.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bidirl.rl import grpo
from bidirl.rl.samples import Sample
from bidirl.rl.tasks import ArithmeticTask

U = 2.0 ** -24
LAMBDA = 6.0


def _samples(model_dir, n=8):
    from bidirl.rl.tiny_model import load_tokenizer
    tok = load_tokenizer(model_dir)
    rng = np.random.default_rng(0)
    out = []
    for i, p in enumerate(ArithmeticTask(seed=3).prompts(n)):
        answer = p.answer if i % 2 == 0 else str(int(p.answer) + 1)
        resp = tok(answer)["input_ids"] + ([tok.eos_token_id] if rng.random() < 0.7 else [])
        out.append(Sample(i // 2, i % 2, tuple(tok(p.text)["input_ids"]), tuple(resp), (), float(i % 2 == 0), 0))
    return out


def _engine(model_dir, **kw):
    from bidirl.cluster.engines.workers.trainer import TrainerEngine
    return TrainerEngine(model_dir, lr=1e-3, seed=0, threads=1, **kw)


def _grads(engine) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in engine.params])


def test_accumulated_chunks_step_like_the_summed_vectors(model_dir):
    samples = _samples(model_dir)
    adv = grpo.group_advantages([s.reward for s in samples], group_size=2).float()
    norm = grpo.loss_normalizer([s.response_len for s in samples])
    a, b = _engine(model_dir), _engine(model_dir)
    old = a.logprobs(samples)
    cuts = ((0, 3), (3, 8))
    vectors = [a.chunk_gradients(samples[x:y], adv[x:y], old[x:y], normalizer=norm) for x, y in cuts]
    kept = [b.chunk_gradients(samples[x:y], adv[x:y], old[x:y], normalizer=norm, accumulate=True, chunk_id=c)
            for c, (x, y) in enumerate(reversed(cuts))]           # accumulated in the other order
    assert all(g.flat is None for g in kept) and b.accumulated == [0, 1]
    assert all(p.grad is not None and p.grad.device == b.device for p in b.params)
    # a vector chunk computed meanwhile leaves the accumulated gradient as it was
    before = _grads(b).clone()
    side = b.chunk_gradients(samples[:3], adv[:3], old[:3], normalizer=norm)
    assert torch.equal(_grads(b), before) and b.accumulated == [0, 1]
    torch.testing.assert_close(side.flat, vectors[0].flat, atol=0, rtol=0)
    g_max = float(max(v.flat.abs().max() for v in vectors))
    torch.testing.assert_close(before, vectors[0].flat + vectors[1].flat, atol=4 * U * g_max, rtol=0)
    out_a, out_b = a.apply(vectors), b.apply(kept)
    assert out_b["chunks"] == 2 == out_a["chunks"] and b.accumulated == []
    assert out_b["grad_norm"] == pytest.approx(out_a["grad_norm"], rel=4 * U * math.sqrt(a.numel))
    assert all(p.grad is None for p in b.params)
    # a mix: one chunk accumulated, one given as a vector (an auxiliary gang's, received)
    c = _engine(model_dir)
    c.chunk_gradients(samples[0:3], adv[0:3], old[0:3], normalizer=norm, accumulate=True, chunk_id=0)
    out_c = c.apply([vectors[1].flat])
    assert out_c["chunks"] == 2
    assert out_c["grad_norm"] == pytest.approx(out_a["grad_norm"], rel=4 * U * math.sqrt(a.numel))
    with pytest.raises(ValueError, match="no chunk gradients"):
        c.apply()


def test_discarded_gradients_do_not_reach_the_next_step(model_dir):
    samples = _samples(model_dir, 4)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    e = _engine(model_dir)
    old = e.logprobs(samples)
    e.chunk_gradients(samples, adv, old, accumulate=True, chunk_id=7)
    assert e.discard_gradients() == 1 and e.accumulated == [] and all(p.grad is None for p in e.params)


def _plain_logprobs(model, samples) -> list:
    """The plain path: full-vocabulary logits at every position of each sample alone, fp32 log_softmax."""
    out = []
    for s in samples:
        ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids)])
        logits = model(input_ids=ids, use_cache=False).logits.float()[0]
        p = len(s.prompt_ids)
        lp = torch.log_softmax(logits[p - 1:p - 1 + s.response_len], -1)
        out.append(lp.gather(-1, torch.tensor(s.response_ids)[:, None]).squeeze(-1))
    return out


def _head_bound(engine, samples) -> float:
    """λ·u·(c·(√H + 1)·Z + √V)·2 for this model (module docstring), with Z the largest |logit| and c measured."""
    cfg = engine.config
    z, ratio = 0.0, 1.0
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids)])
            h = engine.model.get_decoder()(input_ids=ids).last_hidden_state[0]
            w = engine.model.get_output_embeddings().weight
            logits = h @ w.T
            z = max(z, float(logits.abs().max()))
            ratio = max(ratio, float(((h.abs() @ w.abs().T) / logits.abs().clamp_min(1.0)).max()))
    assert ratio <= 64, "the head's inner products cancel more than the bound assumes"
    return 2 * LAMBDA * U * (ratio * (math.sqrt(cfg.hidden_size) + 1) * max(z, 1.0) + math.sqrt(cfg.vocab_size))


@pytest.mark.parametrize("chunk", [1, 5, 512])
def test_response_only_chunked_head_matches_the_full_logits(model_dir, chunk):
    samples = _samples(model_dir)
    e = _engine(model_dir, logprob_chunk=chunk)
    tol = _head_bound(e, samples)
    got = e.logprobs(samples)
    with torch.no_grad():
        want = _plain_logprobs(e.model, samples)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=tol, rtol=0)


def test_head_chunks_and_activation_checkpointing_leave_the_gradient(model_dir):
    samples = _samples(model_dir)
    adv = grpo.group_advantages([s.reward for s in samples], group_size=2).float()
    ref = _engine(model_dir, logprob_chunk=512)
    old = ref.logprobs(samples)
    want = ref.chunk_gradients(samples, adv, old).flat
    tol = _head_bound(ref, samples) * float(want.abs().max()) * 4   # the log-prob bound, relative, fwd + bwd
    for kw in ({"logprob_chunk": 3}, {"activation_checkpointing": True}):
        e = _engine(model_dir, **kw)
        assert e.activation_checkpointing == kw.get("activation_checkpointing", False)
        got = e.chunk_gradients(samples, adv, old).flat
        torch.testing.assert_close(got, want, atol=tol, rtol=0)


def test_bad_trainer_settings_name_the_field(model_dir):
    with pytest.raises(ValueError, match="logprob_chunk"):
        _engine(model_dir, logprob_chunk=0)
    with pytest.raises(ValueError, match="activation_checkpointing"):
        _engine(model_dir, activation_checkpointing="yes")


def test_offload_reuses_one_host_buffer_and_keeps_accumulated_gradients(model_dir):
    samples = _samples(model_dir, 4)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    e = _engine(model_dir)
    old = e.logprobs(samples)
    e.apply([e.chunk_gradients(samples, adv, old)])                 # AdamW state exists from here on
    e.chunk_gradients(samples, adv, old, accumulate=True, chunk_id=0)
    weights = {k: v.clone() for k, v in e.model.state_dict().items()}
    grads = _grads(e).clone()
    moments = [v.clone() for st in e.optimizer.state.values() for v in st.values() if v.numel() > 1]
    for _ in range(3):
        assert e.offload() > 0 and e.offloaded and e.resident_bytes() == 0
        with pytest.raises(RuntimeError, match="onload"):
            e.logprobs(samples)
        e.onload()
    assert e.host_buffer_allocations == 1, "one buffer for every switch, not one per switch"
    assert all(torch.equal(v, weights[k]) for k, v in e.model.state_dict().items())
    assert torch.equal(_grads(e), grads) and e.accumulated == [0]
    assert all(torch.equal(a, b) for a, b in zip(moments, [v for st in e.optimizer.state.values()
                                                          for v in st.values() if v.numel() > 1]))


def test_a_gang_restored_from_its_recovery_snapshot_switches_out_and_back(model_dir, tmp_path):
    """A restarted primary rank loads its snapshot (``torch.load`` from disk) and may be lent at once: its state
    must be freeable in place like a fresh engine's (the chaos run at s = 0 stopped on "Trying to resize storage
    that is not resizable" when a rank restored from a snapshot switched out)."""
    samples = _samples(model_dir, 4)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    e = _engine(model_dir)
    e.apply([e.chunk_gradients(samples, adv, e.logprobs(samples))])    # AdamW moments exist: the snapshot holds them
    e.save_snapshot(tmp_path, e.version)
    assert e.flush_snapshot()["version"] == 1
    restored = _engine(model_dir)
    restored.load_snapshot(tmp_path, 1)
    moments = [v.clone() for st in restored.optimizer.state.values() for v in st.values() if v.numel() > 1]
    assert moments and restored.offload() > 0 and restored.resident_bytes() == 0
    restored.onload()
    # bytes copied out and back: exactly equal, and equal to the state that was saved
    assert all(torch.equal(a, b) for a, b in zip(moments, [v for st in restored.optimizer.state.values()
                                                          for v in st.values() if v.numel() > 1]))
    assert all(torch.equal(v, e.model.state_dict()[k]) for k, v in restored.model.state_dict().items())


def test_state_whose_storage_cannot_be_freed_in_place_is_refused_before_anything_moves(tmp_path):
    from bidirl.cluster.engines.workers.host_buffer import HostStash

    torch.save({"t": torch.ones(8)}, tmp_path / "t.pt")
    fixed = torch.load(tmp_path / "t.pt")["t"]                          # storage owned by the file reader
    ours = torch.zeros(8)
    stash = HostStash()
    with pytest.raises(RuntimeError, match="cannot be resized.*clone"):
        stash.offload([ours, fixed])
    assert not stash.holding and ours.untyped_storage().nbytes() == 32   # nothing was freed
def test_reference_is_loaded_at_start_when_the_kl_term_needs_it(model_dir):
    e = _engine(model_dir, kl_coef=0.1)
    assert e._reference is not None and all(not p.requires_grad for p in e._reference.parameters())
    assert _engine(model_dir)._reference is None


def _moments(e) -> list:
    return [v for st in e.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.numel() > 1]


def _published(e) -> dict:
    return {v: {k: t.clone() for k, (t, _) in shards.items()} for v, shards in e.published.items()}


def test_published_versions_switch_out_and_back_through_the_one_host_buffer(model_dir):
    """publish → offload → onload → publish → chunk → apply, on one engine and through the code a GPU runs (the
    published shards go through the same host buffer as the state, issue 38): the weights, the AdamW state and the
    published versions come back bit for bit, the step after the switches equals a twin's that never switched, and
    the host buffer was allocated once over two switches (the first one included: it was reserved at load)."""
    samples = _samples(model_dir, 4)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    a, b = _engine(model_dir, publish_dtype="float32"), _engine(model_dir, publish_dtype="float32")
    old = a.logprobs(samples)
    for e in (a, b):
        e.apply([e.chunk_gradients(samples, adv, old)])            # AdamW moments exist from here on
        e.publish(e.version, "float32")
    for switch in range(2):
        weights = {k: v.clone() for k, v in a.model.state_dict().items()}
        moments = [v.clone() for v in _moments(a)]
        published = _published(a)
        assert a.offload() > 0 and a.offloaded and a.resident_bytes() == 0
        # while offloaded the published shards are readable host copies (what a send reads during the switch)
        buf = a._host.buffer
        lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
        assert a.published.keys() == published.keys()
        assert all(lo <= t.data_ptr() < hi for s in a.published.values() for t, _ in s.values()), \
            "the published shards sit in the engine's host buffer while it is offloaded"
        assert all(torch.equal(t, published[v][k]) for v, s in a.published.items() for k, (t, _) in s.items())
        a.onload()
        assert all(torch.equal(v, weights[k]) for k, v in a.model.state_dict().items())
        assert all(torch.equal(x, y) for x, y in zip(_moments(a), moments))
        assert _published(a).keys() == published.keys()
        assert all(torch.equal(t, published[v][k]) for v, s in _published(a).items() for k, t in s.items())
        if switch == 0:
            for e in (a, b):
                e.publish(e.version + 1, "float32", keep=[e.version])  # a second version beside the first
    assert a.host_buffer_allocations == 1, "one host buffer, reserved at load, for every switch"
    for e in (a, b):
        e.apply([e.chunk_gradients(samples, adv, e.logprobs(samples))])
    assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()))
    assert all(torch.equal(x, y) for x, y in zip(_moments(a), _moments(b)))


def test_the_host_buffer_is_reserved_for_the_largest_state_at_load(model_dir):
    """The capacity counts what an offload moves at most: weights, gradients, both AdamW moments and two published
    versions; an offload with all of them present fits without a second allocation (the test above), and one
    more published version than that is refused by name instead of growing the buffer."""
    e = _engine(model_dir, publish_dtype="float32")
    e._host._wait_reserved()
    assert e.host_buffer_allocations == 1 and e._host.buffer.numel() == e.host_capacity()
    param_bytes = sum(p.numel() * 4 for p in e.params)
    assert e.host_capacity() >= 4 * param_bytes + 2 * param_bytes      # state ×4, two published versions
    with pytest.raises(ValueError, match="at most 2 versions"):
        e.publish(3, "float32", keep=[1, 2])


def test_the_snapshot_copy_runs_beside_the_next_chunk_and_holds_the_state_it_was_taken_from(model_dir, tmp_path):
    """save_snapshot starts the copy and returns; a chunk runs meanwhile; apply waits for the copy before it changes
    the weights, so the file holds the version the snapshot named, bit for bit, and not the one apply made."""
    samples = _samples(model_dir, 4)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    e = _engine(model_dir)
    e.apply([e.chunk_gradients(samples, adv, e.logprobs(samples))])
    weights = {k: v.clone() for k, v in e.model.state_dict().items()}
    moments = [v.clone() for v in _moments(e)]
    e.save_snapshot(tmp_path, 1)
    e.chunk_gradients(samples, adv, e.logprobs(samples), accumulate=True, chunk_id=0)
    e.apply()
    assert "apply" in e.snapshot_waits and e.version == 2
    assert e.flush_snapshot()["version"] == 1
    restored = _engine(model_dir)
    restored.load_snapshot(tmp_path, 1)
    assert restored.version == 1
    assert all(torch.equal(v, weights[k]) for k, v in restored.model.state_dict().items())
    assert all(torch.equal(x, y) for x, y in zip(_moments(restored), moments))
    # the copy went into the hot switch's host buffer, reserved once at load: no buffer of its own; only AdamW's
    # one-element step counters (outside the staged storages) were cloned
    steps = sum(v.numel() * v.element_size() for st in e.optimizer.state.values() for v in st.values()
                if torch.is_tensor(v) and v.numel() == 1)
    assert e.host_buffer_allocations == 1 and e._state_copy.cloned_bytes == steps


def test_an_offload_after_a_snapshot_copies_only_what_changed_since_and_the_snapshot_stays_whole(model_dir, tmp_path):
    """The snapshot's copy is the offload's: the weights and moments already sit in the host buffer where an offload
    puts them, so the switch copies the gradient and the published version only, and the snapshot written beside
    the switch holds the state it was taken from. After an optimizer step the next offload copies everything again
    (and first waits for a write still reading the buffer)."""
    samples = _samples(model_dir, 4)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    e = _engine(model_dir, publish_dtype="float32")
    e.apply([e.chunk_gradients(samples, adv, e.logprobs(samples))])
    e.publish(e.version, "float32")
    weights = {k: v.clone() for k, v in e.model.state_dict().items()}
    moments = [v.clone() for v in _moments(e)]
    stable = sum(t.untyped_storage().nbytes() for t in e._stable_tensors())
    e.save_snapshot(tmp_path, 1)
    e.chunk_gradients(samples, adv, e.logprobs(samples), accumulate=True, chunk_id=0)
    grad = sum(p.grad.untyped_storage().nbytes() for p in e.params)
    published = sum(t.numel() * t.element_size() for t, _ in e.published[1].values())
    e.offload()
    assert e._host.copied_bytes == grad + published, "weights and moments were staged by the snapshot's copy"
    e.onload()
    e.offload()                                   # no step since: the stable state is still in the buffer
    assert e._host.copied_bytes == grad + published
    e.onload()
    assert all(torch.equal(v, weights[k]) for k, v in e.model.state_dict().items())
    assert all(torch.equal(x, y) for x, y in zip(_moments(e), moments))
    e.apply()                                     # the weights and moments change: the buffer's copy is stale
    e.offload()
    assert e._host.copied_bytes == e._host.nbytes and e._host.copied_bytes > stable
    assert "offload_write" in e.snapshot_waits
    e.onload()
    assert e.flush_snapshot() == {}              # the offload above waited for the write
    assert e.host_buffer_allocations == 1
    restored = _engine(model_dir)
    restored.load_snapshot(tmp_path, 1)
    assert all(torch.equal(v, weights[k]) for k, v in restored.model.state_dict().items())
    assert all(torch.equal(x, y) for x, y in zip(_moments(restored), moments))
