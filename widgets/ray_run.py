"""``RayRun``: a Ray run in a notebook cell — progress from its first second, Ray's routine chatter in a log.

A Ray driver (:class:`bidirl.cluster.emulated.EmulatedDriver`, :class:`bidirl.cluster.engines.driver.EngineDriver`)
spends its first tens of seconds starting Ray, reserving the GPU slots and starting the workers (vLLM imports
and engine start-up for real engines) before the first step, and its progress bar only appears then. This
widget shows from the first second what the run is doing and for how long: a phase line, an elapsed-seconds
counter that the browser advances by itself (an ``ipywidgets.Play`` linked in the page, so it keeps counting
while the kernel is busy starting workers) and, once the run has started, a step bar.

Ray also prints routine messages to the cell — the token-authentication notice of ``ray.init`` and the
raylet's worker start-up concurrency warning on small machines — in red stderr boxes. :func:`ray_output`
(:mod:`bidirl.cluster.ray_output`) sends everything written to this process's stdout and stderr while the run lasts
to a log file instead, echoes to the cell only the lines that are not routine, and the widget says at the end how
many lines went to the log and where.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import ipywidgets as ipw

from bidirl.cluster.ray_output import DEFAULT_LOG, ROUTINE, ray_output, routine  # noqa: F401  (re-exported)


def _elapsed_counter():
    """An elapsed-seconds readout the browser advances on its own (a playing ``Play`` linked to an IntText)."""
    play = ipw.Play(value=0, min=0, max=24 * 3600, step=1, interval=1000, show_repeat=False,
                    layout=ipw.Layout(width="0px", visibility="hidden"))
    readout = ipw.IntText(value=0, description="elapsed (s)", disabled=True, layout=ipw.Layout(width="170px"))
    link = ipw.jslink((play, "value"), (readout, "value"))
    return play, readout, link


@dataclass
class RayRun:
    """Run a Ray driver with progress from the first second and Ray's routine output in a log.

    ``RayRun(driver).run(progress=True)`` displays the widget (in a notebook), runs ``driver.run`` and returns its
    ``RunResult``; any ``on_event`` callback already set on the driver (a :meth:`LiveGantt.follow`) keeps being
    called. ``log_path`` receives what Ray printed.
    """
    driver: Any
    log_path: Any = DEFAULT_LOG
    clock: Callable[[], float] = time.monotonic
    phase: Any = field(init=False, repr=False)
    steps: Any = field(init=False, repr=False)
    note: Any = field(init=False, repr=False)
    widget: Any = field(init=False, repr=False)
    started: Optional[float] = field(default=None, init=False)
    first_event_s: Optional[float] = field(default=None, init=False)
    counts: dict = field(default_factory=dict, init=False)

    def __post_init__(self):
        d = self.driver
        self._play, self._elapsed, self._link = _elapsed_counter()
        self.phase = ipw.HTML(value=f"<b>{d.policy_name}</b> on Ray ({d.provenance}): not started")
        self.steps = ipw.IntProgress(value=0, min=0, max=d.steps, description="steps",
                                     layout=ipw.Layout(width="320px"))
        self.note = ipw.HTML(value="")
        self.widget = ipw.VBox([ipw.HBox([self.phase, self._elapsed, self._play]), self.steps, self.note])

    def _on_event(self, inner: Optional[Callable]) -> Callable:
        def on_event(event=None) -> None:
            if self.first_event_s is None:
                self.first_event_s = self.clock() - self.started
                self.phase.value = (f"<b>{self.driver.policy_name}</b> on Ray ({self.driver.provenance}): running "
                                    f"— workers were ready after {self.first_event_s:.0f} s")
            if self.steps.value != self.driver.steps_done:
                self.steps.value = self.driver.steps_done
            if inner is not None:
                inner(event)
        return on_event

    def run(self, display: bool = True, **kwargs):
        """Display the widget, run the driver (``kwargs`` go to ``driver.run``) and return its ``RunResult``."""
        if display:
            from IPython.display import display as show
            show(self.widget)
        d = self.driver
        inner = d.on_event
        d.on_event = self._on_event(inner)
        self.started = self.clock()
        self.phase.value = (f"<b>{d.policy_name}</b> on Ray ({d.provenance}): starting Ray, reserving "
                            f"{d.config.cluster.gpus} GPU slots and starting the workers — tens of seconds on a "
                            "small machine")
        self._play.playing = True
        try:
            with ray_output(self.log_path) as counts:
                result = d.run(**kwargs)
        finally:
            self._play.playing = False
            d.on_event = inner
        self.counts = dict(counts)
        took = self.clock() - self.started
        self.steps.value = d.steps_done
        # the browser's counter starts late (its Play starts when the message arrives) and, once stopped, may still
        # send back the value it had reached: cut the link first, then end the readout on the time the phase line
        # gives, so the two agree whatever the browser sends afterwards
        self._link.unlink()
        self._play.value = self._elapsed.value = int(f"{took:.0f}")
        self.phase.value = f"<b>{d.policy_name}</b> on Ray ({d.provenance}): done in {took:.0f} s"
        self.note.value = (f"Ray printed {counts['routine']} routine line(s) (start-up notices and warnings), kept "
                           f"in <code>{counts['log']}</code>; {counts['shown']} other line(s) shown above.")
        return result

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)
