"""How the planner's split and the borrowing gain move from a dense model to an MoE model (docs/architecture.md,
"MoE"; paper §4's planner, §5's borrowing).

:func:`dense_vs_moe` plans and simulates one job with each of a list of models — by default the dense model of
about Qwen3-30B-A3B's *active* size (Qwen2.5-3B), the largest shipped dense model (Qwen3-8B: no dense model of the
MoE model's ~30 B total size is shipped), then Qwen3-30B-A3B itself — and returns one row per model: the split, the replica layouts and the trainer's EP degree, the
predicted stage times, and the simulated throughput with borrowing (``bidirl``) and without (``no-borrow``), whose
ratio is the borrowing gain. All numbers are simulated (model predictions), never measured.
"""

from __future__ import annotations

import pandas as pd

from bidirl.experiments.side_by_side import windows_table
from bidirl.job import config as cfgmod
from bidirl.job.planner import plan
from bidirl.sim import simulate

#: the default models: dense of about the MoE model's active size, the largest shipped dense model, the MoE model
DEFAULT_MODELS = ("qwen2.5-3b", "qwen3-8b", "qwen3-30b-a3b")
#: the columns of :func:`dense_vs_moe`
COLUMNS = ("model", "kind", "params_total_b", "params_active_b", "split", "rollout_gpus", "trainer_gpus",
           "rollout_layout", "trainer_layout", "trainer_expert_parallel", "rollout_time", "trainer_time",
           "pipeline_rate", "throughput_bidirl", "throughput_no_borrow", "gain", "borrows", "rollout_idle",
           "trainer_idle", "windows", "window_gain", "window_cost")


def h100_job(gpus: int = 32) -> dict:
    """The contrast's job: ``gpus`` H100s in nodes of 8, GSM8K, 128 prompts × 8 responses of up to 2,048 tokens,
    staleness 1 with partial rollouts (the settings of the MoE section's planner contrast)."""
    return {"model": DEFAULT_MODELS[0], "hardware": "h100",
            "cluster": {"gpus": gpus, "gpus_per_node": 8, "placement": "node-aligned"},
            "workload": {"dataset": "gsm8k", "prompts_per_step": 128, "group_size": 8, "max_response_len": 2048,
                         "steps": 20},
            "rl": {"staleness": 1, "partial_rollout": True, "micro_batch_per_device": 4},
            "scheduler": {"policy": "bidirl"}, "seed": 0}


def dense_vs_moe(config=None, models=DEFAULT_MODELS, *, steps: int = 6, seed: int = 0) -> pd.DataFrame:
    """One row per model of ``config`` (default :func:`h100_job`) planned and simulated ``steps`` steps under
    ``bidirl`` and ``no-borrow`` (:data:`COLUMNS`; ``gain`` = bidirl's throughput over no-borrow's, by §7.1's
    window; ``borrows`` the admitted windows of both directions; ``rollout_idle`` / ``trainer_idle`` each pool's
    GPU-weighted idle without borrowing, what borrowing could fill; ``windows`` the borrowing windows the gate
    weighed, ``window_gain`` / ``window_cost`` their median predicted time saved and switch cost, seconds)."""
    base = cfgmod.load(config if config is not None else h100_job())
    rows = []
    for name in models:
        cfg = base.with_overrides({"model": name})
        m, env = cfg.model_spec, plan(cfg).envelope
        run = simulate(cfg, "bidirl", steps=steps, seed=seed)
        with_borrowing = run.summary()
        without = simulate(cfg, "no-borrow", steps=steps, seed=seed).summary()
        borrows = with_borrowing["borrows"]
        windows = windows_table(run)
        rows.append({
            "model": name, "kind": "MoE" if m.is_moe else "dense",
            "params_total_b": m.params_total / 1e9, "params_active_b": m.params_active / 1e9,
            "split": env.label, "rollout_gpus": env.rollout_gpus, "trainer_gpus": env.trainer_gpus,
            "rollout_layout": env.rollout_layout, "trainer_layout": env.trainer_layout,
            "trainer_expert_parallel": env.trainer_expert_parallel,
            "rollout_time": env.rollout_time, "trainer_time": env.trainer_time, "pipeline_rate": env.pipeline_rate,
            "throughput_bidirl": with_borrowing["throughput"], "throughput_no_borrow": without["throughput"],
            # throughput is None when the run is too short for §7.1's window (warm-up and tail steps dropped)
            "gain": (with_borrowing["throughput"] / without["throughput"]
                     if with_borrowing["throughput"] and without["throughput"] else float("nan")),
            "borrows": int(sum(v for k, v in borrows.items() if k != "rejected")),
            "rollout_idle": without["idle"]["rollout_pool"], "trainer_idle": without["idle"]["trainer_pool"],
            "windows": len(windows),
            "window_gain": float(windows["predicted_gain"].median()) if len(windows) else float("nan"),
            "window_cost": float(windows["cost"].median()) if len(windows) else float("nan"),
        })
    return pd.DataFrame(rows, columns=list(COLUMNS))
