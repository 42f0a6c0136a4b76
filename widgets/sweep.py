"""``PartitionSweep``: explore the planner's partition sweep (paper §4, Algorithm 1) and simulate a partition.

Controls set the planning inputs — model P, hardware, GPU budget G, placement Π, staleness s, maximum
response length and prompts per step B_p — and every change re-runs :func:`bidirl.planner.plan`. The chart is
:func:`bidirl.viz_plan.sweep_figure`: the predicted rollout rate λ_r = B_p / M_r, trainer rate λ_t = B_p / M_t
and pipeline rate λ_pipe = min(λ_r, λ_t) (§4.2) of every candidate partition, incompatible partitions greyed,
the planner's choice highlighted, the partition selected for simulation shaded. The static plan does not
depend on s (Algorithm 1 balances steady-state rates); s matters to the simulation.

The figure widget is created once; a new sweep is copied into its traces inside one ``batch_update`` (on
numeric x positions with the partition labels as ticks, as ``sweep_figure`` draws it). "Simulate" runs
:func:`bidirl.sim.simulate` on the selected partition (the planner's choice unless another is picked in the
list or by clicking a bar) and shows the summary in a :class:`MetricsPanel`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import ipywidgets as ipw
import plotly.graph_objects as go

from bidirl import config as cfgmod
from bidirl import presets

from .metrics import MetricsPanel

RESPONSE_LENGTHS: tuple = (512, 1024, 2048, 4096, 8192, 16384)
#: the policies a user picks from for "simulate" (core policies first, then the modelled baselines)
POLICIES: tuple = cfgmod.POLICIES
SELECTED_FILL = "rgba(255, 215, 0, 0.18)"
WIDTH = 1100


@dataclass
class PartitionSweep:
    """The partition explorer. ``config`` is a config name/path/JobConfig giving the starting values;
    ``steps`` and ``seed`` (default: the config's) size the simulation behind the button."""
    config: Any = "a6000-default"
    policy: Optional[str] = None
    steps: Optional[int] = None
    seed: Optional[int] = None
    base: Any = field(init=False, repr=False)
    controls: dict = field(init=False, repr=False)
    figure: Any = field(init=False, repr=False)
    metrics: Any = field(init=False, repr=False)
    status: Any = field(init=False, repr=False)
    button: Any = field(init=False, repr=False)
    widget: Any = field(init=False, repr=False)
    plan: Any = field(default=None, init=False, repr=False)
    result: Any = field(default=None, init=False, repr=False)
    recomputes: int = field(default=0, init=False)
    error: Optional[str] = field(default=None, init=False)

    def __post_init__(self):
        self.base = cfgmod.load(self.config)
        b = self.base
        lengths = sorted(set(RESPONSE_LENGTHS) | {b.workload.max_response_len})
        c = {
            "model": ipw.Dropdown(options=presets.names("models"), value=b.model, description="model"),
            "hardware": ipw.Dropdown(options=presets.names("hardware"), value=b.hardware, description="hardware"),
            "gpus": ipw.BoundedIntText(value=b.cluster.gpus, min=1, max=4096, description="GPU budget",
                                       continuous_update=False),
            "placement": ipw.ToggleButtons(options=["node-aligned", "any"], value=b.cluster.placement,
                                           description="placement"),
            "staleness": ipw.BoundedFloatText(value=b.rl.staleness, min=0.0, max=64.0, step=0.5,
                                              description="staleness s", continuous_update=False),
            "max_response_len": ipw.Dropdown(options=lengths, value=b.workload.max_response_len,
                                             description="max response"),
            "prompts_per_step": ipw.BoundedIntText(value=b.workload.prompts_per_step, min=1, max=100000,
                                                   description="prompts/step", continuous_update=False),
            "partition": ipw.Dropdown(options=[], description="partition"),
            "policy": ipw.Dropdown(options=list(POLICIES), value=self.policy or b.scheduler.policy,
                                   description="policy"),
        }
        self.controls = c
        self.status = ipw.HTML(value="")
        self.metrics = MetricsPanel(title="simulated")
        self.button = ipw.Button(description="simulate", button_style="primary", icon="play")
        self.button.on_click(lambda _b: self.simulate())

        from bidirl.planner import plan as make_plan
        from bidirl.viz_plan import sweep_figure
        self.plan = make_plan(self.config_for_planning())
        self.figure = go.FigureWidget(sweep_figure(self.plan))
        self.figure.layout.width = WIDTH            # a FigureWidget in a box does not resize (plotly.py#4027)
        self.recomputes = 1
        self._set_partitions()
        self._highlight()
        for trace in self.figure.data:
            trace.on_click(self._on_click)
        for name, w in c.items():
            if name in ("partition", "policy"):
                continue
            w.observe(lambda _change: self.refresh(), names="value")
        c["partition"].observe(lambda _change: self._highlight(), names="value")
        self._status_ok()

        planning = ipw.VBox([c[k] for k in ("model", "hardware", "gpus", "placement")])
        workload = ipw.VBox([c[k] for k in ("staleness", "max_response_len", "prompts_per_step")])
        run = ipw.VBox([c["partition"], c["policy"], self.button])
        self.widget = ipw.VBox([ipw.HBox([planning, workload, run]), self.status, self.figure, self.metrics.widget])

    # ------------------------------------------------------------------------------------------
    def overrides(self) -> dict:
        """The dotted-key overrides the controls stand for (``JobConfig.with_overrides`` input)."""
        c = self.controls
        return {"model": c["model"].value, "hardware": c["hardware"].value, "cluster.gpus": int(c["gpus"].value),
                "cluster.placement": c["placement"].value, "rl.staleness": float(c["staleness"].value),
                "workload.max_response_len": int(c["max_response_len"].value),
                "workload.prompts_per_step": int(c["prompts_per_step"].value)}

    def config_for_planning(self) -> cfgmod.JobConfig:
        """The base config with the controls applied and no fixed partition, so the planner chooses one.
        Raises :class:`bidirl.config.ConfigError` for an inconsistent combination."""
        return self.base.with_overrides({**self.overrides(), "cluster.partition": None})

    def selected(self) -> Optional[tuple]:
        """``(rollout_gpus, trainer_gpus)`` of the partition picked for simulation (None before a plan)."""
        value = self.controls["partition"].value
        return tuple(value) if value else None

    def config_for_simulation(self) -> cfgmod.JobConfig:
        sel = self.selected()
        if sel is None:
            raise ValueError("no partition is selected; fix the planning inputs so the planner finds a compatible one")
        return self.base.with_overrides({**self.overrides(), "cluster.partition": list(sel),
                                         "scheduler.policy": self.controls["policy"].value})

    # ------------------------------------------------------------------------------------------
    def refresh(self) -> bool:
        """Re-plan with the current controls and copy the new sweep into the figure. Returns False (and shows
        the error) when the inputs are invalid; the chart then keeps the last valid sweep."""
        from bidirl.planner import plan as make_plan
        from bidirl.viz_plan import sweep_figure
        try:
            plan = make_plan(self.config_for_planning())
        except (cfgmod.ConfigError, ValueError) as exc:
            self.error = str(exc)
            self.status.value = f"<span style='color:#b00'>⚠ {exc}</span>"
            return False
        new = sweep_figure(plan)
        if [t.type for t in new.data] != [t.type for t in self.figure.data]:
            raise RuntimeError("bidirl.viz_plan.sweep_figure changed its traces "
                               f"({[t.type for t in self.figure.data]} -> {[t.type for t in new.data]}); "
                               "the widget relies on a fixed set of traces")
        self.plan = plan
        with self.figure.batch_update():
            for trace, fresh in zip(self.figure.data, new.data):
                trace.x, trace.y, trace.customdata = fresh.x, fresh.y, fresh.customdata
                trace.marker.color = fresh.marker.color
            self.figure.layout.title = new.layout.title
            self.figure.layout.annotations = new.layout.annotations
            axis = new.layout.xaxis
            self.figure.layout.xaxis.update(tickvals=axis.tickvals, ticktext=axis.ticktext, range=axis.range)
            self._set_partitions()
            self._highlight(shapes=list(new.layout.shapes))
        self.recomputes += 1
        self.error = None
        self._status_ok()
        return True

    def _set_partitions(self) -> None:
        options = self.plan.compatible_partitions()
        env = self.plan.envelope
        chosen = (int(env.rollout_gpus), int(env.trainer_gpus))
        old = self.controls["partition"].value
        values = [v for _, v in options]
        self.controls["partition"].options = options
        self.controls["partition"].value = old if old in values else (chosen if chosen in values else
                                                                     (values[0] if values else None))

    def _highlight(self, shapes: Optional[list] = None) -> None:
        """Shade the selected partition's column (the planner's own highlight comes from ``sweep_figure``)."""
        base = [s for s in (self.figure.layout.shapes if shapes is None else shapes)
                if getattr(s, "name", None) != "selected"]
        i = self.plan.index_of(self.selected())
        if i is not None:
            base.append(go.layout.Shape(type="rect", xref="x", yref="paper", x0=i - 0.5, x1=i + 0.5, y0=0, y1=1,
                                        fillcolor=SELECTED_FILL, line={"width": 0}, layer="below", name="selected"))
        self.figure.layout.shapes = base

    def _on_click(self, trace, points, _state) -> None:
        if not points.point_inds:
            return
        g_r, g_t, ok = self.plan.candidate(points.point_inds[0])
        if ok:
            self.controls["partition"].value = (g_r, g_t)

    def _status_ok(self) -> None:
        env = self.plan.envelope
        n = len(self.plan.sweep)
        k = int(self.plan.sweep["compatible"].astype(bool).sum())
        self.status.value = (f"planner's choice: <b>{env.rollout_gpus} rollout + {env.trainer_gpus} trainer GPUs</b>"
                             f" (predicted pipeline rate {env.pipeline_rate:.3g} prompts/s); "
                             f"{k} of {n} partitions compatible")

    # ------------------------------------------------------------------------------------------
    def simulate(self, progress: bool = False):
        """Simulate the selected partition under the selected policy; show and return the ``RunResult``."""
        from bidirl.sim import simulate
        cfg = self.config_for_simulation()
        policy = self.controls["policy"].value
        self.button.disabled = True
        self.status.value = f"simulating {policy} on {cfg.cluster.partition.label()} …"
        try:
            self.result = simulate(cfg, policy, steps=self.steps, seed=self.seed, progress=progress)
        except (cfgmod.ConfigError, ValueError) as exc:
            self.error = str(exc)
            self.status.value = f"<span style='color:#b00'>⚠ {exc}</span>"
            return None
        finally:
            self.button.disabled = False
        part = cfg.cluster.partition
        self.metrics.update({f"{policy} @ {part.rollout}-{part.trainer}": self.result.summary()})
        self._status_ok()
        return self.result

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)
