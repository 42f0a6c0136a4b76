"""The trainer engine at a real model's shape: per-micro-batch stage times, the optimizer step, the hot switch.

Issue #23's benchmark (paper §3.2 C_in / C_out, §5.2 C_grad, Algorithm 2: a hot switch and a borrowed window must
cost a few seconds against tens of seconds of bubble). A Qwen3-shaped causal LM with random weights (seed 0) of
the chosen size is saved as a transformers folder and loaded by one :class:`TrainerEngine` rank (bf16-mixed on
CUDA, fp32 on CPU). Per micro-batch of ``MB`` samples of ``P`` prompt + ``R`` response tokens it measures
(medians of ``reps`` runs after one warm-up):

* ``old_logprob`` — :meth:`TrainerEngine.logprobs`;
* ``actor_update`` — :meth:`TrainerEngine.chunk_gradients` as the primary gang's chunk path runs it (the gradient
  kept for the optimizer step), and ``fwd_bwd`` — the same loss's forward + backward alone (the model's own
  forward with the LM head on response positions only; no gradient bookkeeping), and their ratio;
* ``host_rss_per_chunk`` — host resident memory growth per kept chunk gradient (chunks two and three of a step:
  the first allocates the gradient buffer itself);
* ``apply`` — the optimizer step over those three chunks (the first: it creates AdamW's state), and
  ``apply_steady`` — the median of ``reps`` later ones over one chunk each (the state exists);
* ``offload`` / ``onload`` — the engine's weights + AdamW state moved out and back (second switch: what a
  steady-state hot switch pays), with the bytes moved and GB/s;
* ``peak_device_gb`` — peak device memory of an update micro-batch (CUDA only);
* ``snapshot_*`` — the recovery snapshot a primary rank writes every ``recovery.snapshot_every`` steps: the copy
  the gang waits for (``snapshot_copy``), the background write to local disk (``snapshot_write``) and its size;
  nothing of it goes through Ray's object store;
* ``window_*`` — C_grad for one rank pair: an auxiliary rank's window (its gradient shard, fp32) sent to a primary
  rank over the transport (:func:`bidirl.cluster.engines.workers.bridge.send_shard` / ``receive_shard``, gloo through
  the host here: both ends in this process), seconds and GB/s. The bytes a whole run puts into Ray's object store
  by kind are counted driver-level by ``bench weight_sync`` (``benchmarks/weight_sync.md``).

``--size``: ``tiny`` (seconds on CPU), ``small`` (about a minute on CPU; the figures in
``benchmarks/trainer_scale.md``), ``4b`` / ``8b`` (Qwen3-4B / -8B shapes; a GPU). With ``BIDIRL_TRAINER_SCALE_OUT``
set the measured stage times are also written as profiling records (``trainer.csv`` + ``meta.json`` in
``bidirl profile``'s format, :mod:`bidirl.calibrate.records`) into that folder.
"""

from __future__ import annotations

import inspect
import os
import statistics
import tempfile
import time
from pathlib import Path

