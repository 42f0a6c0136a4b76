"""``RayRun``: a Ray run in a notebook cell — progress from its first second, Ray's routine chatter in a log.

A Ray driver (:class:`bidirl.cluster.emulated.EmulatedDriver`, :class:`bidirl.cluster.engines.driver.EngineDriver`)
spends its first tens of seconds starting Ray, reserving the GPU slots and starting the workers (vLLM imports
and engine start-up for real engines) before the first step, and its progress bar only appears then. This
widget shows from the first second what the run is doing and for how long: a phase line, an elapsed-seconds
counter that the browser advances by itself (an ``ipywidgets.Play`` linked in the page, so it keeps counting
while the kernel is busy starting workers) and, once the run has started, a step bar.

Ray also prints routine messages to the cell — the token-authentication notice of ``ray.init`` and the
raylet's worker start-up concurrency warning on small machines — in red stderr boxes. :func:`ray_output`
sends everything written to this process's stdout and stderr while the run lasts to a log file instead,
echoes to the cell only the lines that are not routine (:data:`ROUTINE`), and says at the end how many lines
went to the log and where.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import ipywidgets as ipw

#: messages Ray prints on every start on a small machine; they go to the log only
ROUTINE: tuple = (
    re.compile(r"Token authentication is enabled"),
    re.compile(r"worker processes have been started on node"),
    re.compile(r"Started a local Ray instance"),
    re.compile(r"Connect(ed|ing) to (an )?existing Ray cluster"),
    re.compile(r"INFO node\.py:\d+ -- Failed to get node info"),    # start-up retries on a busy machine
    re.compile(r"^\s*$"),
)
DEFAULT_LOG = Path("results") / "ray" / "ray-output.log"


def routine(line: str) -> bool:
    """Whether a line Ray printed is one of its routine messages (:data:`ROUTINE`)."""
    return any(p.search(line) for p in ROUTINE)


class _Sink(io.TextIOBase):
    """A stream that writes every line to ``log`` and forwards the lines that are not routine to ``echo``."""

    def __init__(self, log, echo, counts: dict):
        super().__init__()
        self.log, self.echo, self.counts, self._partial = log, echo, counts, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.log.write(text)
        self.log.flush()
        self._partial += text
        *lines, self._partial = self._partial.split("\n")
        for line in lines:
            self._line(line)
        return len(text)

    def _line(self, line: str) -> None:
        if routine(line):
            self.counts["routine"] += 1
        else:
            self.counts["shown"] += 1
            self.echo.write(line + "\n")

    def flush(self) -> None:
        self.log.flush()

    def close_partial(self) -> None:
        if self._partial:
            self._line(self._partial)
            self._partial = ""

    def fileno(self) -> int:                       # some libraries ask; the real stream answers
        return self.echo.fileno()

    def isatty(self) -> bool:
        return False


@contextlib.contextmanager
def ray_output(log_path: Any = DEFAULT_LOG, *, append: bool = True):
    """While the block runs, whatever is written to ``sys.stdout`` / ``sys.stderr`` (Ray's driver-side logger
    and the raylet messages it relays write there) goes to ``log_path``; lines that are not routine are also
    shown as usual. Yields ``{"routine": n, "shown": n, "log": path}``, filled in as lines arrive."""
    path = Path(log_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    counts = {"routine": 0, "shown": 0, "log": path}
    with open(path, "a" if append else "w", encoding="utf-8") as log:
        out, err = sys.stdout, sys.stderr
        sinks = (_Sink(log, out, counts), _Sink(log, err, counts))
        sys.stdout, sys.stderr = sinks
        try:
            yield counts
        finally:
            sys.stdout, sys.stderr = out, err
            for sink in sinks:
                sink.close_partial()


def _elapsed_counter():
    """An elapsed-seconds readout the browser advances on its own (a playing ``Play`` linked to an IntText)."""
    play = ipw.Play(value=0, min=0, max=24 * 3600, step=1, interval=1000, show_repeat=False,
                    layout=ipw.Layout(width="0px", visibility="hidden"))
    readout = ipw.IntText(value=0, description="elapsed (s)", disabled=True, layout=ipw.Layout(width="170px"))
    ipw.jslink((play, "value"), (readout, "value"))
    return play, readout


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
        self._play, self._elapsed = _elapsed_counter()
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
        self.phase.value = f"<b>{d.policy_name}</b> on Ray ({d.provenance}): done in {took:.0f} s"
        self.note.value = (f"Ray printed {counts['routine']} routine line(s) (start-up notices and warnings), kept "
                           f"in <code>{counts['log']}</code>; {counts['shown']} other line(s) shown above.")
        return result

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)
