"""Shipped presets (``data/presets``) load, cite their sources, and give the numbers the stage-time models use."""

from __future__ import annotations


import pytest

from bidirl.job import presets
from bidirl.job.config import SwitchCosts

KINDS = {"models": presets.model, "hardware": presets.hardware, "workloads": presets.workload}
SHIPPED = [(kind, name) for kind in KINDS for name in presets.names(kind)]


def test_every_kind_ships_presets():
    for kind in KINDS:
        assert presets.names(kind), f"no {kind} presets under {presets.data_dir() / 'presets' / kind}"
    assert {"qwen3-vl-2b", "qwen3-vl-4b", "tiny"} <= set(presets.names("models"))
    assert {"a6000", "h100", "cpu"} <= set(presets.names("hardware"))
    assert {"geo3k", "arithmetic"} <= set(presets.names("workloads"))


@pytest.mark.parametrize("kind, name", SHIPPED)
def test_every_shipped_preset_loads_and_cites_sources(kind, name):
    spec = KINDS[kind](name)
    assert spec.name == name
    assert isinstance(spec.sources, tuple) and spec.sources, f"{kind}/{name} has no sources"
    assert all(isinstance(s, str) and s.strip() for s in spec.sources)


@pytest.mark.parametrize("name", presets.names("models"))
def test_model_numbers_are_consistent(name):
    m = presets.model(name)
    assert m.heads % m.kv_heads == 0, "query heads must be a multiple of KV heads (GQA)"
    assert 0 < m.params_nonembedding < m.params_total
    assert m.weight_bytes == m.params_total * m.dtype_bytes


def test_kv_bytes_per_token_qwen3_vl_4b():
    # 2 (K and V) · 36 layers · 8 KV heads · 128 head dim · 2 bytes = 144 KiB
    assert presets.model("qwen3-vl-4b").kv_bytes_per_token() == 147456 == 144 * 1024


def test_kv_bytes_per_token_qwen3_vl_2b():
    # 2 · 28 layers · 8 KV heads · 128 head dim · 2 bytes = 112 KiB
    assert presets.model("qwen3-vl-2b").kv_bytes_per_token() == 114688 == 112 * 1024


def test_kv_bytes_per_token_splits_across_tensor_parallel_ranks():
    m = presets.model("qwen3-vl-4b")
    assert m.kv_bytes_per_token(tp=2) == m.kv_bytes_per_token() / 2


@pytest.mark.parametrize("name", presets.names("hardware"))
def test_hardware_numbers_are_physical(name):
    h = presets.hardware(name)
    for key in ("memory_bytes", "peak_flops", "memory_bandwidth", "intra_node_bandwidth",
                "inter_node_bandwidth", "host_bandwidth"):
        assert getattr(h, key) > 0, key
    for key in ("train_mfu", "decode_mbu", "prefill_mfu", "memory_utilization"):
        assert 0 < getattr(h, key) <= 1, key
    assert h.gpus_per_node >= 1


def test_a6000_switch_costs_are_the_papers_table_3():
    h, m = presets.hardware("a6000"), presets.model("qwen3-vl-4b")
    assert h.switch_costs("trainer_on_rollout_pool", m) == SwitchCosts(6.16, 5.62, 1.21)
    assert h.switch_costs("rollout_on_trainer_pool", m) == SwitchCosts(7.70, 5.59, 0.0)


@pytest.mark.parametrize("name", presets.names("workloads"))
def test_workload_statistics_are_sane(name):
    w = presets.workload(name)
    assert 0 < w.prompt_min <= w.prompt_mean <= w.prompt_max
    assert w.prompt_std >= 0
    assert 0 < w.response_mean_fraction <= 1
    assert w.response_cv >= 0 and w.step_noise >= 0


@pytest.mark.parametrize("kind, getter, typo, suggestion", [
    ("model", presets.model, "qwen3-vl-4", "qwen3-vl-4b"),
    ("hardware", presets.hardware, "h10", "h100"),
    ("workload", presets.workload, "geo3", "geo3k"),
])
def test_unknown_preset_suggests_close_match(kind, getter, typo, suggestion):
    with pytest.raises(presets.PresetError) as info:
        getter(typo)
    assert f"unknown {kind} preset" in str(info.value)
    assert info.value.fix == f"did you mean '{suggestion}'?"


def test_unknown_preset_without_close_match_lists_the_presets():
    with pytest.raises(presets.PresetError) as info:
        presets.hardware("zzzzzz")
    assert "a6000" in info.value.fix and "h100" in info.value.fix


def test_example_configs_are_found_by_name():
    assert {"a6000-default", "h100-default", "tiny-cpu"} <= set(presets.example_configs())
    assert presets.example_config_path("tiny-cpu").name == "tiny-cpu.yaml"
    assert presets.example_config_path("no-such-config") is None


# --------------------------------------------------------------------------------------------------
# user presets through BIDIRL_DATA
# --------------------------------------------------------------------------------------------------

def test_user_preset_via_bidirl_data(user_data):
    text = (user_data / "presets" / "models" / "qwen3-vl-4b.yaml").read_text()
    (user_data / "presets" / "models" / "my-model.yaml").write_text(text.replace("layers: 36", "layers: 12"))
    m = presets.model("my-model")
    assert m.name == "my-model" and m.layers == 12
    assert m.kv_bytes_per_token() == 147456 / 3


def test_preset_with_unknown_key_is_rejected(user_data):
    path = user_data / "presets" / "workloads" / "broken.yaml"
    path.write_text((user_data / "presets" / "workloads" / "geo3k.yaml").read_text() + "prompt_meen: 3\n")
    with pytest.raises(presets.PresetError) as info:
        presets.workload("broken")
    assert "prompt_meen" in str(info.value) and "prompt_mean" in info.value.fix


def test_preset_with_non_numeric_value_is_rejected(user_data):
    path = user_data / "presets" / "models" / "broken.yaml"
    text = (user_data / "presets" / "models" / "qwen3-vl-4b.yaml").read_text()
    path.write_text(text.replace("layers: 36", "layers: many"))
    with pytest.raises(presets.PresetError) as info:
        presets.model("broken")
    assert "layers must be a number" in str(info.value) and info.value.fix


def test_preset_missing_a_key_is_rejected(user_data):
    path = user_data / "presets" / "models" / "broken.yaml"
    text = (user_data / "presets" / "models" / "qwen3-vl-4b.yaml").read_text()
    path.write_text("\n".join(line for line in text.splitlines() if not line.startswith("vocab:")))
    with pytest.raises(presets.PresetError) as info:
        presets.model("broken")
    assert "vocab" in str(info.value) and info.value.fix
