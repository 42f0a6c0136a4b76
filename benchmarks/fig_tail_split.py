"""The Gantt of how a borrowed trainer window's work is split at the paper's ablation setting (§7.3: 4-12 split of 16
A6000 GPUs, 60 prompts, Qwen3-VL-4B, here s = 0), step 0's trainer phase, three ways:

* BiDiRL without TailWindow's reclaim: lazy pull keeps a second full chunk queued on the 1-replica auxiliary gang,
  JointTailSplit cannot move it, and the primaries idle at the end of each segment while it runs;
* BiDiRL: TailWindow takes the queued chunks back (Table 2: queued is recoverable) and the split gives them to the
  side that finishes them first;
* the opportunistic variant: each segment split once by data-parallel capacity (a quarter to the auxiliary gang).

Simulated, not measured. Writes ``docs/figures/tail_split_s0.png`` (``.html`` where no PNG renderer runs)::

    python benchmarks/fig_tail_split.py [--out docs/figures]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from bidirl.core.policies import get_policy
from bidirl.experiments import specs
from bidirl.sim import SimDriver
from bidirl.viz.export import write_pngs
from bidirl.viz.gantt import compare_gantt


def figure(steps: int = 2):
    cfg = specs.get("abl-staleness").config("s=0")
    bidirl = get_policy("bidirl")
    runs = {
        "BiDiRL, queued chunks left where lazy pull sent them": dataclasses.replace(bidirl, tail_reclaim=False),
        "BiDiRL, TailWindow reclaims queued chunks for JointTailSplit": bidirl,
        "opportunistic: one-shot DP-proportional split per segment": get_policy("opportunistic"),
    }
    results = {label: SimDriver(cfg, pol, steps, 0).run() for label, pol in runs.items()}
    ends = {label: float(r.log.steps_df().set_index("step").end[0]) for label, r in results.items()}
    fig = compare_gantt(results, "Trainer window split at the 4-12 ablation split, s = 0 (step 0's end: "
                        + ", ".join(f"{e:.1f} s" for e in ends.values()) + ")")
    fig.update_xaxes(range=[60.0, max(ends.values()) + 10.0])
    return fig, ends


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/figures")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fig, ends = figure()
    why = write_pngs({out / "tail_split_s0.png": fig})
    if why:                                   # no PNG renderer here: the HTML always works
        fig.write_html(out / "tail_split_s0.html", include_plotlyjs="cdn")
    for label, end in ends.items():
        print(f"{label}: step 0 ends at {end:.1f} s")
    print("PNG:", why or f"written to {out / 'tail_split_s0.png'}")


if __name__ == "__main__":
    main()
