"""The whole cycle a primary trainer rank runs in a real run, on one device: each step's time and peak device memory.

Issue 38: ``bench trainer_scale`` measures the trainer's stages alone; the paths a run takes *between* them —
publishing a version, switching out and back with published versions held, receiving an auxiliary window beside
the step's gradient, a recovery snapshot overlapped with the next chunk — had never run on a GPU. This benchmark
runs them in the order a run does, on one :class:`~bidirl.cluster.engines.workers.trainer.TrainerEngine` rank
(bf16-mixed on CUDA, fp32 on CPU; the wire dtype the rollouters' own), through the same calls the Ray actor makes:

``load`` → ``publish_0`` (version 0, the weights the rollouters start from) → ``chunk_1``, ``chunk_2``
(accumulated on the device, as the primary gang's chunks) → ``window`` (an auxiliary rank's window shard, fp32,
received from a sender thread over the transport: gloo through the host, both ends on this one device) → ``apply``
(the chunks and the window) → ``publish`` (version 1 in the wire dtype, keeping 0) → ``snapshot`` (the recovery
snapshot's copy starts, into the hot switch's host buffer) → ``chunk_3`` (beside the snapshot's copy) →
``offload_first`` (waits for the copy; the first switch of the engine's life) → ``onload_first`` → ``window_2`` →
``chunk_4`` (with the window held: a run's steady step, two versions and a window beside the chunk) → ``apply_2``
→ ``publish_2`` (version 2, keeping 1) → ``snapshot_write`` (the snapshot's write to local disk, waited for) →
``offload`` / ``onload`` (the steady switch, two versions held).

Figures: ``<step>_s`` (seconds), ``<step>_peak_gb`` (the device's peak allocated memory during the step, CUDA
only) beside ``<step>_predicted_gb`` (the device budget's terms for what the cycle holds at that step,
:func:`step_predictions`), ``cycle_peak_gb`` / ``cycle_predicted_gb`` (over the whole cycle), ``snapshot_wait_s``
(what the first call that changes or frees the state waited for the snapshot's copy), ``host_buffer_allocations``
(once per engine: it is reserved when the engine is loaded), ``host_reserve_s`` (that reservation's page-locking,
in the background), ``offload_first_copied_gb`` (what the first switch copied: the snapshot's copy had put the
weights and moments in place), ``budget_peak_gb`` (the budget a run's trainer slot is checked against, every term)
and, on CUDA, ``budget_fits`` for this card (1: the planner would accept the 4B rank on it), ``cycle_fits``
(the cycle's own prediction within the usable memory), ``cycle_reserved_gb`` (the allocator's peak reserve) and
``outside_allocator_gb`` (the CUDA context and library workspaces): what the ``1 − memory_utilization`` margin
must cover.

``BIDIRL_GPU_PATH_OUT=FILE`` writes the figures measured so far to ``FILE`` (JSON) after every step.

``--size``: ``4b`` / ``8b`` (Qwen3-4B / -8B shapes) need a CUDA device and are skipped elsewhere with a message;
``tiny`` / ``small`` run anywhere (a test runs ``tiny`` on CPU: the same code path).
"""

from __future__ import annotations

import json
import os
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


#: terms of the device budget a lone rank's cycle never holds: no rollouter shares its device, no send runs
EXCLUDED_TERMS = ("rollout_beside", "transport_buckets", "offload_buffer")

#: what the cycle holds at each step that computes (module docstring): the budget's phase, published versions
#: held, windows held, and whether AdamW's moments exist (created by the first step, inside ``apply``)
STEP_HOLDS = {
    "chunk_1": ("chunk", 1, 0, False),
    "chunk_2": ("chunk", 1, 0, False),
    "apply": ("apply", 1, 1, True),
    "chunk_3": ("chunk", 2, 0, True),
    "chunk_4": ("chunk", 2, 1, True),
    "apply_2": ("apply", 2, 1, True),
}


def device_budget_for(size: str, device: str, micro_batch: tuple, numel: int, hw=None):
    """The device budget (``bidirl.perf.memory.device_budget``) of a primary rank of one GPU at ``size``'s shape
    (``numel`` parameters, the engine's own count) and ``micro_batch`` (samples, prompt tokens, response tokens),
    receiving one window, on the collective path, with checkpointing as the engine resolves it (on for CUDA, off on
    CPU), on ``hw`` (default: the H100 preset; the terms do not depend on the card, only ``usable`` does)."""
    from bidirl.job.presets import ModelSpec, hardware
    from bidirl.perf import memory

    v, h, i, n, heads, kv, hd, tied = SIZES[size]
    embed = v * h * (1 if tied else 2)
    spec = ModelSpec(name=f"bench-{size}", layers=n, hidden=h, intermediate=i, heads=heads, kv_heads=kv,
                     head_dim=hd, vocab=v, tie_word_embeddings=tied, params_total=float(numel),
                     params_nonembedding=float(numel - embed), dtype_bytes=2 if device == "cuda" else 4)
    samples, prompt, response = micro_batch
    return memory.device_budget(spec, hw or hardware("h100"), 1, micro_batch_per_device=samples,
                                max_seq_len=prompt + response, device=device, windows=1, gang_ranks=1,
                                checkpointing=device == "cuda")