#: Qwen3 shapes: (vocab, hidden, intermediate, layers, heads, kv heads, head dim, tied)
SIZES = {
    "tiny": (2048, 64, 128, 2, 4, 2, 16, True),
    "small": (32768, 256, 768, 4, 4, 2, 64, True),
    "medium": (32768, 768, 2048, 6, 12, 4, 64, False),     # 88 M parameters (bench_trainer_loading)
    "4b": (151936, 2560, 9728, 36, 32, 8, 128, True),
    "8b": (151936, 4096, 12288, 36, 32, 8, 128, False),
}
#: micro-batch per size: (samples, prompt tokens, response tokens)
MICRO_BATCH = {"tiny": (4, 16, 32), "small": (4, 64, 256), "medium": (4, 64, 256), "4b": (4, 512, 1024),
               "8b": (4, 512, 1024)}


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def make_model(size: str, folder: Path, device: str) -> Path:
    """A Qwen3-shaped model of ``size`` with seeded random weights saved (bf16 on CUDA) into ``folder``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    v, h, i, n, heads, kv, hd, tied = SIZES[size]
    cfg = Qwen3Config(vocab_size=v, hidden_size=h, intermediate_size=i, num_hidden_layers=n, num_attention_heads=heads,
                      num_key_value_heads=kv, head_dim=hd, tie_word_embeddings=tied, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    if device == "cuda":
        model = model.to(torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def _samples(n: int, prompt: int, response: int, vocab: int, offset: int):
    import torch
    from bidirl.rl.samples import Sample

    g = torch.Generator().manual_seed(offset)
    return [Sample(offset + k // 4, k % 4, tuple(torch.randint(0, vocab, (prompt,), generator=g).tolist()),
                   tuple(torch.randint(0, vocab, (response,), generator=g).tolist()), (), float(k % 2), 0)
            for k in range(n)]


def measure(size: str = "small", reps: int = 3, out: str = None, report=None) -> dict:
    """The figures of one engine rank at ``size`` (see the module docstring). ``report(name, value)``, if given, is
    called with each figure as soon as it is measured (a run at 4B takes minutes; a failure late in it keeps what
    came before)."""
    import torch
    from bidirl.cluster.engines.workers.trainer import TrainerEngine
    from bidirl.rl import grpo

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(fn, n=reps):
        fn()
        ts = []
        for _ in range(n):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts), ts

    mb, P, R = MICRO_BATCH[size]
    with tempfile.TemporaryDirectory(prefix="bidirl-trainer-scale-") as tmp:
        folder = make_model(size, Path(tmp) / "model", device)
        eng = TrainerEngine(folder, lr=1e-6, device=device, precision="auto", max_grad_norm=1.0,
                            threads=None if cuda else 1)      # one thread on CPU: steadier on a shared machine
        vocab = SIZES[size][0]
        samples = _samples(mb, P, R, vocab, 0)
        adv = grpo.group_advantages(torch.tensor([s.reward for s in samples]), group_size=4).float()
        norm = grpo.loss_normalizer([s.response_len for s in samples])
        old = eng.logprobs(samples)
        kept_path = "accumulate" in inspect.signature(eng.chunk_gradients).parameters
        kw = {"accumulate": True} if kept_path else {}
        fig, times = _Figures(report), {}

        fig["old_logprob"], times["old_logprob"] = timed(lambda: eng.logprobs(samples))

        def update():
            return eng.chunk_gradients(samples, adv, old, normalizer=norm, **kw)

        def drop():
            for p in eng.params:
                p.grad = None

        def update_and_drop():
            update()
            drop()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        fig["actor_update"], times["actor_update"] = timed(update_and_drop)
        if cuda:
            fig["peak_device_gb"] = torch.cuda.max_memory_allocated() / 2**30
            fig["peak_device_beyond_state_gb"] = (torch.cuda.max_memory_allocated() - base) / 2**30

        # the same loss's forward + backward alone: LM head on response positions only, nothing kept
        ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids) for s in samples], device=device)
        tgt = ids[:, P:]
        oldt = torch.stack([torch.as_tensor(o) for o in old]).to(device)

        def fwd_bwd():
            eng.model.train()
            logits = eng.model(input_ids=ids, use_cache=False, logits_to_keep=R + 1).logits[:, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, tgt[..., None]).squeeze(-1)
            ((torch.exp(lp - oldt) * adv[:, None].to(device)).sum() / norm).backward()
            eng.model.eval()
            drop()
        fig["fwd_bwd"], times["fwd_bwd"] = timed(fwd_bwd)
        fig["actor_update_over_fwd_bwd"] = fig["actor_update"] / fig["fwd_bwd"]

        drop()
        grads = [update()]              # the first chunk allocates the gradient itself (once per step, both paths)
        rss0 = _rss()
        grads += [update() for _ in range(2)]
        fig["host_rss_per_chunk_mb"] = max(0, _rss() - rss0) / 2 / 2**20
        sync()
        t = time.perf_counter()
        eng.apply(grads)
        sync()
        fig["apply"] = time.perf_counter() - t             # the first optimizer step: AdamW's moments are created
        steady = []
        for _ in range(reps):                              # later steps: the state exists (what every step pays)
            grads = [update()]
            sync()
            t = time.perf_counter()
            eng.apply(grads)
            sync()
            steady.append(time.perf_counter() - t)
        fig["apply_steady"] = statistics.median(steady)
        del grads

        # the recovery snapshot: the copy the gang waits for, the write to local disk beside it
        with tempfile.TemporaryDirectory() as snapshots:
            fig["snapshot_copy"] = eng.save_snapshot(snapshots, eng.version)
            written = eng.flush_snapshot()
        if "error" in written:
            raise RuntimeError(f"trainer_scale: the recovery snapshot could not be written: {written['error']}")
        fig["snapshot_write"], fig["snapshot_gb"] = written["seconds"], written["bytes"] / 2**30
        for name, value in _window_transfer(eng.local_numel, device).items():
            fig[name] = value
        nbytes = eng.state_bytes()
        fig["state_gb"] = nbytes / 2**30
        for k in range(2):           # the second switch is the steady state (buffers exist by then, if kept)
            off, on = eng.offload(), eng.onload()
            if k == 0:
                fig["offload_first"], fig["onload_first"] = off, on
        fig["offload"], fig["onload"] = off, on
        fig["offload_gbps"], fig["onload_gbps"] = nbytes / off / 1e9, nbytes / on / 1e9
        fig["params_m"] = eng.numel / 1e6
        if out:
            _write_records(out, size, device, (mb, P, R), times, eng)
    return dict(fig)


class _Figures(dict):
    """The figures measured so far; each one is also passed to ``report`` as it is set."""

    def __init__(self, report=None):
        super().__init__()
        self._report = report

    def __setitem__(self, name, value):
        super().__setitem__(name, value)
        if self._report is not None:
            self._report(name, value)


def _window_transfer(numel: int, device: str) -> dict:
    """C_grad of one rank pair: a window's shard of ``numel`` fp32 values from a sender thread to this thread over
    the transport's two-rank group (a fresh rendezvous, as the engine driver opens one per window)."""
    import threading

    import torch
    from bidirl.cluster.engines.workers import bridge
    from bidirl.cluster.engines.workers.weight_transport import DEFAULT_BUCKET_MB, Rendezvous

    flat = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(device)
    rendezvous = Rendezvous("127.0.0.1")
    times = []
    for _ in range(3):
        transfer = rendezvous.open(["primary/0"], 0, bridge.window_layout(numel, int(DEFAULT_BUCKET_MB * 2**20)), 120.0)
        sender = threading.Thread(target=bridge.send_shard, args=(transfer, flat, device))
        t = time.perf_counter()
        sender.start()
        got, _ = bridge.receive_shard(transfer, 1, numel, device)
        sender.join()
        times.append(time.perf_counter() - t)
        rendezvous.close(transfer.tid)
        assert torch.equal(got, flat)
    seconds = statistics.median(times)
    return {"window_transfer": seconds, "window_gb": numel * 4 / 2**30, "window_gbps": numel * 4 / seconds / 1e9}


