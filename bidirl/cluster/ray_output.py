"""Ray's routine output kept out of the way: a log file for everything, the rest shown as usual.

Ray prints routine messages on every start on a small machine — the token-authentication notice of ``ray.init``,
the raylet's worker start-up concurrency warning — which a notebook shows as red stderr boxes. :func:`ray_output`
sends everything written to this process's stdout and stderr while a block runs to a log file, echoes only the
lines that are not routine (:data:`ROUTINE`), and counts both. ``widgets.RayRun`` uses it around a Ray run.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path
from typing import Any

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
