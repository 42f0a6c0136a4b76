"""``make demo``: plan the paper's default job and show what the planner chose (paper §4, Algorithm 1).

Loads the shipped ``a6000-default`` config (Qwen3-VL-4B on Geo3K, 16 A6000 GPUs, §6.1) without its fixed
partition, runs :func:`bidirl.planner.plan`, prints the selected resource envelope and the partition sweep
table, and writes the sweep as an interactive plotly page (``results/plan.html`` by default).
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
