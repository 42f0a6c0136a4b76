"""What a run leaves: the event log and trace (``trace``), ``RunResult`` (``run_result``), where a result comes
from (``provenance``), the §7.1 metrics (``metrics``) and the run output folder (``tracking``)."""
