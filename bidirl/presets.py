"""Hardware, model and workload presets, read from ``data/presets/<kind>/<name>.yaml``.

Each preset file carries its numbers together with a ``sources`` list saying where each number comes
from (a vendor table, a model's published config, a public training log) or how it was derived.
Users add their own presets by dropping a YAML file next to the shipped ones, or by pointing
``BIDIRL_DATA`` at another folder with the same layout.
"""

from __future__ import annotations

import difflib
import functools
import os
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional

import yaml


class PresetError(ValueError):
    """An unknown or malformed preset. ``fix`` says what to do about it."""

    def __init__(self, message: str, fix: str = ""):
        self.fix = fix
        super().__init__(message)


def data_dir() -> Path:
    """The folder holding ``presets/``, ``configs/`` and ``paper/`` (``BIDIRL_DATA`` overrides it)."""
    env = os.environ.get("BIDIRL_DATA")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent
    installed = here / "data"              # a wheel ships data/ as the package bidirl.data
    return installed if (installed / "presets").is_dir() else here.parent / "data"


# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelSpec:
    """Decoder architecture numbers used by the stage-time models (appendix: L, H, V, N_nonemb, H_kv, d_head)."""
    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tie_word_embeddings: bool
    params_total: float          # all parameters, vision encoder included
    params_nonembedding: float   # N_nonemb: total minus embedding and untied head
    vision_params: float = 0.0
    dtype_bytes: int = 2         # bf16 weights and KV cache
    sources: tuple = ()

    def kv_bytes_per_token(self, tp: int = 1) -> float:
        """b_kv = 2·L·H_kv·d_head·b_dtype / tp (appendix, rollout model)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes / tp

    @property
    def weight_bytes(self) -> float:
        return self.params_total * self.dtype_bytes


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator kind: peak numbers from its datasheet plus achieved-efficiency factors.

    ``measured_switch_costs`` maps a model name to the two borrowing directions' measured costs
    (the paper's Table 3 for A6000). Other models get costs derived from state sizes and link
    bandwidths by :func:`bidirl.perf.costs.derive_switch_costs`.
    """
    name: str
    memory_bytes: float
    peak_flops: float            # dense bf16 FLOP/s
    memory_bandwidth: float      # B/s
    intra_node_bandwidth: float  # B/s per direction, GPU to GPU
    inter_node_bandwidth: float  # B/s per direction, node to node (per GPU share)
    host_bandwidth: float        # B/s per direction, GPU to host (PCIe)
    gpus_per_node: int
    train_mfu: float             # achieved fraction of peak FLOP/s in RL actor training
    decode_mbu: float            # achieved fraction of peak bandwidth in decode
    prefill_mfu: float
    memory_utilization: float = 0.9   # share of memory usable by one engine
    measured_switch_costs: dict = field(default_factory=dict)
    measured_weight_sync: dict = field(default_factory=dict)
    sources: tuple = ()

    def switch_costs(self, direction: str, model: ModelSpec):
        from bidirl.config import SwitchCosts
        table = self.measured_switch_costs.get(model.name, {})
        if direction in table:
            return SwitchCosts(**table[direction])
        from bidirl.perf.costs import derive_switch_costs
        return derive_switch_costs(self, model)[direction]

    def weight_sync_time(self, model: ModelSpec) -> float:
        if model.name in self.measured_weight_sync:
            return float(self.measured_weight_sync[model.name])
        from bidirl.perf.costs import derive_weight_sync
        return derive_weight_sync(self, model)


@dataclass(frozen=True)
class WorkloadStats:
    """Prompt and response length statistics of a dataset under RL (tokens).

    Response lengths are drawn as ``min(max_response_len, LogNormal)`` whose mean is
    ``response_mean_fraction · max_response_len`` and coefficient of variation ``response_cv``;
    the mean drifts by ``response_drift_per_step`` (relative) per training step as the policy evolves
    (paper Fig. 2c). Prompts are normal with ``prompt_mean`` / ``prompt_std``, clipped to
    ``[prompt_min, prompt_max]``.
    """
    name: str
    prompt_mean: float
    prompt_std: float
    prompt_min: int
    prompt_max: int
    response_mean_fraction: float
    response_cv: float
    response_drift_per_step: float
    step_noise: float            # relative per-step jitter of the response mean
    multimodal: bool = False
    sources: tuple = ()


# --------------------------------------------------------------------------------------------------

_KINDS = {"models": ModelSpec, "hardware": HardwareSpec, "workloads": WorkloadStats}


def names(kind: str) -> list[str]:
    folder = data_dir() / "presets" / kind
    return sorted(p.stem for p in folder.glob("*.yaml"))


@functools.lru_cache(maxsize=None)
def _load(kind: str, name: str, root: str):
    cls = _KINDS[kind]
    path = Path(root) / "presets" / kind / f"{name}.yaml"
    if not path.exists():
        known = names(kind)
        close = difflib.get_close_matches(name, known, n=1)
        fix = f"did you mean '{close[0]}'?" if close else f"use one of: {', '.join(known)}"
        raise PresetError(f"unknown {kind[:-1] if kind != 'hardware' else kind} preset {name!r}", fix)
    raw = yaml.safe_load(path.read_text()) or {}
    allowed = {f.name for f in fields(cls)}
    unknown = set(raw) - allowed
    if unknown:
        raise PresetError(f"{path.name}: unknown keys {sorted(unknown)}", f"valid keys: {sorted(allowed)}")
    raw.setdefault("name", name)
    if "sources" in raw:
        raw["sources"] = tuple(raw["sources"])
    hints = typing.get_type_hints(cls)
    for key, value in raw.items():
        if hints[key] in (float, int) and not isinstance(value, (int, float)):
            raise PresetError(f"{path.name}: {key} must be a number, got {value!r}", "fix the preset file")
    try:
        return cls(**raw)
    except TypeError as exc:
        raise PresetError(f"{path.name}: {exc}", "add the missing keys") from None


def model(name: str) -> ModelSpec:
    return _load("models", name, str(data_dir()))


def hardware(name: str) -> HardwareSpec:
    return _load("hardware", name, str(data_dir()))


def workload(name: str) -> WorkloadStats:
    return _load("workloads", name, str(data_dir()))


def example_configs() -> list[str]:
    return sorted(p.stem for p in (data_dir() / "configs").glob("*.yaml"))


def example_config_path(name: str) -> Optional[Path]:
    """``data/configs/<name>.yaml`` if ``name`` names a shipped example config."""
    path = data_dir() / "configs" / f"{Path(name).stem}.yaml"
    return path if path.exists() else None