def step_predictions(budget) -> dict:
    """Bytes the budget's terms predict for each step of :data:`STEP_HOLDS`: the phase's terms but the
    :data:`EXCLUDED_TERMS`, with the published versions, windows and moments the cycle holds at that step (the
    budget counts ``PUBLISHED_KEPT + PUBLISHED_TRANSIENT`` versions and one window; the transient version is a send
    in flight, which a lone rank never has)."""
    from bidirl.perf import memory

    per_version = budget.published_versions / (memory.PUBLISHED_KEPT + memory.PUBLISHED_TRANSIENT)
    out = {}
    for step, (phase, versions, windows, moments) in STEP_HOLDS.items():
        held = {t: float(getattr(budget, t)) for t in memory.BUDGET_PHASES[phase] if t not in EXCLUDED_TERMS}
        held["published_versions"] = versions * per_version
        held["window_shards"] = windows * budget.window_shards
        if "apply_sum" in held and not windows:
            held["apply_sum"] = 0.0
        if not moments:
            held["optimizer_state"] = 0.0
        out[step] = sum(held.values())
    return out


def budget_prediction(size: str, device: str, micro_batch: tuple, numel: int) -> float:
    """The budget a run's trainer slot is checked against (every term of its peak phase), in bytes."""
    return device_budget_for(size, device, micro_batch, numel).peak


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
        if os.environ.get("BIDIRL_GPU_PATH_OUT"):      # a cycle that fails part-way still reports the steps it ran
            Path(os.environ["BIDIRL_GPU_PATH_OUT"]).write_text(json.dumps(fig, indent=1))
        if cuda:
            peak = torch.cuda.max_memory_allocated()
            fig[f"{name}_peak_gb"] = peak / 2**30
            fig["cycle_peak_gb"] = max(fig.get("cycle_peak_gb", 0.0), peak / 2**30)
            fig["cycle_reserved_gb"] = max(fig.get("cycle_reserved_gb", 0.0), torch.cuda.max_memory_reserved() / 2**30)
            free, total = torch.cuda.mem_get_info()
            # what the device holds beyond the allocator's reserve: the CUDA context, cuBLAS / NCCL workspaces
            fig["outside_allocator_gb"] = max(fig.get("outside_allocator_gb", 0.0),
                                              (total - free - torch.cuda.memory_reserved()) / 2**30)
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
        step("publish_0", lambda: eng.publish(eng.version, wire))
        step("chunk_1", chunk(0))
        step("chunk_2", chunk(1))
        window = step("window", lambda: _receive_window(eng, eng.local_numel, device))
        fig["window_gb"] = eng.local_numel * 4 / 2**30
        step("apply", lambda: eng.apply(windows={window["tid"]: list(WINDOW_CHUNKS)}))
        step("publish", lambda: eng.publish(eng.version, wire, keep=[eng.version - 1]))
        with tempfile.TemporaryDirectory(prefix="bidirl-gpu-path-snapshots-") as snapshots:
            step("snapshot", lambda: eng.save_snapshot(snapshots, eng.version))
            step("chunk_3", chunk(2))
            step("offload_first", eng.offload)
            fig["snapshot_wait_s"] = eng.snapshot_waits.get("offload", 0.0)
            fig["offload_first_copied_gb"] = eng._host.copied_bytes / 2**30
            step("onload_first", eng.onload)
            window_2 = step("window_2", lambda: _receive_window(eng, eng.local_numel, device))
            step("chunk_4", chunk(3))
            step("apply_2", lambda: eng.apply(windows={window_2["tid"]: list(WINDOW_CHUNKS)}))
            step("publish_2", lambda: eng.publish(eng.version, wire, keep=[eng.version - 1]))
            written = step("snapshot_write", eng.flush_snapshot)
            step("offload", eng.offload)
            fig["offload_copied_gb"] = eng._host.copied_bytes / 2**30
            step("onload", eng.onload)
        if "error" in written:
            raise RuntimeError(f"gpu_path: the recovery snapshot could not be written: {written['error']}")
        fig["snapshot_write_total_s"] = written.get("seconds", 0.0)
        fig["snapshot_gb"] = written.get("bytes", 0) / 2**30
        fig["snapshot_cloned_gb"] = eng._state_copy.cloned_bytes / 2**30
        fig["state_gb"] = eng.state_bytes() / 2**30
        fig["host_buffer_allocations"] = eng.host_buffer_allocations
        fig["host_buffer_gb"] = eng._host.buffer.numel() / 2**30
        fig["host_reserve_s"] = eng._host.reserve_seconds
        budget = device_budget_for(size, device, (mb, P, R), eng.numel)
        fig["budget_peak_gb"] = budget.peak / 2**30
        predicted = step_predictions(budget)
        for name, held in predicted.items():
            fig[f"{name}_predicted_gb"] = held / 2**30
        fig["cycle_predicted_gb"] = max(predicted.values()) / 2**30
        if cuda:
            import dataclasses

            from bidirl.job.presets import hardware
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            preset = next((k for k in ("h200", "h100", "h20") if k.upper() in props.name.upper()), "h100")
            # the card's preset (its memory_utilization), with the memory this card reports
            card = dataclasses.replace(hardware(preset), name=props.name, memory_bytes=props.total_memory)
            on_card = device_budget_for(size, device, (mb, P, R), eng.numel, card)
            fig["card_gb"] = props.total_memory / 2**30
            fig["budget_usable_gb"] = on_card.usable / 2**30
            fig["budget_fits"] = int(on_card.fits)
            fig["cycle_fits"] = int(fig["cycle_predicted_gb"] * 2**30 <= on_card.usable)
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
    print(json.dumps(bench_gpu_path(False, sys.argv[1] if len(sys.argv) > 1 else None), indent=1))
