"""``bidirl bench --only gpu_path``: the cycle a primary trainer rank runs in a real run, on one device (issue 38).

On CPU with ``--size tiny`` it runs the same code as on a GPU (CUDA only adds the device-memory figures); the
4B / 8B shapes need a GPU and are skipped elsewhere with a message, never run on a CPU.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_gpu_path as gp

STEPS = ("load", "publish_0", "chunk_1", "chunk_2", "window", "apply", "publish", "snapshot", "chunk_3",
         "offload_first", "onload_first", "window_2", "chunk_4", "apply_2", "publish_2", "snapshot_write", "offload",
         "onload")


def test_the_cycle_runs_every_step_of_a_run_on_this_device():
    fig = gp.cycle("tiny")
    missing = [s for s in STEPS if f"{s}_s" not in fig]
    assert not missing, missing
    assert all(fig[f"{s}_s"] >= 0 for s in STEPS)
    assert fig["host_buffer_allocations"] == 1, "the host buffer is reserved once, at load, for both switches"
    assert fig["window_gb"] > 0 and fig["state_gb"] > 0
    # the budget's peak holds the state and, beside it, at least the received window (perf.memory.device_budget)
    assert fig["budget_peak_gb"] > fig["state_gb"] + fig["window_gb"]
    assert ("cycle_peak_gb" in fig) == torch.cuda.is_available()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the skip is for machines without CUDA")
def test_the_4b_cycle_is_skipped_without_a_gpu_and_says_why(capsys):
    assert gp.bench_gpu_path(False, size="4b") == {}
    err = capsys.readouterr().err
    assert "gpu_path: skipped: --size 4b runs the cycle on a CUDA GPU" in err and "--size tiny" in err


def test_a_size_it_does_not_know_is_refused_by_name():
    from bidirl.errors import BidirlError
    with pytest.raises(BidirlError, match="--size must be one of"):
        gp.bench_gpu_path(False, size="70b")