def _write_records(folder, size, device, shape, times, eng) -> None:
    """The stage times as ``bidirl profile`` trainer records (one row per measured micro-batch)."""
    import platform
    from datetime import datetime, timezone

    import torch
    from bidirl.calibrate import records

    mb, P, R = shape
    rows = [{"point": 0, "rep": k, "stage": stage, "batch": max(1, mb // 4), "requests": mb, "prompt_len": P,
             "response_len": R, "d": 1, "observed": t}
            for stage in ("old_logprob", "actor_update") for k, t in enumerate(times[stage])]
    meta = {"model": f"qwen3-{size}", "hardware": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
            "grid": {"name": "trainer_scale", "micro_batch": [mb, P, R]}, "seed": 0,
            "engines": {"torch": torch.__version__}, "machine": {"system": platform.system(),
                                                                 "machine": platform.machine(),
                                                                 "cpus": os.cpu_count()},
            "settings": {"precision": eng.precision, "device": device},
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    records.save_trainer_records(folder, meta, records.records_frame(rows, "trainer"))


UNITS = {"state_gb": "GB", "snapshot_gb": "GB", "window_gb": "GB", "window_gbps": "GB/s",
         "offload_gbps": "GB/s", "onload_gbps": "GB/s", "host_rss_per_chunk_mb": "MB",
         "peak_device_gb": "GB", "peak_device_beyond_state_gb": "GB", "actor_update_over_fwd_bwd": "x",
         "params_m": "M"}


def bench_trainer_scale(quick: bool, size: str = None) -> dict:
    size = size or ("tiny" if quick else "small")
    if size not in SIZES:
        from bidirl.errors import BidirlError
        raise BidirlError(f"trainer_scale: --size must be one of {', '.join(SIZES)}, got {size!r}")
    fig = measure(size, reps=3, out=os.environ.get("BIDIRL_TRAINER_SCALE_OUT"))
    return {k: (v, UNITS.get(k, "s")) for k, v in fig.items()}


BENCHMARKS = {"trainer_scale": bench_trainer_scale}

if __name__ == "__main__":
    import json
    import sys
    print(json.dumps(measure(sys.argv[1] if len(sys.argv) > 1 else "small",
                             report=lambda k, v: print(f"{k} = {v}", file=sys.stderr, flush=True)), indent=1))
