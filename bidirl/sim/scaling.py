"""How the simulator's own cost grows with the cluster it simulates (issue "interactive speed"; paper §7.2's
scale-up setting as the base).

:func:`scaled_config` grows the paper's default job (§7.1: Qwen3-VL-4B on Geo3K, A6000) to ``gpus`` GPUs with
the batch growing in step — ``prompts_per_gpu`` prompt groups per GPU (4 by default: batch 128 on 32 GPUs, the
§7.2 scale-up point) on an even split — so every replica keeps the same share of work and the simulated
cluster is busy at every size. :func:`measure_scaling` simulates each (GPUs, steps) point and records the
**wall time of the simulation itself** (measured on the machine running it, with the events it processed and
the CPU time it used) and the cost per simulated GPU-step, in wall and in CPU time (the CPU figure is the one to
read on a machine other work keeps busy); the simulated throughput is in the frame too, marked as a simulation.
The first simulation in a process pays one-time costs (imports, first-call paths of numpy and the models): one
untimed warm-up run goes first, every point is repeated (the repetitions interleaved, so a change in the
machine's load falls on every point alike) and the frame holds the medians with the CPU cost's spread.
:func:`cost_summary` reads the frame: the cost ratio of the largest size over the smallest and the log-log slope
of the cost against GPUs. :func:`scaling_figure` draws wall time and cost per GPU-step against GPUs and steps.

The cost per GPU-step is what should stay flat or fall as the cluster grows: the control plane's per-event
work is indexed (no scan over all groups or workers per event), so the time per step grows with the requests
and chunks of the step, not faster.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Optional, Union

import pandas as pd

from bidirl.job import config as cfgmod

#: the frame's columns, in order
COLUMNS: tuple = ("gpus", "steps", "prompts_per_step", "policy", "wall_s", "cpu_s", "events", "events_per_s",
                  "gpu_steps", "us_per_gpu_step", "cpu_us_per_gpu_step", "simulated_throughput", "wall_provenance",
                  "throughput_provenance", "repeats", "cpu_us_per_gpu_step_min", "cpu_us_per_gpu_step_max")
#: the timed columns a repeated point reports as medians
TIMED: tuple = ("wall_s", "cpu_s", "events_per_s", "us_per_gpu_step", "cpu_us_per_gpu_step")

DEFAULT_GPUS: tuple = (16, 32, 64, 128, 256, 512, 1024)


def scaled_config(gpus: int, *, base: Any = "a6000-default", prompts_per_gpu: int = 4) -> cfgmod.JobConfig:
    """``base`` on ``gpus`` GPUs split evenly, with ``prompts_per_gpu × gpus`` prompt groups per step."""
    gpus, prompts_per_gpu = int(gpus), int(prompts_per_gpu)
    cfg = cfgmod.load(base)
    node = cfg.cluster.gpus_per_node
    if gpus < 2 or gpus % 2 or (gpus > node and (gpus // 2) % node):
        raise cfgmod.ConfigError("gpus", f"{gpus} GPUs do not split evenly into two pools of whole nodes "
                                 f"({node} GPUs per node)", f"use an even count ≤ {node} or a multiple of {2 * node}")
    if prompts_per_gpu < 1:
        raise cfgmod.ConfigError("prompts_per_gpu", f"must be ≥ 1, got {prompts_per_gpu}",
                                 "give each GPU at least one prompt group per step")
    return cfg.with_overrides({"cluster.gpus": gpus, "cluster.partition": [gpus // 2, gpus // 2],
                               "workload.prompts_per_step": prompts_per_gpu * gpus})


def measure_point(gpus: int, steps: int, *, policy: str = "bidirl", seed: Optional[int] = None,
                  base: Any = "a6000-default", prompts_per_gpu: int = 4) -> dict:
    """Simulate one point and time it (one row of :func:`measure_scaling`)."""
    from bidirl.sim import simulate
    cfg = scaled_config(gpus, base=base, prompts_per_gpu=prompts_per_gpu)
    steps = int(steps)
    if steps < 1:
        raise cfgmod.ConfigError("steps", f"must be ≥ 1, got {steps}", "simulate at least one step")
    t0, c0 = time.perf_counter(), time.process_time()
    res = simulate(cfg, policy, steps=steps, seed=seed)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    gpu_steps = int(gpus) * steps
    return {"gpus": int(gpus), "steps": steps, "prompts_per_step": cfg.workload.prompts_per_step, "policy": policy,
            "wall_s": wall, "cpu_s": cpu, "events": res.events_processed,
            "events_per_s": res.events_processed / wall if wall > 0 else float("nan"),
            "gpu_steps": gpu_steps, "us_per_gpu_step": 1e6 * wall / gpu_steps, "cpu_us_per_gpu_step": 1e6 * cpu / gpu_steps,
            "simulated_throughput": res.summary().get("throughput"),
            "wall_provenance": "measured", "throughput_provenance": res.provenance}


def measure_scaling(gpus: Iterable[int] = DEFAULT_GPUS, steps: Union[int, Iterable[int]] = 5, *,
                    policy: str = "bidirl", seed: Optional[int] = None, base: Any = "a6000-default",
                    prompts_per_gpu: int = 4, repeats: int = 3, warmup: bool = True,
                    progress: Union[bool, Callable[[int, int], Any], None] = False) -> pd.DataFrame:
    """Simulate every (GPUs, steps) pair — ``gpus`` × ``steps`` (an int or several) — in this process, after one
    untimed ``warmup`` run of the first pair, ``repeats`` times each (round by round: every pair once, then
    again), and return one row per pair (columns :data:`COLUMNS`): the medians of the timed columns
    (:data:`TIMED`), the repetitions and the range of the CPU cost per GPU-step. ``progress``: ``True`` for a
    tqdm bar, or a callable ``progress(done, total)``."""
    pairs = [(int(g), int(s)) for g in gpus for s in ([steps] if isinstance(steps, int) else steps)]
    if not pairs:
        raise ValueError("measure_scaling needs at least one GPU count and one step count")
    if int(repeats) < 1:
        raise ValueError(f"repeats must be ≥ 1 (runs per point; the row holds their medians), got {repeats!r}")
    repeats = int(repeats)
    for g, _ in pairs:
        scaled_config(g, base=base, prompts_per_gpu=prompts_per_gpu)       # bad sizes fail before anything runs
    total = len(pairs) * repeats + bool(warmup)
    bar = None
    if progress is True:
        from tqdm.auto import tqdm
        bar = tqdm(total=total, desc="scaling", unit="run", leave=False)
    done = 0

    def tick():
        nonlocal done
        done += 1
        if bar is not None:
            bar.update(1)
        elif callable(progress):
            progress(done, total)

    runs: dict = {pair: [] for pair in pairs}
    try:
        if warmup:
            measure_point(*pairs[0], policy=policy, seed=seed, base=base, prompts_per_gpu=prompts_per_gpu)
            tick()
        for _ in range(repeats):
            for g, s in pairs:
                runs[(g, s)].append(measure_point(g, s, policy=policy, seed=seed, base=base,
                                                  prompts_per_gpu=prompts_per_gpu))
                tick()
    finally:
        if bar is not None:
            bar.close()
    rows = []
    for pair in pairs:
        timed = pd.DataFrame(runs[pair])
        row = dict(runs[pair][0])
        row.update({c: float(timed[c].median()) for c in TIMED})
        row.update(repeats=repeats, cpu_us_per_gpu_step_min=float(timed["cpu_us_per_gpu_step"].min()),
                   cpu_us_per_gpu_step_max=float(timed["cpu_us_per_gpu_step"].max()))
        rows.append(row)
    return pd.DataFrame(rows, columns=list(COLUMNS))


def cost_summary(by_gpus: pd.DataFrame, column: str = "cpu_us_per_gpu_step") -> dict:
    """How the cost per simulated GPU-step (``column``, medians) grows with the GPUs: ``ratio`` (largest size over
    smallest), ``slope`` (least-squares slope of log cost against log GPUs: 0 is flat, 1 is a cost per step
    growing with the square of the GPUs), ``spread`` (dearest size over cheapest), the sizes, and ``text``, one
    sentence. The smallest size carries the per-step work that does not grow with the cluster (gates, optimizer
    step, sync) over the fewest GPUs, so the slope and the spread say more than the end-to-end ratio alone."""
    import numpy as np
    frame = by_gpus.sort_values("gpus")
    if frame["gpus"].nunique() < 2:
        raise ValueError("cost_summary needs at least two GPU counts")
    g, c = frame["gpus"].to_numpy(float), frame[column].to_numpy(float)
    slope = float(np.polyfit(np.log(g), np.log(c), 1)[0])
    ratio, spread = float(c[-1] / c[0]), float(c.max() / c.min())
    what = "CPU" if column.startswith("cpu") else "wall"
    reps = int(frame["repeats"].min()) if "repeats" in frame and frame["repeats"].notna().all() else 1
    text = (f"cost per simulated GPU-step ({what} time, median of {reps} run{'s' if reps != 1 else ''} per size"
            f"{' after a warm-up run' if reps > 1 else ''}): {int(g[-1]):,} GPUs over {int(g[0]):,}: {ratio:.2f}×; "
            f"across the {len(g)} sizes it stays within {spread:.2f}× ({c.min():,.0f}–{c.max():,.0f} µs), "
            f"log-log slope {slope:+.2f} (0 = flat)")
    return {"ratio": ratio, "slope": slope, "spread": spread, "smallest": int(g[0]), "largest": int(g[-1]), "text": text}


def scaling_figure(by_gpus: pd.DataFrame, by_steps: Optional[pd.DataFrame] = None):
    """Plotly figure: simulation wall time and µs per simulated GPU-step against GPUs (log-log), and wall time
    against steps when ``by_steps`` is given (frames of :func:`measure_scaling`). One subplot a row, each the
    figure's full width; every log axis carries explicit ticks (:func:`bidirl.results.figure_text.log_ticks`),
    so an axis whose data spans less than a decade still shows at least two readable labels."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from bidirl.results.figure_text import log_ticks, title_height, wrapped_title

    rows = 3 if by_steps is not None else 2
    titles = ["cost per simulated GPU-step against GPUs", "wall time against GPUs"] + (
        ["wall time against steps"] if by_steps is not None else [])
    fig = make_subplots(rows=rows, cols=1, subplot_titles=titles, vertical_spacing=0.11)
    label = by_gpus["steps"].astype(str) + " steps"
    fig.add_trace(go.Scatter(x=by_gpus["gpus"], y=by_gpus["us_per_gpu_step"], mode="lines+markers",
                             name="wall µs per GPU-step (median)",
                             hovertemplate="%{x} GPUs: %{y:.4g} wall µs per GPU-step<extra></extra>"), 1, 1)
    spread, ends = {}, []
    if "cpu_us_per_gpu_step_min" in by_gpus and by_gpus["cpu_us_per_gpu_step_min"].notna().all():
        spread = {"error_y": {"type": "data", "symmetric": False,
                              "array": by_gpus["cpu_us_per_gpu_step_max"] - by_gpus["cpu_us_per_gpu_step"],
                              "arrayminus": by_gpus["cpu_us_per_gpu_step"] - by_gpus["cpu_us_per_gpu_step_min"]}}
        ends = list(by_gpus["cpu_us_per_gpu_step_min"]) + list(by_gpus["cpu_us_per_gpu_step_max"])
    fig.add_trace(go.Scatter(x=by_gpus["gpus"], y=by_gpus["cpu_us_per_gpu_step"], mode="lines+markers",
                             name="CPU µs per GPU-step (median; bars: min–max)", line={"dash": "dot"}, **spread,
                             hovertemplate="%{x} GPUs: %{y:.4g} CPU µs per GPU-step<extra></extra>"), 1, 1)
    fig.add_trace(go.Scatter(x=by_gpus["gpus"], y=by_gpus["wall_s"], mode="lines+markers", name="wall time",
                             text=label, hovertemplate="%{x} GPUs, %{text}: %{y:.3g} s<extra></extra>"), 2, 1)
    gpus = log_ticks(by_gpus["gpus"])
    ticks = sorted(set(int(g) for g in by_gpus["gpus"]))
    for row in (1, 2):            # the simulated sizes as the ticks, written out (no log-axis minor digits)
        fig.update_xaxes(type="log", title_text="GPUs simulated", tickvals=ticks, ticktext=[f"{g:,}" for g in ticks],
                         range=gpus["range"], row=row, col=1)
    cost = log_ticks(list(by_gpus["us_per_gpu_step"]) + list(by_gpus["cpu_us_per_gpu_step"]), ends)
    fig.update_yaxes(type="log", title_text="µs per GPU-step (measured)", row=1, col=1, **cost)
    fig.update_yaxes(type="log", title_text="seconds (measured)", row=2, col=1, **log_ticks(by_gpus["wall_s"]))
    if by_steps is not None:
        name = by_steps["gpus"].astype(str) + " GPUs"
        fig.add_trace(go.Scatter(x=by_steps["steps"], y=by_steps["wall_s"], mode="lines+markers",
                                 name="wall time against steps", text=name,
                                 hovertemplate="%{text}, %{x} steps: %{y:.3g} s<extra></extra>"), 3, 1)
        fig.update_xaxes(title_text="steps simulated", row=3, col=1)
        fig.update_yaxes(title_text="seconds (measured)", rangemode="tozero", row=3, col=1)
    reps = by_gpus["repeats"].min() if "repeats" in by_gpus and by_gpus["repeats"].notna().all() else 1
    width = 1000
    title = wrapped_title(f"Simulator cost at scale (measured on this machine; median of {int(reps)} per point)",
                          width_px=width)
    fig.update_layout(title=title, width=width, height=100 + 320 * rows, template="plotly_white",
                      margin={"t": title_height(title) + 20, "l": 90, "r": 30, "b": 110},
                      legend={"orientation": "h", "yref": "container", "y": 0.0, "yanchor": "bottom"})
    return fig


def markdown_table(frame: pd.DataFrame) -> str:
    """The frame as a Markdown table (what ``benchmarks/scaling.md`` holds)."""
    head = ("| GPUs | steps | prompts/step | wall s | CPU s | events | events/s (wall) | µs per GPU-step (wall) "
            "| CPU µs per GPU-step |")
    rule = "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    lines = [head, rule]
    for r in frame.itertuples(index=False):
        lines.append(f"| {r.gpus} | {r.steps} | {r.prompts_per_step} | {r.wall_s:.2f} | {r.cpu_s:.2f} | {r.events} | "
                     f"{r.events_per_s:,.0f} | {r.us_per_gpu_step:,.0f} | {r.cpu_us_per_gpu_step:,.0f} |")
    return "\n".join(lines)


__all__ = ["scaled_config", "measure_point", "measure_scaling", "cost_summary", "scaling_figure", "markdown_table", "COLUMNS",
           "DEFAULT_GPUS"]
