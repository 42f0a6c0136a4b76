"""Stage-time models of the BiDiRL paper's appendix ("Stage-Time Models") and what they are built from.

* :mod:`~bidirl.perf.flops` — trainer F(b), stage multipliers m_s, prefill F_pre;
* :mod:`~bidirl.perf.overlap` — the p-norm overlap of compute and communication;
* :mod:`~bidirl.perf.trainer` — :class:`TrainerModel` (t_s(b), T_t,rep, M_t, chunk times);
* :mod:`~bidirl.perf.rollout` — :class:`RolloutModel` (b_kv, N_max, P_pre, P_dec, T_r,rep, M_r, per-iteration cost);
* :mod:`~bidirl.perf.params` — the parameter dataclasses (``TrainerParams``, ``RolloutParams``) and their
  preset-derived defaults;
* :mod:`~bidirl.perf.fit` — least-squares fit to profiling records with an error report;
* :mod:`~bidirl.perf.costs` — hot-switch costs and weight-sync time from state sizes and bandwidths;
* :mod:`~bidirl.perf.memory` — per-GPU memory of a replica (the planner's feasible layouts) and the device budget of
  an engine run's trainer slot (``DeviceBudget``);
* :mod:`~bidirl.perf.workload` — seeded prompt/response length draws from a dataset's statistics;
* :mod:`~bidirl.perf.balance` — balanced assignment of work to replicas (replica-max semantics);
* :mod:`~bidirl.perf.replica` — the continuous-batching replica model (simulator and emulated workers);
* :mod:`~bidirl.perf.predictor` — the stage-time predictor every driver and the coordinator use.

Names are resolved lazily (PEP 562), so importing one submodule (the planner needs ``memory`` and the
models) does not import scipy, which only calibration needs.
"""

from __future__ import annotations

import importlib

# eager: the function shares its name with its submodule, and binding it here keeps ``bidirl.perf.overlap``
# the function once the submodule has been imported by the models
from bidirl.perf.overlap import overlap  # noqa: F401

_LAZY = {
    "CalibrationResult": "fit", "calibrate_rollout": "fit", "calibrate_trainer": "fit",
    "validate_records": "fit",
    "derive_switch_costs": "costs", "derive_weight_sync": "costs",
    "STAGES": "flops", "STAGE_MULTIPLIER": "flops", "forward_flops": "flops", "prefill_flops": "flops",
    "sample_forward_flops": "flops", "stage_multiplier": "flops",
    "default_rollout_params": "params", "default_trainer_params": "params",
    "RolloutFeatures": "rollout", "RolloutModel": "rollout", "RolloutParams": "params",
    "TrainerModel": "trainer", "TrainerParams": "params",
    "sample_groups": "workload", "sample_lengths": "workload",
}

__all__ = sorted([*_LAZY, "overlap"])


def __getattr__(name: str):
    try:
        module = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'bidirl.perf' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"bidirl.perf.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_LAZY))
