"""Figures (plotly): the Gantt of a run, its live state and export (``gantt``), and the planner's sweep (``plan``)."""
