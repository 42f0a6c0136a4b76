"""Hot-switch costs and the weight-sync time derived from state sizes and link bandwidths (paper §3.2, §6.3).

Used when no measured value exists (``bidirl.job.presets.HardwareSpec.switch_costs`` / ``weight_sync_time``; the
A6000 preset carries the paper's measured Table 3). All transfers of a switch run in parallel on every GPU of
the pool, so a cost is the per-GPU bytes over the per-GPU bandwidth.

**States per GPU** (N = ``params_total``, ``b`` = dtype bytes, ρ_t = trainer layout, tp = rollout layout):

* primary trainer, what it offloads to host when it yields its pool: fp32 master weights and the two fp32
  Adam moments, ``S_tp = 12·N/ρ_t`` (gradients are freed at step boundaries);
* auxiliary trainer (computes gradients only; the optimizer step stays on the primary, §7.2): fp32
  parameters and fp32 gradient buffers, ``S_ta = 8·N/ρ_t``;
* rollout engine: its weights, ``S_r = b·N/tp`` (the KV cache is dropped and reallocated, not copied).

**Moves.** The rollout engine sleeps and wakes through vLLM's sleep mode: ``sleep(S) = SLEEP_FIXED + S/bw`` and
``wake(S) = WAKE_FIXED + S/bw`` over the host link into pinned memory (``bw = host_bandwidth``); the fixed parts
are vLLM's measured sleep/wake latency for a model whose copy takes ≈0.05 s (Qwen3-0.6B on A100: sleep 0.22 s,
wake 1.22 s, vLLM PR #48337). A trainer's state moves as a plain host copy, ``move(S) = S/bw``: FSDP offload
copies to pageable memory (veRL ``offload_fsdp_model_to_cpu``), ``PAGEABLE_FRACTION`` of the pinned rate, and
pays no engine latency — measured, the trainer engine's steady offload of 45.0 GB took 1.00 s and its onload
0.93 s on an H200, the copy at bus speed and nothing beside it (``benchmarks/trainer_scale.md``, "4b on a GPU").

* Rollouter-on-TrainerPool (RoT): ``C_in = move_pageable(S_tp) + wake_pinned(S_r) + S_r/inter`` — the
  trainer yields, the auxiliary rollouter wakes and receives the current rollout weights from a primary
  rollouter on the other pool over the network; ``C_out = sleep_pinned(S_r) + move_pageable(S_tp)``;
  ``C_grad = 0``.
* Trainer-on-RolloutPool (ToR): ``C_in = sleep_pinned(S_r) + move_pageable(S_ta) + b·N/(ρ_t·inter)`` — the
  auxiliary trainer receives its shard of the current actor weights from the primary trainer;
  ``C_out = move_pageable(S_ta) + wake_pinned(S_r)``; ``C_grad = G·(k−1)/(k·intra) + G/(k·inter)`` with
  ``G = 4·N`` fp32 gradient bytes and k = ``gpus_per_node``: the auxiliary replicas reduce-scatter their
  gradients inside the node, then every GPU sends its 1/k share to the primary trainer.

Both pools are assumed to sit on different nodes (the node-aligned case), so cross-pool traffic uses the
per-GPU share of the node's network (``inter_node_bandwidth``).

**Weight sync** (trainer → rollouters at every version, §7.2): the trainer all-gathers its FSDP shards inside a
replica (``b·N·(ρ_t−1)/(ρ_t·intra)``) and broadcasts the bf16 weights to the rollout pool; a pipelined
broadcast delivers ``b·N`` bytes to every receiving GPU at its network share: ``b·N / inter``.

The trainer layout, when not given, is the smallest power-of-two ρ_t whose sharded model states
(:func:`bidirl.perf.memory.trainer_state_bytes`) fit the usable memory, i.e. the layout the state alone needs.
On the A6000 preset the derived costs land within 2× of the paper's measured Table 3 for Qwen3-VL-2B and 4B
(``tests/test_perf.py`` checks it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from bidirl.core.protocol import ROLLOUT_ON_TRAINER_POOL, TRAINER_ON_ROLLOUT_POOL
from bidirl.perf import memory
from bidirl.perf.memory import layout_candidates, trainer_state_bytes, usable_bytes

@dataclass(frozen=True)
class CostConstant:
    """A constant of a cost model: its value, unit, and where the number comes from (a measurement in this
    repository, a vendor spec, or a public number with its citation). ``tests/test_cost_sources.py`` fails on
    a module-level numeric constant of a cost module that is not registered here with a source."""
    value: float
    unit: str
    source: str

    def __post_init__(self):
        if not (isinstance(self.source, str) and len(self.source.strip()) >= 10):
            raise ValueError(f"a cost constant needs its source (a measurement, a spec or a citation), "
                             f"got {self.source!r}")


#: every cost constant of :mod:`bidirl.perf` and the simulator, by the name it has in its module
COST_CONSTANTS: dict = {}


def cost_constant(name: str, value: float, unit: str, source: str) -> float:
    """Register ``name`` in :data:`COST_CONSTANTS` with its source; returns ``value`` (``X = cost_constant(...)``)."""
    if name in COST_CONSTANTS and COST_CONSTANTS[name].value != value:
        raise ValueError(f"cost constant {name} registered twice with different values")
    COST_CONSTANTS[name] = CostConstant(float(value), unit, source)
    return value


#: seconds of fixed latency when a worker wakes / sleeps (vLLM sleep mode, small model; see module doc)
WAKE_FIXED = cost_constant("WAKE_FIXED", 1.1, "s", "vLLM PR #48337 (Qwen3-0.6B on A100, sleep level 1): wake "
                           "1.22 s, of which ≈0.1 s is the copy of 1.2 GB of weights")
SLEEP_FIXED = cost_constant("SLEEP_FIXED", 0.2, "s", "vLLM PR #48337 (Qwen3-0.6B on A100, sleep level 1): sleep "
                            "0.22 s, of which ≈0.05 s is the copy")
#: achieved share of the pinned host-link rate for pageable (non-pinned) copies: public measurements give
#: 0.5 s pinned vs 1.5–3 s pageable for the same FSDP offload, i.e. 1/3 to 1/6; the favourable end is used
PAGEABLE_FRACTION = cost_constant("PAGEABLE_FRACTION", 1.0 / 3.0, "fraction",
                                  "FSDP offload of Qwen3-VL-2B on 2 GPUs: ≈0.5 s pinned vs 1.5–3 s unpinned "
                                  "(reference: public numbers §4.6, derived from the PCIe rate)")
#: bytes per parameter of the primary trainer's offloaded state (fp32 master + Adam m, v)
PRIMARY_TRAINER_STATE = cost_constant("PRIMARY_TRAINER_STATE", 12, "B/param",
                                      "fp32 master weights (4 B) + AdamW m and v (4 B each): torch.optim.AdamW")
#: bytes per parameter of an auxiliary trainer's state (fp32 params + fp32 grads)
AUX_TRAINER_STATE = cost_constant("AUX_TRAINER_STATE", 8, "B/param",
                                  "fp32 parameters (4 B) + fp32 gradient buffer (4 B): FSDP mixed precision")
#: bytes per parameter of a gradient (fp32 reduction, veRL's FSDP default)
GRAD_BYTES = cost_constant("GRAD_BYTES", 4, "B/param", "fp32 gradient reduction: veRL's FSDP mixed-precision "
                           "default (reduce_dtype float32)")
#: seconds per byte to allocate (page-lock) a pinned host buffer: a trainer engine allocates the buffer its state
#: moves through once (in the background from its load on; a first switch waits for what is left of it), later
#: switches reuse it (benchmarks/trainer_scale.md, 4B on an H200: the
#: first offload of 45.0 GB took 36.7 s, a steady one 1.00 s, so the allocation is (36.7 − 1.0) s / 45.0 GB;
#: allocating 45 GB of pinned memory alone took 43 s on the same kind of machine)
PINNED_ALLOC_SECONDS_PER_BYTE = cost_constant(
    "PINNED_ALLOC_SECONDS_PER_BYTE", (36.7 - 1.00) / 45.0e9, "s/B",
    "benchmarks/trainer_scale.md, '4b on a GPU (H200)': offload first switch 36.7 s vs steady 1.00 s for 45.0 GB "
    "of fp32 weights + AdamW state (measured 2026-11-26)")

#: bytes per vocabulary entry of a token's logits in the trainer's log-prob (and loss) computation: fp32. The
#: trainer engine upcasts the head's output before its log_softmax (bidirl/cluster/engines/workers/logprob.py,
#: ``_head``: ``linear(h, weight, bias).float()``), as transformers' causal-LM loss does. What the actor update keeps
#: of them for its backward is one V-entry row per token where the head runs over the whole micro-batch at once
#: (:func:`bidirl.perf.trainer.saved_activation_bytes_per_token`); the engine's own head runs on chunks of response
#: tokens and recomputes each in the backward, so it keeps one chunk's rows.
LOGIT_BYTES = cost_constant("LOGIT_BYTES", memory.LOGIT_BYTES, "B/vocabulary entry/token",
                            "torch.float32 logits: bidirl/cluster/engines/workers/logprob.py _head (.float() before "
                            "log_softmax); transformers 5.19 src/transformers/loss/loss_utils.py ForCausalLMLoss "
                            "('Upcast to float if we need to compute the loss to avoid potential precision issues': "
                            "logits = logits.float())")


def state_layout(hw, model) -> int:
    """Smallest layout (GPUs) whose sharded trainer model states fit in the usable memory of one GPU."""
    cands = layout_candidates(hw.gpus_per_node, 64 * hw.gpus_per_node)
    for rho in cands:
        if trainer_state_bytes(model, rho) <= usable_bytes(hw):
            return rho
    return cands[-1]


def _layouts(hw, model, trainer_layout, rollout_tp):
    rho = state_layout(hw, model) if trainer_layout is None else int(trainer_layout)
    tp = int(rollout_tp)
    if rho < 1 or tp < 1:
        raise ValueError("trainer_layout and rollout_tp must be ≥ 1")
    return rho, tp


#: the switch model's constants a hardware preset may fit (``switch_model:``), with their defaults
SWITCH_MODEL = {"wake_fixed": WAKE_FIXED, "sleep_fixed": SLEEP_FIXED, "pageable_fraction": PAGEABLE_FRACTION}


def check_switch_model(values) -> dict:
    """A preset's ``switch_model`` block, validated: known keys, non-negative seconds, a fraction in (0, 1]."""
    if not isinstance(values, dict):
        raise ValueError(f"switch_model must map constants to numbers, got {values!r}")
    unknown = sorted(set(values) - set(SWITCH_MODEL))
    if unknown:
        raise ValueError(f"switch_model: unknown constant(s) {unknown}; use {', '.join(SWITCH_MODEL)}")
    out = {}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"switch_model.{key} must be a number, got {value!r}")
        low_ok = value > 0 if key == "pageable_fraction" else value >= 0
        if not low_ok or (key == "pageable_fraction" and value > 1):
            raise ValueError(f"switch_model.{key} = {value!r} is out of range "
                             f"({'(0, 1]' if key == 'pageable_fraction' else '≥ 0 seconds'})")
        out[key] = float(value)
    return out


