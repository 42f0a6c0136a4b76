"""``make demo``: the main job on the embedded default, end to end.

1. **plan** — the shipped ``a6000-default`` config (Qwen3-VL-4B on Geo3K, 16 A6000 GPUs, §7.1) without its
   fixed partition through :func:`bidirl.job.planner.plan` (§4, Algorithm 1): envelope and sweep table, and the
   sweep as an interactive page (``results/plan.html``);
2. **simulate** — the same job under ``no-borrow`` and ``bidirl`` (§5), both timelines on one time axis in
   ``results/gantt.html`` and the throughput ratio (a simulated result, labelled as such);
3. **run** — unless ``--no-run``: a short real GRPO run of the built-in tiny model on ``tiny-cpu-longtail``
   (forced long-tailed response lengths, one logical GPU slot per core, on-policy) under ``no-borrow`` and then
   ``bidirl`` on an embedded local Ray (vLLM rollouters, torch trainers): the gate's windows (predicted gain
   against switch cost, admitted or not), the measured switch costs and the measured speedup beside the
   simulated one; both timelines in ``results/tiny-run.html``.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Optional, Sequence

import pandas as pd

from bidirl.job import config as cfgmod

#: the job of the real run: the tiny model with long-tailed forced response lengths, where borrowing pays on a CPU
REAL_RUN_CONFIG = "tiny-cpu-longtail"
POLICIES = ("no-borrow", "bidirl")

ENVELOPE_FIELDS = ("rollout_gpus", "trainer_gpus", "rollout_layout", "trainer_layout",
                   "rollout_replicas", "trainer_replicas", "pipeline_rate")


def envelope_lines(envelope) -> list[str]:
    """The envelope's fields (DESIGN.md's ``plan --json`` keys) as aligned ``name  value`` lines."""
    values = dataclasses.asdict(envelope) if dataclasses.is_dataclass(envelope) else dict(vars(envelope))
    missing = [f for f in ENVELOPE_FIELDS if f not in values]
    if missing:
        raise ValueError(f"planner envelope lacks {missing}; expected the fields {list(ENVELOPE_FIELDS)}")
    width = max(map(len, ENVELOPE_FIELDS))
    lines = []
    for name in ENVELOPE_FIELDS:
        value = values[name]
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        if name.endswith("_layout"):
            text += " GPUs per replica (ρ)"
        lines.append(f"  {name:<{width}}  {text}")
    return lines


def sweep_text(sweep: pd.DataFrame) -> str:
    """The sweep DataFrame as a plain-text table (all rows, 4 significant digits)."""
    with pd.option_context("display.max_rows", None, "display.max_columns", None, "display.width", 160,
                           "display.float_format", "{:.4g}".format):
        return sweep.to_string(index=False)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bidirl.experiments.demo", description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default="a6000-default",
                        help="example config name or YAML path (default: a6000-default)")
    parser.add_argument("--out", type=Path, default=Path("results") / "plan.html",
                        help="where to write the sweep figure (default: results/plan.html)")
    parser.add_argument("--steps", type=int, default=12, help="simulated training steps (default 12)")
    parser.add_argument("--no-run", action="store_true", help="skip the real run on local Ray")
    args = parser.parse_args(argv)

    from bidirl.job.planner import plan          # imported here so `--help` stays instant
    from bidirl.viz.plan import sweep_figure

    cfg = cfgmod.load(args.config).with_overrides({"cluster.partition": None})
    print(f"bidirl demo: planning {cfg.model} on {cfg.cluster.gpus} x {cfg.hardware} "
          f"({cfg.workload.dataset}, {cfg.workload.prompts_per_step} prompts x {cfg.workload.group_size}, "
          f"max response {cfg.workload.max_response_len}, staleness {cfg.rl.staleness:g})")
    result = plan(cfg)

    print("\nselected envelope (paper §4):")
    print("\n".join(envelope_lines(result.envelope)))
    print("\npartition sweep:")
    print(sweep_text(result.sweep))

    args.out.parent.mkdir(parents=True, exist_ok=True)
    sweep_figure(result).write_html(str(args.out), include_plotlyjs=True)
    print(f"\nwrote {args.out}")

    simulate_both(cfgmod.load(args.config), args.steps, args.out.parent / "gantt.html")
    if not args.no_run:
        real_run(args.out.parent)
    return 0


def simulate_both(cfg, steps: int, out: Path) -> dict:
    """Simulate ``cfg`` under no-borrow and bidirl; print both summaries and write the side-by-side Gantt."""
    from bidirl.sim import simulate
    from bidirl.viz.gantt import compare_gantt

    print(f"\nsimulating {steps} steps of {cfg.cluster.partition.label() if cfg.cluster.partition else 'the plan'} "
          "under no-borrow and bidirl (simulation: stage-time models, not a measurement)")
    results = {p: simulate(cfg, p, steps=steps, progress=True) for p in ("no-borrow", "bidirl")}
    for policy, res in results.items():
        s = res.summary()
        print(f"  {policy:<10} throughput {s['throughput']:,.0f} tokens/s   idle (GPU-weighted) rollout "
              f"{s['idle']['rollout_pool']:.1%} trainer {s['idle']['trainer_pool']:.1%}   borrows {s['borrows']}")
    ratio = results["bidirl"].summary()["throughput"] / results["no-borrow"].summary()["throughput"]
    print(f"  simulated speedup bidirl / no-borrow: {ratio:.2f}x")
    compare_gantt(results, title="no-borrow vs bidirl") \
        .write_html(str(out), include_plotlyjs=True)
    print(f"wrote {out}")
    return results


def real_run(out_dir: Path, steps: int = 8, config: str = REAL_RUN_CONFIG) -> dict:
    """The job ``config`` for real under no-borrow and then bidirl (same seed and steps) on an embedded local Ray
    (vLLM rollouters, torch GRPO trainers): prints each policy's measured throughput, the gate's windows under
    bidirl (§5.2: predicted gain against switch cost, admitted or not), the measured switch costs and the measured
    speedup next to the simulator's; writes bidirl's event log as a Chrome/Perfetto trace and both timelines on
    one time axis. Returns ``{policy: summary}``."""
    from bidirl.experiments import side_by_side as sbs
    from bidirl.viz.gantt import compare_gantt

    cfg = cfgmod.load(config)
    w = cfg.workload
    own = w.response_lengths
    lengths = (f"forced long-tailed response lengths (log-normal, mean {own.mean:g} tokens, cv {own.cv:g}, at most "
               f"{w.max_response_len})" if own is not None and w.forced_lengths else
               f"responses of at most {w.max_response_len} tokens")
    split = cfg.cluster.partition
    slots = f"{split.rollout} + {split.trainer}" if split else f"{cfg.cluster.gpus} (split by the planner)"
    print(f"\nreal run: {config} — the built-in tiny model on the arithmetic task with {lengths}, "
          f"{w.prompts_per_step} prompts x {w.group_size} per step, {slots} logical GPU slots, "
          f"staleness {cfg.rl.staleness:g}; {steps} steps under "
          "no-borrow, then under bidirl, on an embedded local Ray (vLLM rollouters, torch trainers; measured, "
          "not simulated)")
    results = sbs.run_policies(cfg, POLICIES, steps, progress=True)
    for policy, res in results.items():
        s = res.summary()
        print(f"  {policy:<10} throughput {s['throughput']:,.0f} tokens/s   idle (GPU-weighted) rollout "
              f"{s['idle']['rollout_pool']:.1%} trainer {s['idle']['trainer_pool']:.1%}   borrows {s['borrows']}")

    bidirl_run = results["bidirl"]
    print("\n  the gate's windows under bidirl (§5.2): a pool that idles is lent to the other role when the predicted "
          "time saved exceeds the switch cost charged (C_in + C_out; Trainer-on-RolloutPool: C_in plus the part of "
          "C_out / C_grad the optimizer step does not hide); predictions use the online profiler's refitted models")
    print("\n".join(sbs.format_windows(sbs.windows_table(bidirl_run))))
    counts = sbs.window_counts(bidirl_run)
    print("  " + "; ".join(f"{d}: {c['admitted']} of {c['evaluated']} windows admitted" for d, c in counts.items()))
    s = bidirl_run.summary()
    for direction, costs in s["costs"].items():
        print(f"  measured {direction}: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in costs.items()))

    ratio = sbs.throughput_ratio(results)
    simulated = sbs.throughput_ratio(sbs.run_policies(cfg, POLICIES, steps, simulate=True))
    print(f"\n  measured speedup bidirl / no-borrow: {ratio.window:.2f}x (§7.1 throughput; {ratio.median_step:.2f}x by "
          f"median step throughput); simulated for the same config: {simulated.window:.2f}x. On a machine shared "
          "with other work the measured figure varies from run to run: other processes take the cores borrowing uses")
    print("  mean reward per step under bidirl " + " ".join(f"{r:.3f}" for r in s["reward"]))
    if s["logprob_diff_max"] is not None:
        print(f"  vLLM vs trainer log-probs after weight sync: max |diff| {s['logprob_diff_max']:.1e}")
    bidirl_run.log.save(out_dir / "tiny-run.json")
    compare_gantt(results, title=f"{config}: no-borrow vs bidirl on local Ray").write_html(
        str(out_dir / "tiny-run.html"), include_plotlyjs=True)
    print(f"wrote {out_dir / 'tiny-run.json'} (Chrome/Perfetto trace of the bidirl run) and {out_dir / 'tiny-run.html'}")
    return {policy: res.summary() for policy, res in results.items()}


if __name__ == "__main__":
    raise SystemExit(main())
