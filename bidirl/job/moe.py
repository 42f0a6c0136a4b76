"""Why the planner splits an MoE job differently from a dense job of the same active size (docs/architecture.md,
"MoE"; paper §4, Algorithm 1).

:func:`contrast` plans the job twice — with its MoE model and with a dense model of about its *active* size — and
sets the terms that separate the two side by side: compute follows the active parameters (FLOPs per token), while
the replica layouts (memory), the trainer's FSDP collectives, each decode iteration's weight reads, the hot-switch
costs and the weight sync follow the *total* parameters. :attr:`MoEContrast.reasons` states, from those numbers,
what moved the choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from bidirl.core.protocol import ROLLOUT_ON_TRAINER_POOL, TRAINER_ON_ROLLOUT_POOL
from bidirl.job import config as cfgmod
from bidirl.job import planner
from bidirl.job.config import ConfigError

GiB = 2 ** 30


@dataclass(frozen=True)
class MoEContrast:
    """The two plans and the per-model terms (:func:`contrast`); ``terms[role]`` for ``"moe"`` and ``"dense"``."""
    moe_plan: planner.Plan = field(repr=False)
    dense_plan: planner.Plan = field(repr=False)
    terms: dict
    reasons: tuple

    def to_dict(self) -> dict:
        return {"moe": {"model": self.moe_plan.config.model, "choice": self.moe_plan.choice, **self.terms["moe"]},
                "dense": {"model": self.dense_plan.config.model, "choice": self.dense_plan.choice,
                          **self.terms["dense"]},
                "reasons": list(self.reasons)}


def _terms(p: planner.Plan) -> dict:
    from bidirl.perf.costs import derive_switch_costs, derive_weight_sync
    from bidirl.perf.expert_parallel import fsdp_message_bytes
    from bidirl.perf.params import ring_bandwidth
    from bidirl.perf.flops import forward_flops
    from bidirl.perf.moe import decode_weight_bytes, touched_fraction

    cfg, env = p.config, p.envelope
    m, hw = cfg.model_spec, cfg.hardware_spec
    prompts, responses = p.batch
    # decode concurrency: the step's sequences spread over the rollout replicas (all running at the start)
    running = max(1, int(prompts.size) // max(env.rollout_replicas, 1))
    switch = derive_switch_costs(hw, m, trainer_layout=env.trainer_layout, rollout_tp=env.rollout_layout)
    ep = env.trainer_expert_parallel
    return {
        "trainer_expert_parallel": ep, "rollout_expert_parallel": env.rollout_expert_parallel,
        "expert_parallel_options": {k: {"trainer_time": t, "pipeline_rate": lam}
                                    for k, (t, lam) in sorted(p.expert_parallel_options.items())},
        # one forward pass's FSDP gathers on a GPU, seconds at the replica's ring bandwidth (perf.expert_parallel)
        "fsdp_gather_seconds": fsdp_message_bytes(m, hw, env.trainer_layout, ep, "old_logprob")
        / ring_bandwidth(hw, env.trainer_layout),
        "fsdp_gather_seconds_without_ep": fsdp_message_bytes(m, hw, env.trainer_layout, 1, "old_logprob")
        / ring_bandwidth(hw, env.trainer_layout),
        "params_total": float(m.params_total), "params_active": float(m.params_active),
        "flops_per_token": 2.0 * float(m.params_active_nonembedding),
        "step_forward_flops": forward_flops(m, prompts, responses),
        "rollout_layout": env.rollout_layout, "trainer_layout": env.trainer_layout,
        "rollout_replicas": env.rollout_replicas, "trainer_replicas": env.trainer_replicas,
        "rollout_time": env.rollout_time, "trainer_time": env.trainer_time, "pipeline_rate": env.pipeline_rate,
        # M_t less the step's end (its optimizer work and the weight sync, both over the total parameters)
        "trainer_chunk_time": env.trainer_time - env.optimizer_time - env.sync_time,
        "optimizer_seconds": env.optimizer_time,
        "rollout_weights_gib_per_gpu": p.memory["rollout"].parts["weights"] / GiB,
        "trainer_state_gib_per_gpu": sum(v for k, v in p.memory["trainer"].parts.items()
                                         if "activation" not in k) / GiB,
        "decode_running_sequences": running,
        "decode_experts_touched_fraction": float(touched_fraction(m, running)),
        "decode_weight_gib_per_iteration": float(decode_weight_bytes(m, running)) / GiB,
        "switch_seconds": {d: {"c_in": c.c_in, "c_out": c.c_out} for d, c in switch.items()},
        "weight_sync_seconds": derive_weight_sync(hw, m, trainer_layout=env.trainer_layout,
                                                  rollout_tp=env.rollout_layout),
    }


def _reasons(moe: dict, dense: dict, moe_plan, dense_plan) -> tuple:
    r = []
    ratio = lambda key: moe[key] / dense[key] if dense[key] else float("inf")  # noqa: E731
    r.append(f"compute follows active parameters: {moe['flops_per_token'] / 1e9:.2f} vs "
             f"{dense['flops_per_token'] / 1e9:.2f} GFLOP per token (×{ratio('flops_per_token'):.2f}), while "
             f"memory and traffic follow total parameters: {moe['params_total'] / 1e9:.1f} B vs "
             f"{dense['params_total'] / 1e9:.1f} B (×{ratio('params_total'):.1f})")
    for role in ("rollout", "trainer"):
        a, b = moe[f"{role}_layout"], dense[f"{role}_layout"]
        if a != b:
            what = ("weights" if role == "rollout" else "parameters, gradients and optimizer state")
            size = moe["rollout_weights_gib_per_gpu" if role == "rollout" else "trainer_state_gib_per_gpu"]
            r.append(f"a {role} replica needs {a} GPUs instead of {b}: its {what} take {size:.1f} GiB per GPU at "
                     f"{a} GPUs (total parameters), so the pools are split in multiples of {a} GPUs")
    ep = moe["trainer_expert_parallel"]
    options = moe["expert_parallel_options"]
    if ep > 1:
        without = options.get(1, {}).get("trainer_time", float("nan"))
        r.append(f"the trainer shards its experts over EP groups of {ep} GPUs (rl.expert_parallel): a forward pass's "
                 f"FSDP gathers take {moe['fsdp_gather_seconds']:.2f} s per micro-batch instead of "
                 f"{moe['fsdp_gather_seconds_without_ep']:.2f} s (each GPU gathers only its own experts, from its "
                 "expert-data-parallel group), for token all-to-alls a dense model does not have; "
                 f"trainer step {moe['trainer_time']:.3g} s vs {without:.3g} s without EP ("
                 + ", ".join(f"EP {k}: {v['trainer_time']:.3g} s" for k, v in options.items()) + ")")
    elif len(options) > 1:
        r.append("no EP degree beats FSDP alone here (" + ", ".join(f"EP {k}: {v['trainer_time']:.3g} s"
                                                                  for k, v in options.items())
                 + "): the experts stay sharded over the whole trainer replica")
    r.append(f"trainer step time {moe['trainer_time']:.3g} s vs {dense['trainer_time']:.3g} s "
             f"(×{ratio('trainer_time'):.2f} for ×{ratio('step_forward_flops'):.2f} the FLOPs): FSDP all-gathers and "
             "reduce-scatters move every parameter in every pass"
             + (", the experts inside their expert-data-parallel groups" if ep > 1 else ", experts included"))
    r.append(f"rollout step time {moe['rollout_time']:.3g} s vs {dense['rollout_time']:.3g} s "
             f"(×{ratio('rollout_time'):.2f}): with {moe['decode_running_sequences']} sequences running per replica "
             f"a decode iteration touches {100 * moe['decode_experts_touched_fraction']:.1f} % of each layer's "
             f"experts (uniform routing, 1 − (1 − k/E)^n), {moe['decode_weight_gib_per_iteration']:.1f} GiB of "
             f"weights vs {dense['decode_weight_gib_per_iteration']:.1f} GiB")
    for d in (TRAINER_ON_ROLLOUT_POOL, ROLLOUT_ON_TRAINER_POOL):
        a, b = moe["switch_seconds"][d], dense["switch_seconds"][d]
        r.append(f"switch {d}: in {a['c_in']:.2f} s + out {a['c_out']:.2f} s vs {b['c_in']:.2f} s + "
                 f"{b['c_out']:.2f} s — a borrow must win back the total-parameter state moves with active-parameter "
                 "compute")
    r.append(f"weight sync {moe['weight_sync_seconds']:.2f} s vs {dense['weight_sync_seconds']:.2f} s per step")
    same = moe_plan.choice == dense_plan.choice
    r.append(f"split {moe_plan.choice} (MoE) vs {dense_plan.choice} (dense): "
             + ("the same split" if same else "a different split")
             + f"; pipeline rate {moe['pipeline_rate']:.3g} vs {dense['pipeline_rate']:.3g} prompt groups/s, the MoE "
             f"job bound by its {'trainer' if moe_plan.envelope.trainer_rate <= moe_plan.envelope.rollout_rate else 'rollout'}"
             f" pool, the dense one by its "
             f"{'trainer' if dense_plan.envelope.trainer_rate <= dense_plan.envelope.rollout_rate else 'rollout'} pool")
    return tuple(r)


def dense_counterpart(model) -> str:
    """The shipped dense text model closest in total parameters to ``model``'s *active* parameters (by ratio): the
    dense job of "the same active size" the planner sets an MoE job beside (e.g. qwen2.5-3b for qwen3-30b-a3b)."""
    from bidirl.job import presets
    dense = [presets.model(n) for n in presets.names("models")]
    dense = [d for d in dense if not d.is_moe and not d.vision_params]
    return min(dense, key=lambda d: abs(math.log(d.params_total / model.params_active))).name


def contrast(config, dense_model: str = None, *, hardware=None, moe_plan=None) -> MoEContrast:
    """Plan ``config`` (whose model must be MoE) and the same job with ``dense_model`` (default:
    :func:`dense_counterpart`); :class:`MoEContrast`. ``moe_plan``: the config's plan when already made.

    ConfigError naming ``model`` if the config's model is dense or ``dense_model`` is an MoE model."""
    cfg = cfgmod.load(config)
    if dense_model is None and cfg.model_spec.is_moe:
        dense_model = dense_counterpart(cfg.model_spec)
    if not cfg.model_spec.is_moe:
        raise ConfigError("model", f"{cfg.model!r} is a dense model; the contrast is of an MoE model with a dense one",
                          "use an MoE preset (e.g. qwen3-30b-a3b)")
    dense_cfg = cfg.with_overrides({"model": dense_model})
    if dense_cfg.model_spec.is_moe:
        raise ConfigError("model", f"{dense_model!r} is an MoE model; give a dense model of about "
                          f"{cfg.model_spec.params_active / 1e9:.2f} B parameters",
                          "e.g. qwen2.5-3b for qwen3-30b-a3b")
    moe_plan = moe_plan if moe_plan is not None else planner.plan(cfg, hardware=hardware)
    dense_plan = planner.plan(dense_cfg, hardware=hardware)
    moe, dense = _terms(moe_plan), _terms(dense_plan)
    return MoEContrast(moe_plan, dense_plan, {"moe": moe, "dense": dense}, _reasons(moe, dense, moe_plan, dense_plan))
