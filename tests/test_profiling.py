"""``bidirl profile`` and ``bidirl calibrate`` end to end on the real engines (CPU, small grid).

Integration test (``-m integration``): it starts vLLM in a subprocess (about 40 s on two cores). The profile
is measured once per module; the tests read it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bidirl.calibrate.profile import GRIDS
from bidirl.calibrate.records import load_profile
from bidirl.job import presets
from bidirl.perf import RolloutModel, TrainerModel

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parent.parent
TINY = presets.model("tiny")


def _cli(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "bidirl", *args], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.fixture(scope="module")
def measured(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("profile") / "small"
    env = dict(os.environ, BIDIRL_CACHE=str(model_dir.parent))
    proc = _cli("profile", "tiny-cpu", "--grid", "small", "--seed", "3", "--out", str(out), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "profile written to" in proc.stdout
    return out


def test_profile_writes_the_small_grid_with_metadata(measured):
    prof = load_profile(measured)
    grid = GRIDS["small"]
    n_points = len(grid.batches) * len(grid.prompt_lens) * len(grid.response_lens)
    assert prof.rollout["point"].nunique() == n_points
    assert len(prof.rollout) == n_points * grid.repeats and len(prof.trainer) == 3 * n_points * grid.repeats
    assert set(prof.rollout["batch"]) == set(grid.batches) and set(prof.rollout["prompt_len"]) == set(grid.prompt_lens)
    assert set(prof.rollout["response_len"]) == set(grid.response_lens)
    assert (prof.rollout["observed"] > 0).all() and (prof.trainer["observed"] > 0).all()
    meta = prof.meta
    assert meta["model"] == "tiny" and meta["hardware"] == "cpu-calibrated" and meta["seed"] == 3
    assert meta["engines"]["vllm"] != "not installed" and meta["machine"]["usable_cpus"] >= 1
    assert meta["settings"]["group_size"] == 4 and meta["settings"]["skipped_points"] == []
    # prompts of controlled length come from the tokenizer's ordinary vocabulary (no special tokens)
    assert meta["settings"]["prompt_token_ids"] and 0 not in meta["settings"]["prompt_token_ids"]


def test_more_tokens_take_longer_on_the_real_engines(measured):
    prof = load_profile(measured)
    med = prof.rollout.groupby(["batch", "prompt_len", "response_len"])["observed"].median()
    # 16 groups of 16 forced tokens take longer than one group of 4, whatever the prompt length
    for p in GRIDS["small"].prompt_lens:
        assert med[(16, p, 16)] > 2 * med[(1, p, 4)]
    upd = prof.trainer[prof.trainer["stage"] == "actor_update"].groupby("point")["observed"].median()
    fwd = prof.trainer[prof.trainer["stage"] == "old_logprob"].groupby("point")["observed"].median()
    assert (upd > fwd).mean() > 0.8                      # the update (forward + backward) costs more


def test_calibrate_writes_a_loadable_preset_that_changes_predictions(measured, tmp_path):
    out = tmp_path / "cpu-ci.yaml"
    proc = _cli("calibrate", str(measured), "--out", str(out), "--hardware", "cpu", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    errors = {(e["kind"], e["split"], e["predictor"]): e for e in summary["errors"]}
    for kind in ("rollout", "trainer"):
        held = errors[(kind, "held-out", "calibrated")]
        assert held["points"] == (3 if kind == "rollout" else 9) and np.isfinite(held["median_pct"])
        # the nominal priors are far off; the fit must beat them on the points it was fitted to
        assert errors[(kind, "fit", "calibrated")]["median_pct"] < errors[(kind, "fit", "prior")]["median_pct"] / 3
    hw = presets.load_hardware_file(out)
    assert hw.name == "cpu-ci" and hw.stage_params["tiny"]["rollout"]["tp"] == 1
    assert "bidirl calibrate" in hw.sources[-1] and "held-out" in hw.sources[-1]
    cpu = presets.hardware("cpu")
    p, r = np.full(8, 16), np.full(8, 8)
    assert RolloutModel(TINY, hw).stage_time(p, r, 1, 4) != RolloutModel(TINY, cpu).stage_time(p, r, 1, 4)
    assert TrainerModel(TINY, hw).chunk_time("old_logprob", p, r, 1) != TrainerModel(TINY, cpu).chunk_time(
        "old_logprob", p, r, 1)
    # human-readable report too
    proc = _cli("calibrate", str(measured), "--out", str(tmp_path / "cpu-ci2.yaml"), "--knobs-only")
    assert proc.returncode == 0 and "held-out" in proc.stdout and "preset written to" in proc.stdout
    assert presets.load_hardware_file(tmp_path / "cpu-ci2.yaml").stage_params == {}


def test_cli_errors_name_the_problem(tmp_path):
    proc = _cli("calibrate", str(tmp_path / "none"), "--out", str(tmp_path / "x.yaml"))
    assert proc.returncode == 2 and "no such profile folder" in proc.stderr and "Traceback" not in proc.stderr
    proc = _cli("profile", "a6000-default", "--out", str(tmp_path / "p"))
    assert proc.returncode == 2 and "--model-dir" in proc.stderr and "Traceback" not in proc.stderr
