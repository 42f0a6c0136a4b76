"""bidirl — bidirectional resource scheduling for disaggregated, asynchronous RL post-training (BiDiRL).

The public entry points mirror the command line (``bidirl plan | simulate | run | reproduce | bench``):

* :func:`load_config` (= :func:`bidirl.job.config.load`) and :class:`JobConfig` — the job (paper §4's planning
  input plus the RL and scheduler knobs of §2.2 and §5);
* :func:`plan` (= :func:`bidirl.job.planner.plan`) — Algorithm 1's static partition planner (§4);
* :func:`simulate` (= :func:`bidirl.sim.simulate`) — the discrete-event driver of the bidirectional
  scheduler (§5) and the modelled baselines.

Names are resolved lazily (PEP 562 module ``__getattr__``), so ``import bidirl`` reads no YAML and imports
neither torch, Ray nor vLLM; the first access to ``bidirl.plan`` imports the planner.
"""

from __future__ import annotations

import importlib
from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("bidirl")
except _metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

# public name -> (module, attribute in that module)
_LAZY = {
    "load_config": ("bidirl.job.config", "load"),
    "JobConfig": ("bidirl.job.config", "JobConfig"),
    "ConfigError": ("bidirl.errors", "ConfigError"),
    "plan": ("bidirl.job.planner", "plan"),
    "simulate": ("bidirl.sim", "simulate"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    """Import a public name on first use (PEP 562); any other missing attribute is an AttributeError."""
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'bidirl' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value  # later look-ups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
