"""Simulator cost at cluster scale (``bidirl.sim.scaling``: the paper's default job grown to G GPUs with 4 prompt
groups per GPU per step, an even split, policy ``bidirl``).

* ``sim_512gpu_100steps``: one 100-step simulation of 512 GPUs (2,048 prompts × 8 per step); 10 steps with
  ``--quick``. Wall and CPU seconds, events per second, µs per simulated GPU-step.
* ``sim_scaling``: wall time and µs per simulated GPU-step at 16 … 1,024 GPUs (3 steps each; 16 … 256 and 2 steps
  with ``--quick``), wall time at 32 GPUs for 10, 20 and 40 steps (5, 10 with ``--quick``), and the ratio of the
  cost per GPU-step at the largest size to the smallest and the log-log slope of the cost against GPUs, in wall
  and in CPU time (flat: slope ≈ 0; the CPU figure is the one to read while other work shares the machine).
  Every point is the median of three runs after one warm-up run (:func:`bidirl.sim.scaling.measure_scaling`).

The simulated throughputs of these runs are model results and are not reported here; ``benchmarks/scaling.md``
holds one measured table.
"""

from __future__ import annotations

from bidirl.sim.scaling import cost_summary, measure_point, measure_scaling


def bench_512(quick: bool) -> dict:
    row = measure_point(512, 10 if quick else 100)
    return {"seconds": (row["wall_s"], "s"), "cpu_seconds": (row["cpu_s"], "s"),
            "events_per_second": (row["events_per_s"], "events/s"),
            "us_per_gpu_step": (row["us_per_gpu_step"], "us"), "cpu_us_per_gpu_step": (row["cpu_us_per_gpu_step"], "us"),
            "steps": (row["steps"], "steps")}


def bench_scaling(quick: bool) -> dict:
    gpus = (16, 32, 64, 128, 256) if quick else (16, 32, 64, 128, 256, 512, 1024)
    by_gpus = measure_scaling(gpus, 2 if quick else 3)
    by_steps = measure_scaling((32,), (5, 10) if quick else (10, 20, 40))
    out = {}
    for r in by_gpus.itertuples(index=False):
        out[f"g{r.gpus}.seconds"] = (r.wall_s, "s")
        out[f"g{r.gpus}.us_per_gpu_step"] = (r.us_per_gpu_step, "us")
        out[f"g{r.gpus}.cpu_us_per_gpu_step"] = (r.cpu_us_per_gpu_step, "us")
    for r in by_steps.itertuples(index=False):
        out[f"g32_{r.steps}steps.seconds"] = (r.wall_s, "s")
    wall, cpu = cost_summary(by_gpus, "us_per_gpu_step"), cost_summary(by_gpus)
    out["cost_ratio_largest_over_smallest"] = (wall["ratio"], "x")
    out["cpu_cost_ratio_largest_over_smallest"] = (cpu["ratio"], "x")
    out["cost_slope_log_log"] = (wall["slope"], "")
    out["cpu_cost_slope_log_log"] = (cpu["slope"], "")
    return out


BENCHMARKS = {"sim_512gpu_100steps": bench_512, "sim_scaling": bench_scaling}


def write_table(path: str = "benchmarks/scaling.md") -> None:
    """Measure the full scaling sweep once and write it as ``path`` (``python -m benchmarks.bench_scaling``)."""
    import os
    import platform
    from datetime import datetime, timezone
    from pathlib import Path

    from bidirl.sim.scaling import markdown_table

    by_gpus = measure_scaling((16, 32, 64, 128, 256, 512, 1024), 3, progress=True)
    by_steps = measure_scaling((32,), (10, 20, 40, 80), progress=True)
    wall, cpu = cost_summary(by_gpus, "us_per_gpu_step"), cost_summary(by_gpus)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    text = f"""# Simulator scaling (measured)

Wall time of a simulation (`bidirl.sim.scaling.measure_scaling`: median of three runs per point after one warm-up
run, policy `bidirl`) of the paper's default job
(§7.1: Qwen3-VL-4B, Geo3K, A6000) grown to G GPUs with 4 prompt groups × 8 responses per GPU per step on an even
split. Written by `python -m benchmarks.bench_scaling` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC,
{platform.machine()}, {os.cpu_count()} cores, one-minute load average {load:.1f} when it finished (other work on
the machine inflates the wall times; the CPU seconds are this process's own). Notebook
`notebooks/07-scaling.ipynb` draws the same measurement.

## Against GPUs (3 steps each)

{markdown_table(by_gpus)}

{cpu['text'][0].upper() + cpu['text'][1:]}.

{wall['text'][0].upper() + wall['text'][1:]}.

## Against steps (32 GPUs)

{markdown_table(by_steps)}
"""
    Path(path).write_text(text)
    print(text)


if __name__ == "__main__":
    write_table()
