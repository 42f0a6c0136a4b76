"""``PartitionSweep``: explore the planner's partition sweep (paper §4, Algorithm 1) and simulate splits.

Controls set the planning inputs — model P, hardware, GPU budget G, placement Π, staleness bound s, maximum
response length and prompts per step B_p — and every change re-runs :func:`bidirl.job.planner.plan`. The chart is
:func:`bidirl.viz.plan.sweep_figure`: the predicted rollout rate λ_r = B_p / M_r, trainer rate λ_t = B_p / M_t
and pipeline rate λ_pipe = min(λ_r, λ_t) (§4.2) of every candidate split, in prompt groups per second, with a
legend for its colours and shadings. The static plan does not depend on s (Algorithm 1 balances
steady-state rates); s matters to the simulation, and the status line says so when s changes.

The figure widget is created once; a new sweep is copied into its traces inside one ``batch_update`` (on
numeric x positions with the split labels as ticks, as ``sweep_figure`` draws it). Two buttons simulate:

* **simulate selected split** runs :func:`bidirl.sim.simulate` on the selected split (the planner's choice
  unless another is picked in the list or by clicking a bar; clicking an incompatible bar says why it cannot
  be picked) and adds the run, labelled with its config, to a :class:`MetricsPanel`;
* **simulate all candidates** runs :func:`bidirl.sim.sweep.simulate_partitions` on every compatible split and
  draws each one's simulated rate beside the planner's prediction — the paper's static-sweep figure (§7.4),
  live.

:meth:`PartitionSweep.snapshot` returns the current chart as a static figure (for a notebook cell that changed
the controls and wants its result next to it); *export figure* writes it as HTML (and PNG where kaleido renders).
"""

from __future__ import annotations

import html
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import ipywidgets as ipw
import plotly.graph_objects as go

from bidirl.job import config as cfgmod
from bidirl.job import presets

from .metrics import MetricsPanel

RESPONSE_LENGTHS: tuple = (512, 1024, 2048, 4096, 8192, 16384)
#: the policies a user picks from for "simulate" (core policies first, then the modelled baselines)
POLICIES: tuple = cfgmod.POLICIES
WIDTH = 1000
LABEL_STYLE = {"description_width": "215px"}
CONTROL_LAYOUT = {"width": "360px"}
#: steps of each run of "simulate all candidates" (issue target: 20 steps per split)
SWEEP_STEPS = 20


def _control(cls, **kwargs):
    return cls(style=LABEL_STYLE, layout=ipw.Layout(**CONTROL_LAYOUT), **kwargs)


def _error(text: str) -> str:
    return f"<span style='color:#b00'>⚠ {html.escape(text)}</span>"


