"""The device budget of a trainer-pool GPU slot (``bidirl.perf.memory.DeviceBudget``, issue #38): each term against
what the engine really allocates, and for each term an engine run that fits only without it, refused before any
actor starts with the term named. Unit tests: no Ray (the driver raises while it resolves its settings)."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from bidirl.job import config as cfgmod
from bidirl.job import planner, presets
from bidirl.perf import memory

GiB = 2 ** 30
#: tiny-cpu with every term of the budget present on CPU: a reference model (kl_coef > 0), the collective weight
#: transport (published versions, buckets), the bidirl policy (an auxiliary window per step), a two-rank gang (FSDP2)
TINY_ALL_TERMS = {"rl.reference_model": True, "rl.kl_coef": 0.01, "rl.reproducible": True}
#: a one-rank gang (no FSDP2 on CPU) and one sample per micro-batch: the optimizer step peaks, not a chunk — where
#: the terms only ``apply`` holds can tip the budget
TINY_APPLY_PEAK = {**TINY_ALL_TERMS, "cluster.gpus": 2, "cluster.partition": {"rollout": 1, "trainer": 1},
                   "rl.micro_batch_per_device": 1}


@pytest.fixture(scope="module")
def fresh_model(tmp_path_factory):
    from bidirl.rl.tiny_model import create
    return str(create(tmp_path_factory.mktemp("tiny")))


# --------------------------------------------------------------------------------------------------
# each term mirrors the engine's allocations (CPU: the device is the host, bytes are storages' sizes)
# --------------------------------------------------------------------------------------------------

def test_the_terms_are_what_a_trainer_engine_holds(fresh_model):
    """A primary TrainerEngine on CPU (fp32, one rank) after a chunk, an optimizer step and two publishes: its
    weights, AdamW moments, gradient, published versions and host buffer are the budget's terms byte for byte (the
    tiny preset's params_total is the checkpoint's parameter count)."""
    import torch

    from bidirl.cluster.engines.workers.trainer import TrainerEngine
    from bidirl.rl import grpo
    from bidirl.rl.samples import Sample
    from bidirl.rl.tasks import ArithmeticTask
    from bidirl.rl.tiny_model import load_tokenizer

    cfg = cfgmod.load("tiny-cpu").with_overrides(TINY_ALL_TERMS)
    b = planner.device_budget(planner.plan(cfg), device="cpu", windows=1, layout=1)
    eng = TrainerEngine(fresh_model, lr=1e-3, device="cpu", threads=1, publish_dtype="float32")  # as the driver
    assert eng.numel == cfg.model_spec.params_total
    n = eng.numel
    weights = sum(p.untyped_storage().nbytes() for p in eng.params)
    assert weights == b.weights == 4 * n

    tok = load_tokenizer(fresh_model)
    samples = [Sample(i // 2, i % 2, tuple(tok(p.text)["input_ids"]), tuple(tok(p.answer)["input_ids"]), (),
                      float(i % 2), 0) for i, p in enumerate(ArithmeticTask(seed=3).prompts(4))]
    adv = grpo.group_advantages([s.reward for s in samples], group_size=2).float()
    old = eng.logprobs(samples)
    eng.chunk_gradients(samples, adv, old, accumulate=True, chunk_id=0)
    assert sum(p.grad.untyped_storage().nbytes() for p in eng.params) == b.gradients
    eng.apply()
    moments = sum(v.untyped_storage().nbytes() for st in eng.optimizer.state.values() for v in st.values()
                  if torch.is_tensor(v) and v.numel() > 1)
    assert moments == b.optimizer_state == 8 * n
    # the weight transport keeps the new version and the one before (WeightSync.snapshot_spec), fp32 on CPU
    one = eng.publish(1, "float32")
    eng.publish(2, "float32", keep=[1])
    assert sorted(eng.published) == [1, 2] and memory.PUBLISHED_KEPT == 2
    assert (memory.PUBLISHED_KEPT + memory.PUBLISHED_TRANSIENT) * one == b.published_versions
    # the host buffer a CPU engine keeps for its life: weights + moments (+ a mid-step gradient) and the two
    # published versions an offload moves beside them (this engine has no reference model)
    eng.chunk_gradients(samples, adv, old, accumulate=True, chunk_id=1)
    eng.offload()
    kept = memory.PUBLISHED_KEPT * one
    assert eng._host.nbytes == b.offload_buffer - b.reference == b.weights + b.optimizer_state + b.gradients + kept
    assert eng.host_capacity() == b.offload_buffer - b.reference
    eng.onload()
    # AdamW's single-tensor path holds two fp32 copies of one parameter at once; the largest is the embedding
    # or an MLP matrix (tiny: 384 × 128)
    largest = max(p.numel() for p in eng.params)
    assert b.optimizer_step == 2 * 4 * largest


def test_the_optimizer_step_on_cuda_holds_a_copy_of_every_second_moment():
    """On CUDA AdamW takes torch's multi-tensor path (its default for CUDA tensors and DTensors), whose
    ``_foreach_sqrt(exp_avg_sqs)`` allocates one fp32 copy of all the rank's second moments at once (4·N/ρ bytes);
    on CPU the single-tensor path's two copies of the largest parameter. The CUDA term was measured at 4B on an H200
    (benchmarks/trainer_scale.md): the single-tensor term left both optimizer steps 12.6 GiB under their peaks."""
    import torch

    cfg = cfgmod.load("h100-default")
    plan = planner.plan(cfg)
    m = cfg.model_spec
    for rho in (1, 2, 4):
        cuda = planner.device_budget(plan, device="cuda", windows=1, layout=rho)
        cpu = planner.device_budget(plan, device="cpu", windows=1, layout=rho)
        assert cuda.optimizer_step == 4 * m.params_total / rho
        assert cpu.optimizer_step == 2 * 4 * max(m.vocab * m.hidden, m.intermediate * m.hidden) / rho
    # the defaults the term follows: foreach for CUDA parameters, not for CPU ones
    from torch.optim.optimizer import _default_to_fused_or_foreach
    assert _default_to_fused_or_foreach([torch.zeros(2)], differentiable=False, use_fused=False) == (False, False)


def test_a_4b_rank_on_an_80_gb_card_names_the_terms_the_old_budget_left_out():
    """h100-default (Qwen3-VL-4B, ρ_t = 2 on 80 GiB H100s) fitted the planner's §4.1 model; the engines also keep
    three bf16 published versions (12.4 GiB), a window (8.3 GiB) and, at the step, the window's sum: the bidirl
    policy is refused, naming published versions first (transport.weights changes it) and a replica of 4 that fits."""
    plan = planner.plan(cfgmod.load("h100-default"))
    assert plan.memory["trainer"].fits and plan.envelope.trainer_layout == 2
    with pytest.raises(planner.DeviceMemoryError) as info:
        planner.check_device_budget(plan, device="cuda", windows=1)
    e = info.value
    # the optimizer step peaks: on CUDA it holds the foreach copy of the second moments (4·N/ρ, 8.3 GiB here)
    # beside the window's sum, more than a chunk's activations and FSDP2's unsharded blocks
    assert e.term == "published_versions" and e.field == "transport.weights" and e.phase == "apply"
    # over by 8.97 GiB: the window's shard alone (8.27 GiB) no longer makes it fit once the step's foreach copy counts
    assert set(e.terms) == {"published_versions", "optimizer_state"} and 8.9 * GiB < e.over_by < 9.0 * GiB
    assert "object_store" in e.fix and "a trainer replica of 4 GPUs would fit" in e.fix
    # without the windows (rot-only) it fits
    assert planner.check_device_budget(plan, device="cuda", windows=0).fits


# --------------------------------------------------------------------------------------------------
# per term: an engine run that fits only without it is refused before any actor starts, naming it
# --------------------------------------------------------------------------------------------------

#: a setting that removes (or shrinks) the term, where a job has one: the same run with it must start
SETTING_WITHOUT = {
    "reference": ({"rl.kl_coef": 0.0, "rl.reference_model": False}, "bidirl"),
    "window_shards": ({}, "rot-only"),
    "apply_sum": ({}, "rot-only"),
    "order_buffers": ({"rl.reproducible": False}, "bidirl"),
    "transport_buckets": ({"transport.bucket_mb": 0.25}, "bidirl"),
}


def _hardware_file(tmp_path, usable: float) -> str:
    """The cpu-calibrated preset with ``memory_bytes`` set so that ``memory_bytes · memory_utilization`` = usable."""
    src = presets.data_dir() / "presets" / "hardware" / "cpu-calibrated.yaml"
    spec = yaml.safe_load(src.read_text())
    spec["memory_bytes"] = int(usable / spec["memory_utilization"])
    path = tmp_path / f"cpu-{int(usable)}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def _tipping(term: str):
    """``(overrides, usable)``: a tiny-cpu variant and a usable memory between what its budget needs without
    ``term`` and what it needs with it (the term must be the one that tips it), and no less than one rollout replica
    of one GPU needs (else the planner would split the rollouter over GPUs, which an engine run refuses first)."""
    for overrides in (TINY_ALL_TERMS, TINY_APPLY_PEAK):
        cfg = cfgmod.load("tiny-cpu").with_overrides(overrides)
        b = planner.device_budget(planner.plan(cfg), device="cpu", windows=1)
        value = getattr(b, term)
        assert value > 0, (term, overrides)
        without = max(held - (value if term in memory.BUDGET_PHASES[p] else 0.0)
                      for p, held in b.phase_bytes().items())
        w = cfg.workload
        rollout = memory.rollout_need(cfg.model_spec, cfg.hardware_spec, 1, w.group_size,
                                      cfg.workload_stats.prompt_max + w.max_response_len)
        lower = max(without, rollout.total)
        if lower < b.peak:
            return overrides, (lower + b.peak) / 2
    raise AssertionError(f"no tiny-cpu variant where {term} tips the budget")


@pytest.mark.parametrize("term", memory.BUDGET_TERMS)
def test_a_run_that_fits_only_without_a_term_is_refused_before_any_actor_starts(term, fresh_model, tmp_path):
    from bidirl.cluster.engines.driver import EngineDriver

    overrides, usable = _tipping(term)
    cfg = cfgmod.load("tiny-cpu").with_overrides({**overrides, "hardware": _hardware_file(tmp_path, usable)})
    with pytest.raises(planner.DeviceMemoryError) as info:
        EngineDriver(cfg, "bidirl", 1, 0, model_dir=fresh_model)          # no Ray: raised in __post_init__
    e = info.value
    assert term in e.terms and f"{term} (" in str(e), str(e)
    assert 0 < e.over_by <= getattr(e.budget, term) and e.fix and e.field
    if term in SETTING_WITHOUT:                         # the job's own setting for the term: the same card runs it
        setting, policy = SETTING_WITHOUT[term]
        d = EngineDriver(cfg.with_overrides(setting), policy, 1, 0, model_dir=fresh_model)
        assert d.rollout.kv.tokens > 0


def test_bidirl_run_reports_the_term_without_a_traceback(fresh_model, tmp_path, capsys):
    from bidirl.cli import main

    overrides, usable = _tipping("published_versions")
    cfg = cfgmod.load("tiny-cpu").with_overrides({**overrides, "hardware": _hardware_file(tmp_path, usable)})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    assert main(["run", str(path), "--model-dir", fresh_model, "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "published_versions (" in err and "does not fit" in err and "Traceback" not in err
    assert not (tmp_path / "a").exists()


def test_the_budget_takes_the_largest_phase_and_names_only_terms_that_would_each_fit():
    model = cfgmod.load("h100-default").model_spec
    hw = dataclasses.replace(presets.hardware("h100"), memory_bytes=200 * GiB)
    b = memory.device_budget(model, hw, 2, micro_batch_per_device=1, max_seq_len=1024, windows=2)
    held = b.phase_bytes()
    assert b.peak == max(held.values()) and held["apply"] > held["chunk"] and b.fits and b.blocking_terms() == []
    tight = dataclasses.replace(b, usable=held["apply"] - 1)
    # one byte short at the step: any term the step holds would do; the chunk's own terms would not
    assert set(tight.blocking_terms()) == {t for t in memory.BUDGET_PHASES["apply"] if getattr(b, t) > 0}
    assert "activations" not in tight.blocking_terms()
    assert set(planner._TERM_FIXES) == set(memory.BUDGET_TERMS)          # every term has its fix
    with pytest.raises(ValueError, match="windows"):
        memory.device_budget(model, hw, 2, micro_batch_per_device=1, max_seq_len=1024, windows=-1)


# --------------------------------------------------------------------------------------------------
# invariants over random shapes, layouts and settings
# --------------------------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 64), hidden=st.sampled_from([64, 256, 1024, 4096]), vocab=st.integers(32, 200_000),
       tied=st.booleans(), rho=st.sampled_from([1, 2, 4, 8]), windows=st.integers(0, 3),
       device=st.sampled_from(["cuda", "cpu"]), transport=st.sampled_from(["collective", "object_store"]),
       kl=st.sampled_from([0.0, 0.01]), micro=st.integers(1, 8), usable_gib=st.floats(0.5, 200))
def test_budget_invariants(layers, hidden, vocab, tied, rho, windows, device, transport, kl, micro, usable_gib):
    """More GPUs per replica never need more per GPU; more windows never less; the named terms are exactly those
    whose removal alone makes every phase fit."""
    base = presets.model("tiny")
    params = layers * 12 * hidden * hidden + vocab * hidden * (1 if tied else 2)
    model = dataclasses.replace(base, layers=layers, hidden=hidden, intermediate=4 * hidden, vocab=vocab,
                                tie_word_embeddings=tied, params_total=float(params), dtype_bytes=2)
    hw = dataclasses.replace(presets.hardware("h100"), memory_bytes=usable_gib * GiB / 0.85)
    kw = dict(micro_batch_per_device=micro, max_seq_len=512, device=device, kl_coef=kl, weights_transport=transport,
              gang_ranks=8)
    b = memory.device_budget(model, hw, rho, windows=windows, **kw)
    if rho < 8:
        assert memory.device_budget(model, hw, 2 * rho, windows=windows, **kw).peak <= b.peak * (1 + 1e-12)
    assert memory.device_budget(model, hw, rho, windows=windows + 1, **kw).peak >= b.peak
    assert b.fits == (b.peak <= b.usable) and b.peak == max(b.phase_bytes().values())
    named = set(b.blocking_terms())
    for term in memory.BUDGET_TERMS:
        without = dataclasses.replace(b, **{term: 0.0})
        assert (not b.fits and getattr(b, term) > 0 and without.fits) == (term in named), term