def switch_constants(hw) -> dict:
    """The switch model's constants for ``hw``: the preset's fitted ones over the defaults."""
    return {**SWITCH_MODEL, **(getattr(hw, "switch_model", None) or {})}


def derive_switch_costs(hw, model, *, trainer_layout: Optional[int] = None, rollout_tp: int = 1,
                        constants: Optional[dict] = None) -> dict:
    """``{"trainer_on_rollout_pool": SwitchCosts, "rollout_on_trainer_pool": SwitchCosts}`` (module doc);
    ``constants`` overrides the switch model's fixed latencies and pageable fraction (default: the preset's)."""
    from bidirl.core.protocol import SwitchCosts
    rho, tp = _layouts(hw, model, trainer_layout, rollout_tp)
    c = {**switch_constants(hw), **(constants or {})}
    n = float(model.params_total)
    pinned = float(hw.host_bandwidth)
    pageable = pinned * c["pageable_fraction"]
    inter, intra, k = float(hw.inter_node_bandwidth), float(hw.intra_node_bandwidth), int(hw.gpus_per_node)

    s_tp = PRIMARY_TRAINER_STATE * n / rho
    s_ta = AUX_TRAINER_STATE * n / rho
    s_r = model.dtype_bytes * n / tp

    def sleep(size, bw):
        return c["sleep_fixed"] + size / bw

    def wake(size, bw):
        return c["wake_fixed"] + size / bw

    def move(size, bw):          # a trainer's state: a plain host copy, no engine latency (module doc)
        return size / bw

    rot = SwitchCosts(c_in=move(s_tp, pageable) + wake(s_r, pinned) + s_r / inter,
                      c_out=sleep(s_r, pinned) + move(s_tp, pageable),
                      c_grad=0.0)
    grad = GRAD_BYTES * n
    tor = SwitchCosts(c_in=sleep(s_r, pinned) + move(s_ta, pageable) + aux_weight_transfer_time(hw, model, rho),
                      c_out=move(s_ta, pageable) + wake(s_r, pinned),
                      c_grad=grad * (k - 1) / (k * intra) + grad / (k * inter))
    return {TRAINER_ON_ROLLOUT_POOL: tor, ROLLOUT_ON_TRAINER_POOL: rot}


