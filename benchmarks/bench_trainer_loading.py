"""Host memory of a trainer rank while its gang loads the model: the whole model then sharded vs its shards alone.

Issue #23 item 6. A gloo gang of ``world`` ranks on CPU (each a spawned process) loads a Qwen3-shaped model with
seeded random fp32 weights (:func:`benchmarks.bench_trainer_scale.make_model`) twice, in fresh processes each time:
``TrainerEngine(gang=False)`` — ``from_pretrained`` of the whole model, then FSDP2 shards it at
``init_process_group`` — and ``TrainerEngine(gang=True)`` — the model built on the meta device, sharded, and each
rank's rows read from the safetensors file. Per rank: the growth of the process's resident memory from just before
the engine is built (modules imported) to its peak while building and joining (``VmHWM``, reset first through
``/proc/self/clear_refs``) and to what stays afterwards (``VmRSS``), the rank's weight bytes (its shards), and the
seconds. Resident memory counts the pages of the checkpoint file a rank has mapped and read (page cache the kernel
can drop, not memory the rank allocated), so the peak is also split into anonymous and file-backed memory
(``RssAnon`` / ``RssFile``, each's largest growth sampled every half millisecond by a thread of the rank).
``--size``: ``medium`` (default; 88 M parameters, ``benchmarks/trainer_scale.md``, "Loading"), ``small`` (quick).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from pathlib import Path


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _rank(rank: int, world: int, addr: str, folder: str, gang: bool, out: str) -> None:
    import threading

    import torch
    import transformers.models.qwen3.modeling_qwen3  # noqa: F401  (imported before the baseline)
    from bidirl.cluster.engines.workers.trainer import TrainerEngine

    kinds = ("RssAnon", "RssFile")
    start = {k: _status(k) for k in kinds}
    peak = dict.fromkeys(kinds, 0)
    done = threading.Event()

    def sample():
        while not done.wait(0.0005):
            for k in kinds:
                peak[k] = max(peak[k], _status(k) - start[k])
    sampler = threading.Thread(target=sample)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                                   # VmHWM := VmRSS: the peak from here on
    base = _status("VmRSS")
    sampler.start()
    t0 = time.perf_counter()
    engine = TrainerEngine(folder, threads=1, gang=gang)
    engine.init_process_group(rank, world, addr)
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    torch.save({"peak": _status("VmHWM") - base, "after": _status("VmRSS") - base, "seconds": seconds,
                "anon": peak["RssAnon"], "file": peak["RssFile"],
                "weights": sum(p.to_local().numel() * 4 for p in engine.params), "numel": engine.numel},
               os.path.join(out, f"{int(gang)}-{rank}.pt"))
    engine.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(size: str = "medium", world: int = 2) -> dict:
    """Per-rank figures, the largest over the gang's ranks (MB = 2**20 bytes)."""
    import torch
    import torch.multiprocessing as mp
    from benchmarks.bench_trainer_scale import make_model

    fig = {}
    with tempfile.TemporaryDirectory(prefix="bidirl-loading-") as tmp:
        folder = make_model(size, Path(tmp) / "model", "cpu")
        for gang, label in ((False, "whole"), (True, "sharded")):
            mp.spawn(_rank, args=(world, f"127.0.0.1:{_free_port()}", str(folder), gang, tmp), nprocs=world, join=True)
            ranks = [torch.load(Path(tmp) / f"{int(gang)}-{r}.pt") for r in range(world)]
            fig[f"{label}_peak_rss_growth_mb"] = max(r["peak"] for r in ranks) / 2**20
            fig[f"{label}_peak_anon_growth_mb"] = max(r["anon"] for r in ranks) / 2**20
            fig[f"{label}_peak_file_growth_mb"] = max(r["file"] for r in ranks) / 2**20
            fig[f"{label}_rss_after_mb"] = max(r["after"] for r in ranks) / 2**20
            fig[f"{label}_seconds"] = max(r["seconds"] for r in ranks)
        fig["rank_weights_mb"] = max(r["weights"] for r in ranks) / 2**20
        fig["model_fp32_mb"] = ranks[0]["numel"] * 4 / 2**20
        fig["params_m"] = ranks[0]["numel"] / 1e6
    return fig


def bench_trainer_loading(quick: bool, size: str = None) -> dict:
    from benchmarks.bench_trainer_scale import SIZES
    size = size or ("small" if quick else "medium")
    if size not in SIZES:
        from bidirl.errors import BidirlError
        raise BidirlError(f"trainer_loading: --size must be one of {', '.join(SIZES)}, got {size!r}")
    return {k: (v, "M" if k == "params_m" else "s" if k.endswith("seconds") else "MB")
            for k, v in measure(size).items()}


BENCHMARKS = {"trainer_loading": bench_trainer_loading}

if __name__ == "__main__":
    import json
    import sys
    print(json.dumps(measure(sys.argv[1] if len(sys.argv) > 1 else "medium"), indent=1))
