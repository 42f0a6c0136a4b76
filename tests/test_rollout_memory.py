"""The rollouters' memory in engine runs (issue #24): the KV budget from the planner's memory model or the config,
the fit of both roles on one GPU, the start-up error for a budget that cannot hold one sequence, and the order of
vLLM's sleep / wake calls in a hot switch. Unit tests: no Ray, no vLLM engine (the GPU switch path runs against a
recorder of the calls it makes; ``tests/test_engines.py`` checks that vLLM's API has those calls)."""

from __future__ import annotations

import pytest

from bidirl.job import config as cfgmod
from bidirl.job import planner
from bidirl.perf import memory

GiB = 2 ** 30
QWEN3_4B = (36, 8, 128)         # layers, KV heads, head dim of Qwen3-4B's config.json: 147,456 bytes/token in bf16


def _budget(cfg, device="cuda", shape=QWEN3_4B, dtype_bytes=2, prompt=1024, windows=0):
    """The KV budget; ``windows=0``: a policy without Trainer-on-RolloutPool (rot-only), whose primary trainer keeps
    no auxiliary windows — under the bidirl policy the trainer's device budget refuses h100-default's 4B layout
    (``tests/test_device_budget.py``)."""
    return planner.rollout_kv_budget(planner.plan(cfg), device=device, kv_shape=shape, dtype_bytes=dtype_bytes,
                                     max_prompt_len=prompt, max_seqs=256, windows=windows)


def _fits_together(budget):
    """The colocation rule (bidirl.perf.memory): rollout weights + activation reserve + KV cache + the trainer rank
    beside it while it loads ≤ the usable memory of one GPU."""
    t = budget.terms
    return t["rollout_weights"] + t["activation_reserve"] + budget.bytes + t["trainer_beside"] <= t["usable"]


# --------------------------------------------------------------------------------------------------
# resolution: the config's value wins, the planner's otherwise, and both roles fit one GPU
# --------------------------------------------------------------------------------------------------

def test_the_planner_sizes_a_4b_rollouter_on_an_h100_beside_its_trainer():
    b = _budget(cfgmod.load("h100-default"))
    assert b.source == "planner" and b.bytes_per_token == 147456 and b.block_tokens == 16
    # the memory bounds it (256 sequences of 3,072 tokens would take 108 GiB): 68 GiB usable (80 GiB × 0.85)
    # less 8.9 GB of bf16 weights, the 0.97 GB prefill reserve and 17.8 GB of fp32 weights the trainer loads
    assert b.terms["concurrency_cap"] > b.terms["colocated_limit"]
    assert b.bytes == b.tokens * b.bytes_per_token == 45_411_729_408 and b.tokens == 307_968
    assert b.terms["colocated_limit"] - b.bytes < b.block_tokens * b.bytes_per_token      # whole blocks, rounded down
    assert _fits_together(b)


def test_the_tiny_cpu_rollouter_gets_what_its_sequences_can_fill():
    # tiny-cpu: at most ⌊(1 + s)·B_p⌋ = 32 groups of 4 in flight = 128 sequences, each one 128-token CPU block,
    # at 1,024 bytes per token (2 layers × 2 KV heads × 32 × 2 × fp32): 16 MiB, a quarter of the old fixed 64 MiB
    b = _budget(cfgmod.load("tiny-cpu"), device="cpu", shape=(2, 2, 32), dtype_bytes=4, prompt=8)
    assert b.source == "planner" and b.terms["sequences"] == 128
    assert (b.bytes, b.tokens, b.block_tokens, b.bytes_per_token) == (16 * 2 ** 20, 16384, 128, 1024)
    assert b.bytes == b.terms["concurrency_cap"] < b.terms["colocated_limit"] and _fits_together(b)


def test_a_configured_budget_wins_and_must_fit_beside_the_trainer():
    cfg = cfgmod.load("h100-default").with_overrides({"cluster.rollout_kv_cache_gib": 20})
    b = _budget(cfg)
    assert b.source == "config" and b.bytes == 20 * GiB and b.tokens == 20 * GiB // (16 * 147456) * 16
    assert _fits_together(b)
    too_big = cfg.with_overrides({"cluster.rollout_kv_cache_gib": 50})
    with pytest.raises(cfgmod.ConfigError, match="does not fit beside the trainer") as info:
        _budget(too_big)
    assert info.value.field == "cluster.rollout_kv_cache_gib" and "42.29" in info.value.fix


