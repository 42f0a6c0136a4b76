"""The whole cycle a primary trainer rank runs in a real run, on one device: each step's time and peak device memory.

Issue 38: ``bench trainer_scale`` measures the trainer's stages alone; the paths a run takes *between* them —
publishing a version, switching out and back with published versions held, receiving an auxiliary window beside
the step's gradient, a recovery snapshot overlapped with the next chunk — had never run on a GPU. This benchmark
runs them in the order a run does, on one :class:`~bidirl.cluster.engines.workers.trainer.TrainerEngine` rank
(bf16-mixed on CUDA, fp32 on CPU; the wire dtype the rollouters' own), through the same calls the Ray actor makes:

``load`` → ``chunk_1``, ``chunk_2`` (accumulated on the device, as the primary gang's chunks) → ``window``
(an auxiliary rank's window shard, fp32, received from a sender thread over the transport: gloo through the host,
both ends on this one device) → ``apply`` (the chunks and the window) → ``publish`` (version 1 in the wire dtype)
→ ``snapshot`` (the recovery snapshot's start) → ``chunk_3`` (beside the snapshot's copy) → ``offload_first``
(waits for the copy; the first switch of the engine's life) → ``onload_first`` → ``apply_2`` → ``publish_2``
(version 2, keeping 1) → ``offload`` / ``onload`` (the steady switch, two versions held) → ``snapshot_write``
(the write to local disk, waited for at the end).

Figures: ``<step>_s`` (seconds), ``<step>_peak_gb`` (the device's peak allocated memory during the step, CUDA
only), ``cycle_peak_gb`` (over the whole cycle), ``snapshot_wait_s`` (what the first call that changes or frees the
state waited for the snapshot's copy), ``host_buffer_allocations`` (once per engine: it is reserved when the engine
is loaded) and ``budget_peak_gb``, the device budget's prediction of the cycle's peak (:func:`budget_prediction`).

``--size``: ``4b`` / ``8b`` (Qwen3-4B / -8B shapes) need a CUDA device and are skipped elsewhere with a message;
``tiny`` / ``small`` run anywhere (a test runs ``tiny`` on CPU: the same code path).
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.bench_trainer_scale import MICRO_BATCH, SIZES, _samples, make_model

#: sizes that need a GPU (a CPU would take hours and more memory than the machine has)
GPU_SIZES = ("4b", "8b")
#: the auxiliary window's chunk ids (two chunks computed on the rollout pool)
WINDOW_CHUNKS = (100, 101)


def budget_prediction(size: str, device: str, micro_batch: tuple, numel: int) -> float:
    """The device budget's prediction of this cycle's peak bytes (``bidirl.perf.memory.device_budget``): a primary
    rank of one GPU at ``size``'s shape (``numel`` parameters, the engine's own count) and ``micro_batch``
    (samples, prompt tokens, response tokens), receiving one window, on the collective path, with checkpointing as
    the engine resolves it (on for CUDA, off on CPU). The benchmark runs the rank alone: no rollouter shares its
    device and no send runs during the cycle's peaks, so ``rollout_beside`` and ``transport_buckets`` are left out
    of the prediction (the budget counts both for a run's trainer slot)."""
    from bidirl.job.presets import ModelSpec, hardware
    from bidirl.perf import memory

    v, h, i, n, heads, kv, hd, tied = SIZES[size]
    embed = v * h * (1 if tied else 2)
    spec = ModelSpec(name=f"bench-{size}", layers=n, hidden=h, intermediate=i, heads=heads, kv_heads=kv,
                     head_dim=hd, vocab=v, tie_word_embeddings=tied, params_total=float(numel),
                     params_nonembedding=float(numel - embed), dtype_bytes=2 if device == "cuda" else 4)
    samples, prompt, response = micro_batch
    budget = memory.device_budget(spec, hardware("h100"), 1, micro_batch_per_device=samples,
                                  max_seq_len=prompt + response, device=device, windows=1, gang_ranks=1,
                                  checkpointing=device == "cuda")
    phases = {}
    for phase, terms in memory.BUDGET_PHASES.items():
        phases[phase] = sum(getattr(budget, t) for t in terms if t not in ("rollout_beside", "transport_buckets"))
    return max(phases.values())


def _receive_window(engine, numel: int, device: str) -> dict:
    """An auxiliary rank's window shard (seeded values) sent from a thread and received by ``engine`` as the primary
    rank of a one-receiver transfer (``TrainerEngine.receive_window``); returns its report with the transfer id."""
    import torch

    from bidirl.cluster.engines.workers import bridge
    from bidirl.cluster.engines.workers.weight_transport import DEFAULT_BUCKET_MB, Rendezvous

    flat = torch.randn(numel, generator=torch.Generator().manual_seed(1)).mul_(1e-3).to(device)
    rendezvous = Rendezvous("127.0.0.1")
    layout = bridge.window_layout(numel, int(DEFAULT_BUCKET_MB * 2**20))
    transfer = rendezvous.open(["primary/0"], engine.version, layout, 120.0)
    sender = threading.Thread(target=bridge.send_shard, args=(transfer, flat, device), daemon=True)
    sender.start()
    try:
        report = engine.receive_window(transfer, 1)
    finally:
        sender.join()
        rendezvous.close(transfer.tid)
    return report


def cycle(size: str = "tiny") -> dict:
    """Run the cycle (module docstring) at ``size`` on this machine's device; returns the figures."""
    import torch

    from bidirl.cluster.engines.workers.trainer import TrainerEngine
    from bidirl.cluster.engines.workers.weight_transport import wire_dtype
    from bidirl.rl import grpo

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    wire = wire_dtype(cuda)
    fig: dict = {}

    def step(name: str, fn):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        fig[f"{name}_s"] = time.perf_counter() - t
        if cuda:
            peak = torch.cuda.max_memory_allocated()
            fig[f"{name}_peak_gb"] = peak / 2**30
            fig["cycle_peak_gb"] = max(fig.get("cycle_peak_gb", 0.0), peak / 2**30)
        return out

    mb, P, R = MICRO_BATCH[size]
    with tempfile.TemporaryDirectory(prefix="bidirl-gpu-path-") as tmp:
        folder = make_model(size, Path(tmp) / "model", device)
        eng = step("load", lambda: TrainerEngine(folder, lr=1e-6, device=device, precision="auto", max_grad_norm=1.0,
                                                 threads=None if cuda else 1, publish_dtype=wire))
        samples = _samples(mb, P, R, SIZES[size][0], 0)
        adv = grpo.group_advantages(torch.tensor([s.reward for s in samples]), group_size=4).float()
        norm = grpo.loss_normalizer([s.response_len for s in samples])
        old = eng.logprobs(samples)

        def chunk(cid: int):
            return lambda: eng.chunk_gradients(samples, adv, old, normalizer=norm, accumulate=True, chunk_id=cid)
        step("chunk_1", chunk(0))
        step("chunk_2", chunk(1))
        window = step("window", lambda: _receive_window(eng, eng.local_numel, device))
        fig["window_gb"] = window["bytes"] / 2**30 if "bytes" in window else eng.local_numel * 4 / 2**30
        step("apply", lambda: eng.apply(windows={window["tid"]: list(WINDOW_CHUNKS)}))
        step("publish", lambda: eng.publish(eng.version, wire))
        with tempfile.TemporaryDirectory(prefix="bidirl-gpu-path-snapshots-") as snapshots:
            step("snapshot", lambda: eng.save_snapshot(snapshots, eng.version))
            step("chunk_3", chunk(2))
            step("offload_first", eng.offload)
            fig["snapshot_wait_s"] = eng.snapshot_waits.get("offload", 0.0)
            step("onload_first", eng.onload)
            step("apply_2", eng.apply)
            step("publish_2", lambda: eng.publish(eng.version, wire, keep=[eng.version - 1]))
            step("offload", eng.offload)
            step("onload", eng.onload)
            written = step("snapshot_write", eng.flush_snapshot)
        if "error" in written:
            raise RuntimeError(f"gpu_path: the recovery snapshot could not be written: {written['error']}")
        fig["state_gb"] = eng.state_bytes() / 2**30
        fig["host_buffer_allocations"] = eng.host_buffer_allocations
        fig["budget_peak_gb"] = budget_prediction(size, device, (mb, P, R), eng.numel) / 2**30
    return fig


def units(name: str) -> str:
    if name.endswith("_s"):
        return "s"
    if name.endswith("_gb"):
        return "GB"
    return "count"


def bench_gpu_path(quick: bool, size: str = None) -> dict:
    import torch

    from bidirl.errors import BidirlError

    size = size or ("4b" if torch.cuda.is_available() and not quick else "tiny")
    if size not in SIZES:
        raise BidirlError(f"gpu_path: --size must be one of {', '.join(SIZES)}, got {size!r}")
    if size in GPU_SIZES and not torch.cuda.is_available():
        print(f"gpu_path: skipped: --size {size} runs the cycle on a CUDA GPU and this torch sees none; "
              "--size tiny runs the same cycle on CPU", file=sys.stderr)
        return {}
    return {k: (v, units(k)) for k, v in cycle(size).items()}


BENCHMARKS = {"gpu_path": bench_gpu_path}

if __name__ == "__main__":
    import json
    print(json.dumps(bench_gpu_path(False, sys.argv[1] if len(sys.argv) > 1 else None), indent=1))
