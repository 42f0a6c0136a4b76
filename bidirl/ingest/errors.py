"""The errors of importing a foreign trace: each names the file, the event index or line, the field and the fix.

All derive from :class:`bidirl.errors.BidirlError`, so ``bidirl trace import`` prints the message and exits.
"""

from __future__ import annotations

from bidirl.errors import BidirlError


class TraceImportError(BidirlError, ValueError):
    """A trace or mapping that cannot be imported."""

    def __init__(self, where: str, problem: str, fix: str = ""):
        self.where, self.problem, self.fix = where, problem, fix
        super().__init__(f"{where}: {problem}" + (f" — {fix}" if fix else ""))


class TraceFormatError(TraceImportError):
    """The trace file is not what its format says: truncated JSON, an event without ``ts``, a bad duration.
    ``where`` names the file and the event index (0-based, in the file's event list) or the line."""


class MapError(TraceImportError):
    """The mapping file is malformed: a regular expression that does not compile, an unknown pool, role, kind or
    stage, a missing field. ``where`` names the map file and the rule."""


class WorkerPoolConflict(MapError):
    """The map sends spans of one worker to two pools; a worker (one process, its GPUs) lives on one pool."""
