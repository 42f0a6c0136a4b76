"""The one base of every error bidirl reports to its user, and the configuration error every layer raises.

Each user-facing error — a bad config, preset, dataset, reward function, profile, step log, checkpoint, model
folder, output folder, or a cluster that cannot go on — derives from :class:`BidirlError`, so the command line
catches that one class and prints the message (which names the field and the fix). The specific classes live
beside the code that raises them; :class:`ConfigError` lives here because the RL data layer raises it below
the job layer that defines configs (``docs/architecture.md``, "Layers").
"""

from __future__ import annotations


class BidirlError(Exception):
    """An error in what the user gave bidirl (or in the cluster it was told to use), with a message that
    names the field and the fix. ``fix`` is that sentence alone, when it is known."""

    fix: str = ""


class ConfigError(BidirlError, ValueError):
    """A configuration value is missing, malformed or inconsistent.

    ``field`` is the dotted path of the offending key, ``fix`` a sentence telling the user what to do.
    """

    def __init__(self, field: str, problem: str, fix: str = ""):
        self.field, self.problem, self.fix = field, problem, fix
        msg = f"{field}: {problem}" if field else problem
        if fix:
            msg += f" — {fix}"
        super().__init__(msg)