def test_the_colocation_rule_holds_for_every_shipped_model_and_gpu():
    """Every model × GPU preset either gets a budget both roles fit with, or is refused before any actor starts
    with the device-budget term that does not fit (a rot-only run: no auxiliary windows). The 4B model on a 48 GB
    A6000 misses by 0.05 GiB without its published versions; Qwen3-8B's micro-batch activations (10.4 GiB) do not fit
    beside its state on either card."""
    shapes = {"qwen3-vl-2b": (28, 8, 128), "qwen3-vl-4b": QWEN3_4B, "qwen3-8b": (36, 8, 128)}
    refused = {}
    for model, shape in shapes.items():
        for hardware in ("a6000", "h100"):
            cfg = cfgmod.load("h100-default").with_overrides({"model": model, "hardware": hardware})
            try:
                b = _budget(cfg, shape=shape)
            except planner.DeviceMemoryError as exc:
                assert exc.over_by > 0 and exc.term in str(exc) and exc.fix
                refused[(model, hardware)] = exc.term
                continue
            assert _fits_together(b) and b.tokens >= 3072, (model, hardware, b)
            # a trainer rank at work beside a switched-out (level-2 sleeping) rollouter fits as well
            assert planner.device_budget(planner.plan(cfg), device="cuda", windows=0).fits
    assert refused == {("qwen3-vl-4b", "a6000"): "published_versions", ("qwen3-8b", "a6000"): "activations",
                       ("qwen3-8b", "h100"): "published_versions"}


# --------------------------------------------------------------------------------------------------
# a budget that cannot hold one sequence fails at start, naming the numbers and the fix
# --------------------------------------------------------------------------------------------------

def test_the_old_fixed_budget_cannot_hold_one_4b_sequence():
    cfg = cfgmod.load("h100-default").with_overrides({"cluster.rollout_kv_cache_gib": 0.0625})
    with pytest.raises(cfgmod.ConfigError) as info:
        _budget(cfg, prompt=500)
    msg = str(info.value)
    assert info.value.field == "cluster.rollout_kv_cache_gib"
    # 0.0625 GiB / 147,456 bytes = 455 tokens, 448 in whole 16-token blocks; one sequence needs 2,548 → 2,560
    for part in ("holds 448 tokens", "147,456 bytes per token", "36 layers × 8 KV heads × 128", "blocks of 16",
                 "2,560 tokens one sequence takes", "prompt 500 + workload.max_response_len 2048"):
        assert part in msg, (part, msg)
    assert "at least 0.3516 GiB" in info.value.fix and "leave it empty" in info.value.fix


@pytest.fixture(scope="module")
def fresh_model(tmp_path_factory):
    """A freshly initialised tiny model folder (no warm start): enough to build a driver."""
    from bidirl.rl.tiny_model import create
    return str(create(tmp_path_factory.mktemp("tiny")))


def test_the_driver_refuses_a_budget_below_one_sequence_before_any_actor_starts(fresh_model):
    from bidirl.cluster.engines.driver import EngineDriver
    cfg = cfgmod.load("tiny-cpu").with_overrides({"cluster.rollout_kv_cache_gib": 1e-5})
    with pytest.raises(cfgmod.ConfigError) as info:
        EngineDriver(cfg, "bidirl", 1, 0, model_dir=fresh_model)       # no Ray: raised in __post_init__
    assert info.value.field == "cluster.rollout_kv_cache_gib"
    assert "holds 0 tokens" in str(info.value) and "one sequence" in str(info.value)
    assert "at least" in info.value.fix


