"""Planner and stage-time model speed (what ``bidirl bench`` reports; timing is never asserted in tests).

* ``planner_g4096``: Algorithm 1 over G = 4,096 GPUs with placement ``any`` (4,095 candidate partitions) for
  the paper's default job scaled to 1,024 prompts × 8 (256 with ``--quick``);
* ``rollout_mr``: one M_r evaluation for 1,024 requests with responses of up to 4,096 tokens (Qwen3-VL-4B on
  A6000, Geo3K lengths), on 1 and on 8 replicas;
* ``trainer_mt``: one M_t evaluation of the same samples (three stages, micro-batch 4 per device) on 8 replicas;
  and the same on the ``cpu-calibrated`` preset with the tiny model, whose fitted cache-spill cost β_mem makes each
  chunk's time depend on its replicas' tokens as well as their FLOPs (:func:`bidirl.perf.trainer.spill_bytes`), on 8
  replicas and for every gang size from 1 to 16 at once (the planner's ``stage_times``).

Each function returns ``{figure: (value, unit)}``; the command line repeats it and reports medians.
"""

from __future__ import annotations

import time

import numpy as np

from bidirl.job import config, presets
from bidirl.job.planner import plan
from bidirl.perf.rollout import RolloutModel
from bidirl.perf.trainer import TrainerModel
from bidirl.perf.workload import sample_groups


def bench_plan_4096(quick: bool = False) -> dict:
    cfg = config.load("a6000-default").with_overrides({
        "cluster.gpus": 4096, "cluster.placement": "any", "cluster.partition": None,
        "workload.prompts_per_step": 256 if quick else 1024})
    t0 = time.perf_counter()
    result = plan(cfg)
    dt = time.perf_counter() - t0
    n = len(result.sweep)
    return {"plan_seconds": (dt, "s"), "candidates": (n, "partitions"),
            "candidates_per_second": (n / dt, "partitions/s")}


def _batch(n_groups: int = 128, max_len: int = 4096):
    stats = presets.workload("geo3k")
    return sample_groups(stats, max_len, n_groups, 8, np.random.default_rng([0, 4096]))


def _per_call(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def bench_rollout_mr(quick: bool = False) -> dict:
    model = RolloutModel(presets.model("qwen3-vl-4b"), presets.hardware("a6000"))
    p, r = _batch()
    calls = 3 if quick else 10
    return {"m_r_1024req_4096tok_d1_seconds": (_per_call(lambda: model.stage_time(p, r, 1, 8), calls), "s"),
            "m_r_1024req_4096tok_d8_seconds": (_per_call(lambda: model.stage_time(p, r, 8, 8), calls), "s")}


def bench_trainer_mt(quick: bool = False) -> dict:
    model = TrainerModel(presets.model("qwen3-vl-4b"), presets.hardware("a6000"), layout=4)
    p, r = _batch()
    calls = 3 if quick else 10
    spilling = TrainerModel(presets.model("tiny"), presets.hardware("cpu-calibrated"))
    return {"m_t_1024samples_d8_seconds": (_per_call(lambda: model.stage_time(p, r, 8, 4), calls), "s"),
            "m_t_spill_cpu_1024samples_d8_seconds": (_per_call(lambda: spilling.stage_time(p, r, 8, 4), calls), "s"),
            "m_t_spill_cpu_1024samples_d1to16_seconds": (
                _per_call(lambda: spilling.stage_times(p, r, range(1, 17), 4), calls), "s")}


BENCHMARKS = {"planner_g4096": bench_plan_4096, "rollout_mr": bench_rollout_mr, "trainer_mt": bench_trainer_mt}
