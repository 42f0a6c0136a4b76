"""``make demo``: the main job on the embedded default, end to end.

1. **plan** — the shipped ``a6000-default`` config (Qwen3-VL-4B on Geo3K, 16 A6000 GPUs, §7.1) without its
   fixed partition through :func:`bidirl.planner.plan` (§4, Algorithm 1): envelope and sweep table, and the
   sweep as an interactive page (``results/plan.html``);
2. **simulate** — the same job under ``no-borrow`` and ``bidirl`` (§5), both timelines on one time axis in
   ``results/gantt.html`` and the throughput ratio (a simulated result, labelled as such);
3. **run** — unless ``--no-run``: a short real GRPO run of the built-in tiny model under ``bidirl`` on an
   embedded local Ray (vLLM rollouters, torch trainers), its timeline in ``results/tiny-run.html``.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Optional, Sequence

import pandas as pd

from bidirl import config as cfgmod

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
    parser = argparse.ArgumentParser(prog="python -m bidirl.demo", description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default="a6000-default",
                        help="example config name or YAML path (default: a6000-default)")
    parser.add_argument("--out", type=Path, default=Path("results") / "plan.html",
                        help="where to write the sweep figure (default: results/plan.html)")
    parser.add_argument("--steps", type=int, default=12, help="simulated training steps (default 12)")
    parser.add_argument("--no-run", action="store_true", help="skip the real run on local Ray")
    args = parser.parse_args(argv)

    from bidirl.planner import plan          # imported here so `--help` stays instant
    from bidirl.viz_plan import sweep_figure

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
    from bidirl.viz import compare_gantt

    print(f"\nsimulating {steps} steps of {cfg.cluster.partition.label() if cfg.cluster.partition else 'the plan'} "
          "under no-borrow and bidirl (simulation: stage-time models, not a measurement)")
    results = {p: simulate(cfg, p, steps=steps, progress=True) for p in ("no-borrow", "bidirl")}
    for policy, res in results.items():
        s = res.summary()
        print(f"  {policy:<10} throughput {s['throughput']:,.0f} tokens/s   idle rollout {s['idle']['rollout_pool']:.1%} "
              f"trainer {s['idle']['trainer_pool']:.1%}   borrows {s['borrows']}")
    ratio = results["bidirl"].summary()["throughput"] / results["no-borrow"].summary()["throughput"]
    print(f"  simulated speedup bidirl / no-borrow: {ratio:.2f}x")
    compare_gantt({p: r.log for p, r in results.items()}, title="no-borrow vs bidirl (simulated)") \
        .write_html(str(out), include_plotlyjs=True)
    print(f"wrote {out}")
    return results


def real_run(out_dir: Path, steps: int = 6) -> dict:
    """A short real GRPO run of the tiny model under ``bidirl`` on an embedded local Ray (vLLM rollouters,
    torch trainers); prints the measured summary and writes the event log as a Chrome/Perfetto trace."""
    from bidirl.cluster.run import run
    from bidirl.viz import gantt_figure

    print(f"\nreal run: the built-in tiny model on the arithmetic task, {steps} steps under bidirl on an embedded "
          "local Ray (vLLM rollouters, torch trainers; measured, not simulated)")
    res = run("tiny-cpu", "bidirl", steps=steps, emulate=False, progress=True)
    s = res.summary()
    tput = s["throughput"]
    print(f"  throughput {tput:,.0f} tokens/s" if tput else f"  throughput n/a ({s.get('throughput_note')})")
    print("  mean reward per step " + " ".join(f"{r:.3f}" for r in s["reward"]))
    print(f"  borrows {s['borrows']}")
    decisions = res.log.decisions_df()
    for direction, d in decisions.groupby("direction"):
        print(f"  {direction}: {int(d['admitted'].sum())} of {len(d)} windows admitted; median predicted gain "
              f"{d['predicted_gain'].median() * 1e3:.0f} ms vs switch cost {d['cost'].median() * 1e3:.0f} ms")
    for direction, costs in s["costs"].items():
        print(f"  measured {direction}: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in costs.items()))
    if s["logprob_diff_max"] is not None:
        print(f"  vLLM vs trainer log-probs after weight sync: max |diff| {s['logprob_diff_max']:.1e}")
    res.log.save(out_dir / "tiny-run.json")
    gantt_figure(res.log, title="tiny model under bidirl on local Ray (measured)").write_html(
        str(out_dir / "tiny-run.html"), include_plotlyjs=True)
    print(f"wrote {out_dir / 'tiny-run.json'} (Chrome/Perfetto trace) and {out_dir / 'tiny-run.html'}")
    return s


if __name__ == "__main__":
    raise SystemExit(main())