def test_bidirl_run_sets_the_kv_budget_and_reports_a_bad_one_without_a_traceback(fresh_model, tmp_path, capsys):
    from bidirl.cli import main
    assert main(["run", "tiny-cpu", "--model-dir", fresh_model, "--kv-cache-gib", "1e-5",
                 "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "error: cluster.rollout_kv_cache_gib: a KV cache of 1e-05 GiB" in err and "Traceback" not in err
    assert not (tmp_path / "a").exists()


def test_the_driver_resolves_its_rollouters_settings_from_the_plan(fresh_model):
    import torch

    from bidirl.cluster.engines.driver import EngineDriver
    d = EngineDriver(cfgmod.load("tiny-cpu"), "bidirl", 1, 0, model_dir=fresh_model)
    r = d.rollout
    gpu = torch.cuda.is_available() and torch.cuda.device_count() >= 4
    assert r.device == ("cuda" if gpu else "cpu") and r.enforce_eager == (not gpu) and r.enable_prefix_caching
    assert r.tensor_parallel_size == d.plan.envelope.rollout_layout == 1 and r.max_model_len == d.max_model_len
    kw = r.engine_kwargs()
    assert int(kw["kv_cache_gib"] * GiB) == r.kv.bytes and r.shape()["kv_cache_bytes"] == r.kv.bytes
    assert r.summary()["kv_cache"]["tokens"] == r.kv.tokens > 0
    pinned = cfgmod.load("tiny-cpu").with_overrides({"cluster.rollout_kv_cache_gib": 0.03125})
    assert EngineDriver(pinned, "bidirl", 1, 0, model_dir=fresh_model).rollout.kv.bytes == 32 * 2 ** 20


def test_rollout_replicas_of_several_gpus_are_refused_with_the_reason(fresh_model):
    from bidirl.cluster.engines.rollout_setup import RolloutSetup
    # Qwen3-VL-2B in bf16 (4.3 GB) does not fit the 2 GiB a CPU slot offers: the planner splits a replica over 4
    cfg = cfgmod.load("tiny-cpu").with_overrides({"model": "qwen3-vl-2b", "hardware": "cpu", "cluster": {
        "gpus": 48, "gpus_per_node": 8, "placement": "any"}, "rl.micro_batch_per_device": 1})
    plan = planner.plan(cfg)
    assert plan.envelope.rollout_layout == 4
    with pytest.raises(cfgmod.ConfigError, match="cannot run") as info:
        RolloutSetup.resolve(plan, fresh_model, 8, gpu=False)
    assert info.value.field == "hardware" and "ρ_r = 1" in info.value.fix


def test_the_kv_budget_key_is_validated():
    with pytest.raises(cfgmod.ConfigError, match="must be > 0") as info:
        cfgmod.load("tiny-cpu").with_overrides({"cluster.rollout_kv_cache_gib": 0})
    assert info.value.field == "cluster.rollout_kv_cache_gib"
    with pytest.raises(cfgmod.ConfigError, match="expected a number"):
        cfgmod.load("tiny-cpu").with_overrides({"cluster.rollout_kv_cache_gib": "1G"})


# --------------------------------------------------------------------------------------------------
# the GPU switch path: the vLLM calls it makes, in order (vLLM 0.32's LLM.sleep / LLM.wake_up)
# --------------------------------------------------------------------------------------------------

class _Recorder:
    """Stands in for ``vllm.LLM`` and its ``LLMEngine``: records the calls of the engine's GPU branches."""

    def __init__(self):
        self.calls = []
        self.llm_engine = self

    def sleep(self, level=1, mode="abort"):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags) if tags else None))
        return True

    def collective_rpc(self, method, args=()):
        self.calls.append(("rpc", method.__name__))
        return [0]

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))
        return True


def _gpu_engine(model_dir):
    """A RolloutEngine's state as ``__init__`` leaves it on CUDA, around a recorder instead of vLLM."""
    from bidirl.cluster.engines.workers.rollout import RolloutEngine
    from bidirl.rl import model_folder as checkpoint

    eng = RolloutEngine.__new__(RolloutEngine)
    llm = _Recorder()
    config = checkpoint.causal_lm_config(model_dir)
    eng.__dict__.update(model_dir=checkpoint.model_folder(model_dir), tied=checkpoint.tied_embeddings(config),
                        checkpoint_shapes=checkpoint.checkpoint_shapes(model_dir), gpu=True, llm=llm, engine=llm,
                        version=0, _groups={}, _by_request={}, _host_weights=None, _offloaded=False,
                        _kv_released=False, _weights_stale=False, last_switch={})
    return eng, llm.calls


def test_a_gpu_switch_sleeps_at_level_2_and_wakes_weights_then_the_kv_cache(fresh_model):
    eng, calls = _gpu_engine(fresh_model)
    eng.offload()
    assert calls == [("sleep", 2)] and eng.offloaded and eng.last_switch["weights_discarded"]
    eng.onload(kv=False)                              # the switch-in's first phase: weights only
    assert calls[-1] == ("wake_up", ("weights",)) and eng.offloaded
    with pytest.raises(RuntimeError, match="offloaded"):
        eng.start([])
    eng.load_weights(None, version=3)                 # the current version (None: the checkpoint's weights)
    assert calls[-2:] == [("rpc", "_worker_reload"), ("reset_prefix_cache",)]
    eng.onload()                                      # then the KV cache, and no cached block survives
    assert calls[-2:] == [("wake_up", ("kv_cache",)), ("reset_prefix_cache",)]
    assert not eng.offloaded and eng.version == 3
    assert {"offload_seconds", "wake_weights_seconds", "wake_kv_seconds", "onload_seconds"} <= set(eng.last_switch)
    assert eng.start([]) == 0


def test_a_gpu_engine_woken_without_a_weight_load_refuses_to_generate(fresh_model):
    eng, calls = _gpu_engine(fresh_model)
    eng.offload()
    eng.onload()                                      # both phases at once (e.g. a kept worker's reset)
    assert calls[1:] == [("wake_up", ("weights",)), ("wake_up", ("kv_cache",)), ("reset_prefix_cache",)]
    with pytest.raises(RuntimeError, match="discarded"):
        eng.start([])
    eng.load_weights(None, version=0)
    assert eng.start([]) == 0