@dataclass
class PartitionSweep:
    """The partition explorer. ``config`` is a config name/path/JobConfig giving the starting values;
    ``steps`` and ``seed`` (default: the config's) size the simulation behind *simulate selected split*,
    ``sweep_steps`` each run of *simulate all candidates*."""
    config: Any = "a6000-default"
    policy: Optional[str] = None
    steps: Optional[int] = None
    seed: Optional[int] = None
    sweep_steps: int = SWEEP_STEPS
    export_dir: Any = Path("results") / "exports"
    base: Any = field(init=False, repr=False)
    controls: dict = field(init=False, repr=False)
    figure: Any = field(init=False, repr=False)
    metrics: Any = field(init=False, repr=False)
    status: Any = field(init=False, repr=False)
    button: Any = field(init=False, repr=False)
    buttons: dict = field(init=False, repr=False)
    progress: Any = field(init=False, repr=False)
    widget: Any = field(init=False, repr=False)
    plan: Any = field(default=None, init=False, repr=False)
    result: Any = field(default=None, init=False, repr=False)
    simulated: Any = field(default=None, init=False, repr=False)
    recomputes: int = field(default=0, init=False)
    error: Optional[str] = field(default=None, init=False)
    note: str = field(default="", init=False)

    def __post_init__(self):
        self.base = cfgmod.load(self.config)
        b = self.base
        lengths = sorted(set(RESPONSE_LENGTHS) | {b.workload.max_response_len})
        c = {
            "model": _control(ipw.Dropdown, options=presets.names("models"), value=b.model, description="model"),
            "hardware": _control(ipw.Dropdown, options=presets.names("hardware"), value=b.hardware,
                                 description="hardware (GPU type)"),
            "gpus": _control(ipw.BoundedIntText, value=b.cluster.gpus, min=1, max=4096, description="GPU budget G",
                             continuous_update=False),
            "placement": ipw.ToggleButtons(options=["node-aligned", "any"], value=b.cluster.placement,
                                           description="placement Π", style={"description_width": "215px",
                                                                              "button_width": "110px"}),
            "staleness": _control(ipw.BoundedFloatText, value=b.rl.staleness, min=0.0, max=64.0, step=0.5,
                                  description="staleness bound s", continuous_update=False),
            "max_response_len": _control(ipw.Dropdown, options=lengths, value=b.workload.max_response_len,
                                         description="max response length (tokens)"),
            "prompts_per_step": _control(ipw.BoundedIntText, value=b.workload.prompts_per_step, min=1, max=100000,
                                         description="prompts per step B_p", continuous_update=False),
            "partition": _control(ipw.Dropdown, options=[], description="split to simulate"),
            "policy": _control(ipw.Dropdown, options=list(POLICIES), value=self.policy or b.scheduler.policy,
                               description="policy"),
        }
        self.controls = c
        self.status = ipw.HTML(value="")
        self.metrics = MetricsPanel(title="simulated runs (model predictions)", export_dir=self.export_dir)
        self.buttons = {
            "simulate": ipw.Button(description="simulate selected split", button_style="primary", icon="play",
                                   layout=ipw.Layout(width="220px")),
            "all": ipw.Button(description="simulate all candidates", icon="forward", layout=ipw.Layout(width="220px"),
                              tooltip=f"every compatible split, {self.sweep_steps} steps each, under the policy"),
            "export": ipw.Button(description="export figure", icon="image", layout=ipw.Layout(width="220px"),
                                 tooltip="HTML, and PNG where kaleido renders"),
        }
        self.button = self.buttons["simulate"]
        self.buttons["simulate"].on_click(lambda _b: self.simulate())
        self.buttons["all"].on_click(lambda _b: self.simulate_all())
        self.buttons["export"].on_click(lambda _b: self.export_figure())
        self.progress = ipw.IntProgress(value=0, min=0, max=1, description="", layout=ipw.Layout(width="220px",
                                                                                                 visibility="hidden"))

        from bidirl.job.planner import plan as make_plan
        from bidirl.viz.plan import sweep_figure
        self.plan = make_plan(self.config_for_planning())
        self.figure = go.FigureWidget(sweep_figure(self.plan))
        self.recomputes = 1
        self._set_partitions()
        self._highlight()
        for trace in self.figure.data:
            trace.on_click(self._on_click)
        for name, w in c.items():
            if name in ("partition", "policy"):
                continue
            w.observe(lambda change, _name=name: self._changed(_name, change), names="value")
        c["partition"].observe(lambda _change: self._highlight(), names="value")
        self._status_ok()

        planning = ipw.VBox([c[k] for k in ("model", "hardware", "gpus", "placement")])
        workload = ipw.VBox([c[k] for k in ("staleness", "max_response_len", "prompts_per_step")])
        run = ipw.VBox([c["partition"], c["policy"], ipw.HBox([self.buttons["simulate"], self.buttons["all"]]),
                        ipw.HBox([self.buttons["export"], self.progress])])
        self.widget = ipw.VBox([ipw.HBox([planning, workload]), run, self.status, self.figure, self.metrics.widget])

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
        Raises :class:`bidirl.job.config.ConfigError` for an inconsistent combination."""
        return self.base.with_overrides({**self.overrides(), "cluster.partition": None})

    def selected(self) -> Optional[tuple]:
        """``(rollout_gpus, trainer_gpus)`` of the split picked for simulation (None before a plan)."""
        value = self.controls["partition"].value
        return tuple(value) if value else None

    def selected_label(self) -> Optional[str]:
        """The selected split spelled as everywhere else (``8-8``, :func:`bidirl.job.planner.label`)."""
        from bidirl.job.planner import label
        sel = self.selected()
        return label(*sel) if sel else None

    def config_for_simulation(self) -> cfgmod.JobConfig:
        sel = self.selected()
        if sel is None:
            raise ValueError("no split is selected; fix the planning inputs so the planner finds a compatible one")
        return self.base.with_overrides({**self.overrides(), "cluster.partition": list(sel),
                                         "scheduler.policy": self.controls["policy"].value})

    # ------------------------------------------------------------------------------------------
    def _changed(self, name: str, change) -> None:
        ok = self.refresh()
        if ok and name == "staleness":
            self.note = (f"staleness bound s = {change['new']:g}: the static plan does not depend on s "
                         "(Algorithm 1 balances steady-state rates), so the chart is unchanged; s changes the "
                         "residual bubbles a simulation shows — press simulate.")
            self._status_ok()

    def refresh(self) -> bool:
        """Re-plan with the current controls and copy the new sweep into the figure. Returns False (and shows
        the error) when the inputs are invalid; the chart then keeps the last valid sweep."""
        from bidirl.job.planner import plan as make_plan
        from bidirl.viz.plan import sweep_figure
        try:
            plan = make_plan(self.config_for_planning())
        except (cfgmod.ConfigError, ValueError) as exc:
            self.error = str(exc)
            self.status.value = _error(str(exc))
            return False
        self.plan, self.simulated, self.note = plan, None, ""
        self._clear_progress()          # its "n/n splits" counted the old inputs' simulations
        self._draw(sweep_figure(plan))
        self.recomputes += 1
        self.error = None
        self._status_ok()
        return True

    def _clear_progress(self) -> None:
        """Empty and hide the bar of *simulate all candidates*: it describes runs of inputs that are gone."""
        self.progress.value, self.progress.description = 0, ""
        self.progress.layout.visibility = "hidden"

    def _draw(self, new: go.Figure) -> None:
        """Copy a fresh ``sweep_figure`` into the displayed widget's traces and layout in one message."""
        if [t.name for t in new.data] != [t.name for t in self.figure.data]:
            raise RuntimeError("bidirl.viz.plan.sweep_figure changed its traces "
                               f"({[t.name for t in self.figure.data]} -> {[t.name for t in new.data]}); "
                               "the widget relies on a fixed set of traces")
        with self.figure.batch_update():
            for trace, fresh in zip(self.figure.data, new.data):
                trace.x, trace.y, trace.customdata = fresh.x, fresh.y, fresh.customdata
                trace.marker.color = fresh.marker.color
                trace.showlegend = fresh.showlegend
                if fresh.type == "scatter":
                    trace.text = fresh.text
            self.figure.layout.title = new.layout.title
            self.figure.layout.annotations = new.layout.annotations
            axis = new.layout.xaxis
            self.figure.layout.xaxis.update(tickvals=axis.tickvals, ticktext=axis.ticktext, range=axis.range)
            self._set_partitions()
            self._highlight(shapes=list(new.layout.shapes))

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
        """Shade the selected split's column (the planner's own highlight comes from ``sweep_figure``)."""
        from bidirl.viz.plan import selected_shape
        base = [s for s in (self.figure.layout.shapes if shapes is None else shapes)
                if getattr(s, "name", None) != "selected"]
        index = self.plan.index_of(self.selected())
        self.figure.layout.shapes = base + selected_shape(index)
        self.figure.data[-1].showlegend = index is not None      # "column: split selected to simulate"

    def _on_click(self, trace, points, _state) -> None:
        if not points.point_inds:
            return
        from bidirl.job.planner import label
        from bidirl.viz.plan import no_fit_text
        i = points.point_inds[0]
        g_r, g_t, ok = self.plan.candidate(i)
        if ok:
            self.controls["partition"].value = (g_r, g_t)
            self.note = f"selected {label(g_r, g_t)} for simulation."
        else:
            env = self.plan.envelope
            why = no_fit_text(self.plan, self.plan.sweep.iloc[i])
            self.note = (f"{label(g_r, g_t)} cannot be simulated: " + (why or (
                f"it is not hot-switch compatible — each pool must hold whole replicas of both roles "
                f"(rollout replica {env.rollout_layout} GPUs, trainer replica {env.trainer_layout} GPUs), §4.1"))
                + ". Pick a blue or orange bar.")
        self._status_ok()

    def _status_ok(self) -> None:
        from bidirl.results.metrics import RATE_UNIT
        env = self.plan.envelope
        n = len(self.plan.sweep)
        k = int(self.plan.sweep["compatible"].astype(bool).sum())
        text = (f"planner's choice: <b>{env.label}</b> ({env.rollout_gpus} rollout + {env.trainer_gpus} trainer "
                f"GPUs; predicted pipeline rate {env.pipeline_rate:.3g} {RATE_UNIT}); {k} of {n} splits "
                "hot-switch compatible")
        self.status.value = text + (f"<br>{html.escape(self.note)}" if self.note else "")

    # ------------------------------------------------------------------------------------------
    def _guarded(self, button: str, work: Callable[[], Any]) -> Any:
        """``work()`` with ``button`` disabled meanwhile; an invalid job (ConfigError, ValueError) is shown in the
        status line and gives ``None``."""
        self.buttons[button].disabled = True
        try:
            return work()
        except (cfgmod.ConfigError, ValueError) as exc:
            self.error = str(exc)
            self.status.value = _error(str(exc))
            return None
        finally:
            self.buttons[button].disabled = False

    def simulate(self, progress: bool = False):
        """Simulate the selected split under the selected policy; show (labelled with its config) and return the
        ``RunResult``."""
        from bidirl.sim import simulate
        cfg = self.config_for_simulation()
        policy = self.controls["policy"].value
        self.status.value = f"simulating {policy} on {cfg.cluster.partition.label()} …"
        result = self._guarded("simulate", lambda: simulate(cfg, policy, steps=self.steps, seed=self.seed,
                                                            progress=progress))
        if result is None:
            return None
        self.result = result
        self.metrics.add_runs([result])
        self.note = ""
        self._status_ok()
        return self.result

    def simulate_all(self, progress: bool = True):
        """Simulate every compatible split (:func:`bidirl.sim.sweep.simulate_partitions`, ``sweep_steps`` steps
        each, the selected policy) and draw the simulated rates beside the predicted ones. Returns the frame."""
        from bidirl.sim.sweep import simulate_partitions
        from bidirl.viz.plan import sweep_figure
        cfg = self.config_for_planning()
        policy = self.controls["policy"].value
        bar = self.progress

        def tick(done: int, total: int) -> None:
            bar.max, bar.value = total, done
            bar.description = f"{done}/{total} splits"

        bar.layout.visibility = "visible" if progress else "hidden"
        began = time.perf_counter()
        frame = self._guarded("all", lambda: simulate_partitions(cfg, policy=policy, steps=self.sweep_steps,
                                                                 seed=self.seed, progress=tick if progress else None))
        if frame is None:
            return None
        elapsed = time.perf_counter() - began
        self.simulated = frame
        self._draw(sweep_figure(self.plan, frame))
        ok = frame[frame["status"] == "ok"]
        best = ok.loc[ok["rate"].idxmax(), "label"] if len(ok) else "none"
        self.note = (f"simulated {len(frame)} splits under {policy}, {self.sweep_steps} steps each, in "
                     f"{elapsed:.1f} s: best simulated split {best} (diamonds), planner's choice "
                     f"{self.plan.envelope.label}.")
        self._status_ok()
        return frame

    # ------------------------------------------------------------------------------------------
    def snapshot(self) -> go.Figure:
        """The chart as it is now, as a static figure (sweep, simulated rates, selected split)."""
        from bidirl.viz.plan import sweep_figure
        return sweep_figure(self.plan, self.simulated, selected=self.plan.index_of(self.selected()))

    def export_figure(self, path: Any = None) -> dict:
        """Write :meth:`snapshot` as HTML (and PNG where kaleido renders); default
        ``<export_dir>/sweep-<model>-<G>gpus-<placement>.html``."""
        from bidirl.viz.export import export_figure
        cfg = self.plan.config
        path = Path(path) if path is not None else Path(self.export_dir) / (
            f"sweep-{cfg.model}-{cfg.cluster.gpus}gpus-{cfg.cluster.placement}.html")
        written = export_figure(self.snapshot(), path)
        files = [p for p in (written["html"], written["png"]) if p is not None]
        self.note = f"wrote {', '.join(map(str, files))} ({written['note']})."
        self._status_ok()
        return written

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)