def aux_weight_transfer_time(hw, model, trainer_layout: Optional[int] = None) -> float:
    """Seconds for an auxiliary trainer gang to receive the primary gang's current actor weights: its shard,
    ``b·N/ρ_t`` bytes per GPU, over the per-GPU share of the network between the pools (module doc). The
    Trainer-on-RolloutPool switch in pays it once (C_in's last term); an auxiliary gang that keeps working after an
    optimizer step that kept the version (an optimizer mini-batch's) pays it again to hold the new weights, as a
    data-parallel member of the primary gang would (``RefreshWeights``)."""
    rho, _ = _layouts(hw, model, trainer_layout, 1)
    return model.dtype_bytes * float(model.params_total) / (rho * float(hw.inter_node_bandwidth))


def trainer_offload_reload_time(hw, model, *, trainer_layout: Optional[int] = None) -> float:
    """Seconds for a primary trainer to move its state (fp32 master weights and Adam moments, ``12·N/ρ_t`` bytes
    per GPU) to host memory and back over pageable copies — what a system that offloads its trainer every step
    (ROLL's ``offload_states``) pays per step."""
    rho, _ = _layouts(hw, model, trainer_layout, 1)
    c = switch_constants(hw)
    size = PRIMARY_TRAINER_STATE * float(model.params_total) / rho
    pageable = float(hw.host_bandwidth) * c["pageable_fraction"]
    return 2 * size / pageable          # plain host copies, out and back: no engine latency (module doc)


