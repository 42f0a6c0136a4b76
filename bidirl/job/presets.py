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

from bidirl.errors import BidirlError
from bidirl.perf.params import (DECODE_TOKEN_OVERHEAD, KERNEL_OVERHEAD_PER_LAYER, KNOBS, SCHEDULER_OVERHEAD,
                                check_knob, check_stage_params)


class PresetError(BidirlError, ValueError):
    """An unknown or malformed preset. ``fix`` says what to do about it."""

    def __init__(self, message: str, fix: str = ""):
        self.fix = fix
        super().__init__(message)


def data_dir() -> Path:
    """The folder holding ``presets/``, ``configs/`` and ``paper/`` (``BIDIRL_DATA`` overrides it)."""
    env = os.environ.get("BIDIRL_DATA")
    if env:
        return Path(env)
    return _shipped_data_dir()


@functools.lru_cache(maxsize=1)
def _shipped_data_dir() -> Path:
    package = Path(__file__).resolve().parents[1]     # bidirl/ (this file is bidirl/job/presets.py)
    installed = package / "data"           # a wheel ships data/ as the package bidirl.data
    return installed if (installed / "presets").is_dir() else package.parent / "data"


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
    # mixture of experts (all 0 / empty: a dense model). An MoE layer replaces the dense MLP (``intermediate``)
    # by ``experts`` gated experts of ``expert_intermediate`` each, ``experts_per_token`` of them chosen per token
    # by a router, plus always-on shared experts of ``shared_expert_intermediate`` units in all
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0
    dense_layers: tuple = ()     # indices of the layers that keep a dense MLP of ``intermediate`` units
    sources: tuple = ()

    def __post_init__(self):
        if self.dense_layers is not None and not isinstance(self.dense_layers, tuple):
            object.__setattr__(self, "dense_layers", tuple(self.dense_layers))
        check_moe(self)

    # --- mixture of experts (docs/architecture.md, "MoE"): all zero-cost identities for a dense model ---------
    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def moe_layers(self) -> int:
        """How many layers are MoE layers (0 for a dense model)."""
        return self.layers - len(self.dense_layers) if self.is_moe else 0

    @property
    def expert_params(self) -> float:
        """Parameters of one routed expert: a gated MLP, 3·H·I_e (gate, up, down projections)."""
        return 3.0 * self.hidden * self.expert_intermediate

    @property
    def inactive_params(self) -> float:
        """Parameters a token does not use: the (E − k) routed experts it is not sent to, in every MoE layer."""
        return self.moe_layers * (self.experts - self.experts_per_token) * self.expert_params

    @property
    def params_active(self) -> float:
        """Parameters used per token (the model cards' "activated"): total minus :attr:`inactive_params`."""
        return self.params_total - self.inactive_params if self.is_moe else self.params_total

    @property
    def params_active_nonembedding(self) -> float:
        """N_nonemb of the FLOPs terms: for an MoE model the non-embedding parameters a token passes through
        (appendix's 2·N_nonemb per token, with N the *active* count); the dense model's N_nonemb otherwise."""
        return self.params_nonembedding - self.inactive_params if self.is_moe else self.params_nonembedding

    @property
    def mlp_intermediate_per_token(self) -> int:
        """The MLP width one token's activations span in its widest layer: ``intermediate`` for a dense model; k·I_e
        + I_s (its k routed experts and the shared ones) for an MoE layer, or the dense layers' ``intermediate`` if
        wider (the activation terms of :mod:`bidirl.perf.memory`)."""
        if not self.is_moe:
            return self.intermediate
        moe = self.experts_per_token * self.expert_intermediate + self.shared_expert_intermediate
        return max(moe, self.intermediate) if self.dense_layers else moe

    @property
    def routed_expert_params(self) -> float:
        """All routed experts' parameters (E experts in every MoE layer)."""
        return self.moe_layers * self.experts * self.expert_params

    def derived_nonembedding(self) -> float:
        """N_nonemb re-derived from the architecture numbers (an MoE spec's consistency check): per layer attention
        2·H·(heads·d) + 2·H·(kv_heads·d) and two norms 2·H; a dense layer's MLP 3·H·I; an MoE layer's router H·E,
        E experts of 3·H·I_e and shared experts of 3·H·I_s; plus the final norm H. Biases, per-head q/k norms and a
        shared-expert gate (each < 0.01 % of a public model's count) are left out."""
        h = float(self.hidden)
        attention = 2 * h * self.heads * self.head_dim + 2 * h * self.kv_heads * self.head_dim + 2 * h
        dense_mlp = 3 * h * self.intermediate
        moe_mlp = h * self.experts + self.experts * self.expert_params + 3 * h * self.shared_expert_intermediate
        return (self.layers * attention + (self.layers - self.moe_layers) * dense_mlp
                + self.moe_layers * moe_mlp + h)

    def kv_bytes_per_token(self, tp: int = 1) -> float:
        """b_kv = 2·L·H_kv·d_head·b_dtype / tp (appendix, rollout model)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes / tp

    @property
    def weight_bytes(self) -> float:
        return self.params_total * self.dtype_bytes


#: how far an MoE spec's stated non-embedding count may be from :meth:`ModelSpec.derived_nonembedding`. The terms
#: left out (q/k/v biases ≤ 3·H per layer, q/k norms 2·d_head, a shared-expert gate H) are < 1e-4 of any public
#: model's count (Qwen1.5-MoE-A2.7B: 24 · (3·2048 + 2048) = 197 k of 13.7 B = 1.4e-5), so 1 % leaves room for
#: terms not modelled while an expert size off by one power of two (a factor ≥ 2 on > 90 % of the parameters) fails
MOE_COUNT_TOLERANCE = 0.01


def check_moe(m: "ModelSpec") -> None:
    """PresetError naming the field if ``m``'s mixture-of-experts numbers are inconsistent (module doc)."""
    where = f"model {m.name!r}"
    moe_fields = ("experts", "experts_per_token", "expert_intermediate", "shared_expert_intermediate")
    for f in moe_fields:
        v = getattr(m, f)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise PresetError(f"{where}: {f} must be a whole number ≥ 0, got {v!r}", f"fix {f} in the model preset")
    if not m.experts:
        stray = [f for f in moe_fields[1:] if getattr(m, f)] + (["dense_layers"] if m.dense_layers else [])
        if stray:
            raise PresetError(f"{where}: {', '.join(stray)} given for a dense model (experts is 0)",
                              "set experts (the routed experts per MoE layer) or drop those keys")
        return
    if not 1 <= m.experts_per_token <= m.experts:
        raise PresetError(f"{where}: experts_per_token={m.experts_per_token} must be in [1, experts={m.experts}]",
                          "experts_per_token is the router's top-k (config num_experts_per_tok)")
    if m.expert_intermediate < 1:
        raise PresetError(f"{where}: expert_intermediate must be ≥ 1 for an MoE model, got {m.expert_intermediate}",
                          "set it to the config's moe_intermediate_size")
    bad = [i for i in m.dense_layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < m.layers]
    if bad or len(set(m.dense_layers)) != len(m.dense_layers) or len(m.dense_layers) >= m.layers:
        raise PresetError(f"{where}: dense_layers {list(m.dense_layers)} must be distinct layer indices in "
                          f"[0, {m.layers}) leaving at least one MoE layer",
                          "list the layers whose MLP is dense (e.g. DeepSeek's first_k_dense_replace layers)")
    derived = m.derived_nonembedding()
    if abs(derived - m.params_nonembedding) > MOE_COUNT_TOLERANCE * m.params_nonembedding:
        raise PresetError(f"{where}: the architecture numbers add up to {derived:.4g} non-embedding parameters "
                          f"({m.routed_expert_params:.4g} in routed experts), but params_nonembedding is "
                          f"{m.params_nonembedding:.4g}",
                          "check experts, expert_intermediate, shared_expert_intermediate, dense_layers and "
                          "params_nonembedding against the model's config")


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator kind: peak numbers from its datasheet plus achieved-efficiency factors.

    ``measured_switch_costs`` maps a model name to the two borrowing directions' measured costs
    (the paper's Table 3 for A6000). Other models get costs derived from state sizes and link
    bandwidths by :func:`bidirl.perf.costs.derive_switch_costs`.

    The efficiency factors and the three overhead knobs (``kernel_overhead_per_layer``,
    ``scheduler_overhead``, ``decode_token_overhead``; defaults in :mod:`bidirl.perf.params`) are what the
    stage-time models' priors are built from and what ``bidirl calibrate`` fits to measured records.
    ``stage_params`` optionally carries fitted appendix parameters per model (validated by
    :func:`bidirl.perf.params.check_stage_params`); they replace the knob-derived priors for that model.
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
    kernel_overhead_per_layer: float = KERNEL_OVERHEAD_PER_LAYER   # s per layer per trainer pass / prefill wave
    scheduler_overhead: float = SCHEDULER_OVERHEAD                 # s per prefill wave / decode iteration
    decode_token_overhead: float = DECODE_TOKEN_OVERHEAD           # s per running sequence per decode iteration
    stage_params: dict = field(default_factory=dict)               # model -> fitted appendix parameters
    switch_model: dict = field(default_factory=dict)               # fitted constants of bidirl.perf.costs
    cache_bytes: float = 0.0     # B, last-level cache of one trainer device (0: unknown, no spill term)
    #: B/s of a single-controller trainer's data path per call (bidirl.perf.controller_data); None: not charged
    controller_data_rate: Optional[float] = None
    sources: tuple = ()

    def knobs(self) -> dict:
        """The calibratable knobs (:data:`bidirl.perf.params.KNOBS`) and their values."""
        return {k: float(getattr(self, k)) for k in KNOBS}

    def switch_costs(self, direction: str, model: ModelSpec):
        from bidirl.core.protocol import SwitchCosts
        table = self.measured_switch_costs.get(model.name, {})
        if direction in table:
            return SwitchCosts(**table[direction])
        from bidirl.perf.costs import derive_switch_costs
        return derive_switch_costs(self, model)[direction]

    def weight_sync_time(self, model: ModelSpec, *, rollout_tp: int) -> float:
        """The measured sync of ``model`` when the preset has one (measured at its own layout), else the derived
        one for rollout replicas of ``rollout_tp`` GPUs, the layout the job runs (no default: a 1-GPU sync for a
        job whose replicas span more GPUs is wrong; :func:`bidirl.perf.costs.derive_weight_sync`)."""
        if model.name in self.measured_weight_sync:
            return float(self.measured_weight_sync[model.name])
        from bidirl.perf.costs import derive_weight_sync
        return derive_weight_sync(self, model, rollout_tp=rollout_tp)


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
    #: LLM image tokens in each prompt (inside ``prompt_*``); the trainer's ViT runs over 4× as many patches
    #: (:func:`bidirl.perf.flops.vit_forward_flops`). 0: no image (a text workload)
    image_tokens_per_prompt: int = 0
    sources: tuple = ()


# --------------------------------------------------------------------------------------------------

_KINDS = {"models": ModelSpec, "hardware": HardwareSpec, "workloads": WorkloadStats}


def names(kind: str) -> list[str]:
    folder = data_dir() / "presets" / kind
    return sorted(p.stem for p in folder.glob("*.yaml"))


@functools.lru_cache(maxsize=None)
def _load(kind: str, name: str, root: str):
    path = Path(root) / "presets" / kind / f"{name}.yaml"
    if not path.exists():
        known = names(kind)
        close = difflib.get_close_matches(name, known, n=1)
        fix = f"did you mean '{close[0]}'?" if close else f"use one of: {', '.join(known)}"
        raise PresetError(f"unknown {kind[:-1] if kind != 'hardware' else kind} preset {name!r}", fix)
    return _load_file(_KINDS[kind], path, name)


def _load_file(cls, path: Path, name: str):
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise PresetError(f"{path.name}: not valid YAML ({exc})", f"fix the syntax of {path}") from None
    if not isinstance(raw, dict):
        raise PresetError(f"{path.name}: must be a mapping of preset fields, got {type(raw).__name__}",
                          f"write {path} as 'key: value' lines")
    allowed = {f.name for f in fields(cls)}
    unknown = set(raw) - allowed
    if unknown:
        raise PresetError(f"{path.name}: unknown keys {sorted(unknown)}", f"valid keys: {sorted(allowed)}")
    raw.setdefault("name", name)
    if "sources" in raw:
        raw["sources"] = tuple(raw["sources"])
    if "dense_layers" in raw:
        if not isinstance(raw["dense_layers"], list):
            raise PresetError(f"{path.name}: dense_layers must be a list of layer indices, got {raw['dense_layers']!r}",
                              "write dense_layers: [0] (or drop it when every layer is MoE)")
        raw["dense_layers"] = tuple(raw["dense_layers"])
    if cls is HardwareSpec:
        _check_hardware(raw, path)
    if cls is WorkloadStats:
        _check_image_tokens(raw, path)
    hints = typing.get_type_hints(cls)
    for key, value in raw.items():
        if hints[key] in (float, int) and not isinstance(value, (int, float)):
            raise PresetError(f"{path.name}: {key} must be a number, got {value!r}", "fix the preset file")
    try:
        return cls(**raw)
    except TypeError as exc:
        raise PresetError(f"{path.name}: {exc}", "add the missing keys") from None


def load_hardware_file(path: "str | Path") -> HardwareSpec:
    """A hardware preset read from ``path`` (named after the file), with the checks of :func:`hardware`.

    To use it in a job config, put it in ``data/presets/hardware/`` (or a ``BIDIRL_DATA`` folder) and name it.
    """
    path = Path(path)
    if not path.is_file():
        raise PresetError(f"{path}: no such hardware preset file", "pass the path of a .yaml preset")
    return _load_file(HardwareSpec, path, path.stem)


def _check_image_tokens(raw: dict, path: Path) -> None:
    """``image_tokens_per_prompt`` of a workload preset: a whole number >= 0, no more than ``prompt_min`` (the
    image tokens are part of every prompt), and 0 unless the workload is ``multimodal``."""
    n = raw.get("image_tokens_per_prompt", 0)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise PresetError(f"{path.name}: image_tokens_per_prompt must be a whole number >= 0, got {n!r}",
                          "write the LLM image tokens per prompt (0 for a text workload)")
    if n and not raw.get("multimodal", False):
        raise PresetError(f"{path.name}: image_tokens_per_prompt is {n} but the workload is not multimodal",
                          "set multimodal: true or image_tokens_per_prompt: 0")
    if isinstance(raw.get("prompt_min"), (int, float)) and n > raw["prompt_min"]:
        raise PresetError(f"{path.name}: image_tokens_per_prompt ({n}) exceeds prompt_min ({raw['prompt_min']}); "
                          "the image tokens are part of every prompt", "lower image_tokens_per_prompt or raise prompt_min")


def _check_hardware(raw: dict, path: Path) -> None:
    """Knob ranges and the ``stage_params`` block of a hardware preset (in place: normalised values)."""
    for key in KNOBS:
        if key in raw:
            try:
                raw[key] = check_knob(key, raw[key])
            except ValueError as exc:
                raise PresetError(f"{path.name}: {exc}",
                                  f"set {key} in {path} to a value in that range (efficiency factors are fractions "
                                  "of peak, overheads seconds), or re-run `bidirl calibrate`") from None
    if "cache_bytes" in raw:
        value = raw["cache_bytes"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise PresetError(f"{path.name}: cache_bytes must be a number of bytes ≥ 0, got {value!r}",
                              f"set cache_bytes in {path} to the device's last-level cache size (0: unknown)")
    rate = raw.get("controller_data_rate")
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0):
        raise PresetError(f"{path.name}: controller_data_rate must be a rate in B/s > 0 or absent, got {rate!r}",
                          f"fix controller_data_rate in {path} (bidirl.perf.controller_data), or drop it so the "
                          "driver's data path is not charged")
    if "switch_model" in raw:
        from bidirl.perf.costs import check_switch_model
        try:
            raw["switch_model"] = check_switch_model(raw["switch_model"] or {})
        except ValueError as exc:
            raise PresetError(f"{path.name}: {exc}", f"fix switch_model in {path} or drop it to use the "
                              "documented defaults of bidirl.perf.costs") from None
    if "stage_params" in raw:
        try:
            raw["stage_params"] = check_stage_params(raw["stage_params"] or {})
        except ValueError as exc:
            raise PresetError(f"{path.name}: {exc}",
                              f"fix that entry of stage_params in {path} (see bidirl.perf.params), drop it to use "
                              "the knob-derived priors, or re-run `bidirl calibrate`") from None


def model(name: str) -> ModelSpec:
    return _load("models", name, str(data_dir()))


def hardware(name: str) -> HardwareSpec:
    """The hardware preset ``name`` (``data/presets/hardware/<name>.yaml``), or the preset file ``name`` when it
    ends in ``.yaml`` (e.g. one written by ``bidirl calibrate``; relative paths are from the working folder)."""
    if str(name).endswith(".yaml"):
        path = Path(name).expanduser().resolve()
        if not path.is_file():
            raise PresetError(f"{name}: no such hardware preset file",
                              "pass the path of a .yaml preset (e.g. one `bidirl calibrate` wrote) or a preset name: "
                              + ", ".join(names("hardware")))
        return _load_path(str(path), path.stat().st_mtime_ns)
    return _load("hardware", name, str(data_dir()))


@functools.lru_cache(maxsize=32)
def _load_path(path: str, mtime_ns: int) -> HardwareSpec:      # keyed by mtime: an edited file is re-read
    return load_hardware_file(path)


def workload(name: str) -> WorkloadStats:
    return _load("workloads", name, str(data_dir()))


def example_configs() -> list[str]:
    return sorted(p.stem for p in (data_dir() / "configs").glob("*.yaml"))


def example_config_path(name: str) -> Optional[Path]:
    """``data/configs/<name>.yaml`` if ``name`` names a shipped example config."""
    path = data_dir() / "configs" / f"{Path(name).stem}.yaml"
    return path if path.exists() else None
