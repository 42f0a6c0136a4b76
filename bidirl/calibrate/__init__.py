"""Measuring and fitting the stage-time models: profile the real engines (``profile``), the record format
(``records``), fit a preset from records (``from_records``) or from a job's step log (``from_log``)."""