def derive_weight_sync(hw, model, *, trainer_layout: Optional[int] = None, rollout_tp: int = 1) -> float:
    """Seconds to push a new actor version from the trainer pool to the rollout pool (module doc). A rollout
    replica of ``rollout_tp`` GPUs takes its tensor-parallel shard on each GPU, ``b·N/tp`` bytes (vLLM loads each
    rank's slice of the weights), so the broadcast delivers ``b·N / (tp · inter)`` per receiving GPU."""
    rho, tp = _layouts(hw, model, trainer_layout, rollout_tp)
    w = model.dtype_bytes * float(model.params_total)
    return w * (rho - 1) / (rho * hw.intra_node_bandwidth) + w / (tp * hw.inter_node_bandwidth)


# --------------------------------------------------------------------------------------------------
# what a switch really takes: the steady cost, plus what is left of the first switch's pinned allocation
# --------------------------------------------------------------------------------------------------

def first_switch_allocation(hw, model, direction: str, phase: str, *, trainer_layout: Optional[int] = None) -> float:
    """Seconds the trainer engine that yields its pool at the first ``direction``/``phase`` switch of a run spends
    allocating the pinned host buffer its state moves through (then reuses it, module doc). The engines reserve it
    in the background from the moment they load, so the first switch adds only what is left of it
    (:func:`pinned_allocation_left`):

    * Rollouter-on-TrainerPool, in: the primary trainer offloads ``S_tp = 12·N/ρ_t`` bytes per GPU for the first
      time, ``S_tp · PINNED_ALLOC_SECONDS_PER_BYTE``;
    * Trainer-on-RolloutPool, out: the auxiliary trainer offloads ``S_ta = 8·N/ρ_t`` for the first time,
      ``S_ta · PINNED_ALLOC_SECONDS_PER_BYTE``;
    * any other switch: 0 (a rollout engine's weights go through vLLM's sleep mode, whose level-1 sleep allocates
      its pinned backup at every sleep: part of the steady cost).

    Every GPU of the pool pins its own share in parallel (one process each), so the per-GPU bytes count."""
    rho, _ = _layouts(hw, model, trainer_layout, 1)
    n = float(model.params_total)
    if direction == ROLLOUT_ON_TRAINER_POOL and phase == "in":
        return PRIMARY_TRAINER_STATE * n / rho * PINNED_ALLOC_SECONDS_PER_BYTE
    if direction == TRAINER_ON_ROLLOUT_POOL and phase == "out":
        return AUX_TRAINER_STATE * n / rho * PINNED_ALLOC_SECONDS_PER_BYTE
    return 0.0


