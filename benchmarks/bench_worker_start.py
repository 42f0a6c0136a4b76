"""What one engine worker's start costs on this machine: CPU seconds of a fresh process that builds an engine.

A run's workers start as fresh processes (Ray actors), and a start is mostly CPU work that repeats per process:
imports (torch, transformers, vLLM), the engine's set-up, the warm-up generation. On a machine with few cores, a
run's start-up — and most of the test suite's time (``docs/architecture.md``, "How it is tested") — is the sum of
these. Each call starts, for each kind, a fresh Python process that does what the actor's ``__init__`` does —
imports ``bidirl.cluster.engines.workers.actors`` (Ray), then imports and builds a ``RolloutEngine`` (vLLM) or a
one-rank ``TrainerEngine`` of the built-in tiny model — once with the garbage collector paused around the start
(as the actors do, ``actors._collector_paused``) and once without, and reports the process's CPU time
(``time.process_time``: every thread) and wall time from interpreter start to a built engine, and the ratio of the
two variants' CPU time, measured side by side.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

#: run in a fresh interpreter: argv = kind, model folder, "paused" | "collecting"
_CHILD = r"""
import json, sys, time
w0 = time.perf_counter()
kind, model_dir, mode = sys.argv[1:4]
from bidirl.cluster.engines.workers import actors
import contextlib
with (actors._collector_paused() if mode == "paused" else contextlib.nullcontext()):
    if kind == "rollouter":
        from bidirl.cluster.engines.workers.rollout import RolloutEngine
        engine = RolloutEngine(model_dir, max_model_len=64)
    else:
        from bidirl.cluster.engines.workers.trainer import TrainerEngine
        engine = TrainerEngine(model_dir, threads=1)
print(json.dumps({"cpu_s": time.process_time(), "wall_s": time.perf_counter() - w0}))
"""

KINDS = ("rollouter", "trainer")


def _start(kind: str, model_dir: str, mode: str) -> dict:
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR")
    done = subprocess.run([sys.executable, "-c", _CHILD, kind, model_dir, mode], capture_output=True, text=True,
                          env=env, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the {kind} start ({mode}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_worker_start(quick: bool) -> dict:
    from bidirl.rl.bootstrap import ensure_tiny_model

    model_dir = str(ensure_tiny_model())
    out = {}
    for kind in KINDS:
        runs = {mode: _start(kind, model_dir, mode) for mode in ("paused", "collecting")}
        for mode, r in runs.items():
            out[f"{kind}.{mode}.cpu_s"] = (r["cpu_s"], "s")
            out[f"{kind}.{mode}.wall_s"] = (r["wall_s"], "s")
        out[f"{kind}.cpu_ratio_collecting_over_paused"] = (runs["collecting"]["cpu_s"] / runs["paused"]["cpu_s"], "x")
    return out


BENCHMARKS = {"worker_start": bench_worker_start}
