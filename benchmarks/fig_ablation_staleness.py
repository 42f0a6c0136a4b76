"""The Gantt behind the ablation claims the models still miss (data/paper/limits.yaml, ``one-window-gate``): the
paper's ablation setting (§7.3: 4-12 split of 16 A6000 GPUs, 60 prompts, Qwen3-VL-4B, max response 2K) at staleness
s = 2, no borrowing against BiDiRL and the opportunistic variant, every step of the run.

After the first step neither pool idles in the no-borrow run (the stage-time models balance rollout and training at
this split: the rebalance bound is 1.06x), so every borrowing variant gains only the start-up window, and they end
within a percent of each other. Simulated, not measured. Writes ``docs/figures/abl_staleness_s2.png`` (``.html``
where no PNG renderer runs)::

    python benchmarks/fig_ablation_staleness.py [--out docs/figures] [--point s=2]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bidirl.experiments import specs
from bidirl.sim import SimDriver
from bidirl.viz.export import write_pngs
from bidirl.viz.gantt import compare_gantt


def figure(point: str = "s=2"):
    spec = specs.get("abl-staleness")
    cfg = spec.config(point)
    results = {pol: SimDriver(cfg, pol, cfg.workload.steps, spec.seed).run()
               for pol in ("no-borrow", "bidirl", "opportunistic")}
    spans = {pol: float(r.log.steps_df().end.max()) for pol, r in results.items()}
    return compare_gantt(results, f"Ablation at the 4-12 split, {point}: runs end at "
                         + ", ".join(f"{t:.0f} s" for t in spans.values())), spans


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/figures")
    ap.add_argument("--point", default="s=2", help="a point of the abl-staleness panel")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fig, spans = figure(args.point)
    name = "abl_staleness_" + args.point.replace("=", "").replace(".", "")
    why = write_pngs({out / f"{name}.png": fig})
    if why:
        fig.write_html(out / f"{name}.html", include_plotlyjs="cdn")
    for pol, t in spans.items():
        print(f"{pol}: last step ends at {t:.1f} s")
    print("PNG:", why or f"written to {out / (name + '.png')}")


if __name__ == "__main__":
    main()
