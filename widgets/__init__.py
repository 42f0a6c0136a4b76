"""Notebook widgets for bidirl (importable as ``bidirl.widgets``).

* :class:`PartitionSweep` — the planner's partition sweep (paper §4, Algorithm 1) with controls, "simulate
  selected split" and "simulate all candidates" (the static sweep of §7.4, simulated beside the prediction);
* :class:`LiveGantt` — a per-worker timeline that grows while runs advance (§5's borrowing windows shaded),
  one row per run on a shared time axis, with a pace control, pause and replay from the event log;
* :class:`MetricsPanel` — throughput (§7.1), idle share per pool and borrow counts (§5.2) of every run, with
  clear and CSV / figure export;
* :class:`RayRun` — a Ray run in a cell: progress from its first second, Ray's routine output kept in a log
  (:func:`ray_output`).

Every figure says what it shows (simulated, emulated or measured) from the run's own ``provenance``. The widgets
call the library's public API (``bidirl.job.planner``, ``bidirl.sim``, ``bidirl.viz``, ``bidirl.results``); they hold
no scheduling or modelling logic of their own.
"""

from .gantt import LiveGantt
from .metrics import MetricsPanel, summary_table
from .ray_run import RayRun, ray_output
from .sweep import PartitionSweep

__all__ = ["LiveGantt", "MetricsPanel", "PartitionSweep", "RayRun", "ray_output", "summary_table"]
