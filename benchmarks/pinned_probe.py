"""Page-locked host memory on this machine's GPU: what PyTorch's ``pin_memory=True`` really allocates and how long
it takes, against the hot switch's own buffer (:class:`bidirl.cluster.engines.workers.host_buffer.PinnedMemory`:
exact size, page-locked by several threads), and the copy rates through each (issue 38; figures in
``benchmarks/trainer_scale.md``). CUDA only; prints JSON. ``python benchmarks/pinned_probe.py [GiB]``."""

from __future__ import annotations

import json
import sys
import time

import torch

from bidirl.cluster.engines.workers.host_buffer import PinnedMemory


def _timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


def probe(gib: float = 6.0) -> dict:
    """``gib`` GiB (not a power of two, so PyTorch's rounding shows) allocated each way, then copied device → host
    and back through it."""
    n = int(gib * 2**30)
    fig = {"asked_gib": gib}
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    mem, fig["register_s"] = _timed(lambda: PinnedMemory(n))
    fig["register_is_pinned"] = int(mem.tensor.is_pinned())
    _, t = _timed(lambda: mem.tensor.copy_(src, non_blocking=True))
    fig["register_d2h_gbs"] = n / t / 1e9
    _, t = _timed(lambda: src.copy_(mem.tensor, non_blocking=True))
    fig["register_h2d_gbs"] = n / t / 1e9
    mem.close()
    del mem
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    buf, fig["torch_pin_s"] = _timed(lambda: torch.empty(n, dtype=torch.uint8, pin_memory=True))
    fig["torch_pin_gib_held"] = (torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) - before) / 2**30
    _, t = _timed(lambda: buf.copy_(src, non_blocking=True))
    fig["torch_pin_d2h_gbs"] = n / t / 1e9
    return fig


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        sys.exit(0)
    print(json.dumps(probe(float(sys.argv[1]) if len(sys.argv) > 1 else 6.0), indent=1))
