"""Notebook widgets for bidirl (importable as ``bidirl.widgets``).

* :class:`PartitionSweep` — the planner's partition sweep (paper §4, Algorithm 1) with controls and a
  "simulate" button;
* :class:`LiveGantt` — a per-worker timeline that grows while simulations advance (§5's borrowing windows
  shaded), one row per policy on a shared time axis;
* :class:`MetricsPanel` — throughput (§7.1), idle share per pool and borrow counts (§5.2) per run.

The widgets call the library's public API (``bidirl.planner``, ``bidirl.sim``, ``bidirl.viz``); they hold no
scheduling or modelling logic of their own.
"""

from .gantt import LiveGantt
from .metrics import MetricsPanel, summary_table
from .sweep import PartitionSweep

__all__ = ["LiveGantt", "MetricsPanel", "PartitionSweep", "summary_table"]