def pinned_allocation_left(allocation: float, since_load: float) -> float:
    """Seconds of a pinned host-buffer allocation still ahead of a switch that starts ``since_load`` seconds after
    its engine loaded: the trainer engines reserve the buffer in the background from the moment they load
    (``bidirl.cluster.engines.workers.trainer.offload``), so a first switch waits only for what is left of it,
    ``max(0, allocation − since_load)``."""
    if not (allocation >= 0 and not math.isnan(since_load)):
        raise ValueError(f"pinned_allocation_left: allocation must be ≥ 0 s and since_load a number, got "
                         f"{allocation!r}, {since_load!r}")
    return max(0.0, float(allocation) - max(0.0, float(since_load)))


@dataclass
class SwitchTimes:
    """What each hot switch of a run takes where a driver models it (simulator, emulated workers): the steady cost
    of its direction and phase (``steady``: the preset's measured or derived
    :class:`~bidirl.core.protocol.SwitchCosts`), plus, the first time that switch happens, what is left of the
    yielding trainer engine's pinned allocation (:func:`first_switch_allocation`) after the engine spent the time
    since it loaded (``loaded_at``, on the run's clock) reserving it in the background
    (:func:`pinned_allocation_left`). ``first`` is the one copy of the allocations a driver keeps: :meth:`take`
    consumes an entry. The coordinator charges what its profiler expects; this is the truth its gates estimate."""
    steady: dict                       # direction -> SwitchCosts
    first: dict                        # (direction, phase) -> the whole allocation of the first such switch (s)
    loaded_at: float = 0.0             # when the trainer engines loaded, on the run's clock (s)

    def take(self, direction: str, phase: str, now: float) -> tuple:
        """``(steady seconds, pinned-allocation seconds still ahead)`` of the ``direction``/``phase`` switch starting
        at ``now``: the allocation part is nonzero at most once (the first such switch, and only while the background
        reservation has not finished)."""
        costs = self.steady[direction]
        steady = costs.c_in if phase == "in" else costs.c_out
        alloc = float(self.first.pop((direction, phase), 0.0))
        return float(steady), pinned_allocation_left(alloc, now - self.loaded_at)
