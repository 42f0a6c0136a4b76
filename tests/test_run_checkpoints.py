"""Run checkpoints (``bidirl.runtime.checkpoints``): the format, atomic writes, keep-K, and the named errors a corrupt,
partial or mismatched checkpoint gets. No Ray: checkpoints here are written by the format's own writer with the
control plane of a simulated run, as a driver writes them (the engine runs that write the trainer's sharded state
are in ``tests/test_chaos.py``)."""

from __future__ import annotations

import json
import pickle

import pytest

from bidirl.core import protocol as P
from bidirl.job import config as cfgmod
from bidirl.runtime import checkpoints
from bidirl.runtime.checkpoints import CheckpointError, CheckpointWriter, RunIdentity

SMALL = {
    "model": "qwen3-vl-2b", "hardware": "a6000",
    "cluster": {"gpus": 8, "gpus_per_node": 8, "placement": "any", "partition": [2, 6]},
    "workload": {"dataset": "geo3k", "prompts_per_step": 8, "group_size": 4, "max_response_len": 256, "steps": 3},
    "rl": {"staleness": 1, "micro_batch_per_device": 2},
}


def _identity(cfg, **layout) -> RunIdentity:
    base = {"gpus": cfg.cluster.gpus, "rollout_gpus": 2, "trainer_gpus": cfg.cluster.gpus - 2, "trainer_ranks": 6}
    base.update(layout)
    return RunIdentity(config=cfg.to_dict(), policy="bidirl", steps=3, seed=0, driver="emulated",
                       model={"name": cfg.model}, data={}, layout=base)


def _boundary_of_a_simulated_run(cfg):
    """The control plane of a simulated run just before its first step's SyncFinished, as a driver captures it."""
    from bidirl.sim.driver import SimDriver

    driver = SimDriver(cfg, "bidirl", 3, 0)
    seen = []
    feed = driver.feed

    def capture(event):
        if isinstance(event, P.SyncFinished) and not seen:      # a copy: the run goes on from here
            seen.append(pickle.loads(pickle.dumps(checkpoints.capture(driver, event, {"version": driver.version}))))
        feed(event)
    driver.feed = capture
    driver.run()
    return driver, seen[0]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A checkpoint folder with the boundaries after steps 1, 2 and 3 written (keep 2), and the run's identity."""
    cfg = cfgmod.from_dict(SMALL)
    driver, control = _boundary_of_a_simulated_run(cfg)
    root = tmp_path_factory.mktemp("ck")
    writer = CheckpointWriter(root, every=1, keep=2)
    ident = _identity(cfg)
    for step in (1, 2, 3):
        tmp = writer.begin(step)
        (tmp / checkpoints.TRAINER_DIR / "__0_0.distcp").write_bytes(bytes(range(256)) * 64)   # a rank's file
        writer.commit(tmp, step=step, trainer_version=step, t=float(step), identity=ident, control=control,
                      config_yaml=cfg.to_yaml(), trainer=True)
    return root, ident, control, cfg


def _copy(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return dst


def test_a_checkpoint_round_trips_the_control_plane_and_keeps_the_last_k(written):
    root, ident, control, _ = written
    assert [p.name for p in checkpoints.step_folders(root)] == ["step-000002", "step-000003"]
    assert not list(root.glob(checkpoints.PARTIAL_PREFIX + "*"))
    found = checkpoints.find(root, ident)
    assert found.step == 3 and found.trainer_version == 3
    manifest = json.loads((found.path / checkpoints.MANIFEST).read_text())
    assert manifest["format_version"] == checkpoints.FORMAT_VERSION
    assert set(manifest["files"]) == {"control.pkl", "config.yaml", "trainer/__0_0.distcp"}
    assert manifest["identity"]["config_sha256"] == ident.config_sha256
    back = found.control()
    # the coordinator comes back whole: the same view, and it goes on from the boundary as the original did
    assert back.coordinator.view() == control.coordinator.view()
    assert back.boundary == control.boundary and len(back.log.spans) == len(control.log.spans)
    out = back.coordinator.handle(back.boundary)
    assert [type(m) for m in out][0] is P.StepDone and out[0].record.step == 0


def test_a_truncated_file_is_refused_naming_it(written, tmp_path):
    root, ident, _, _ = written
    bad = _copy(root / "step-000003", tmp_path / "step-000003")
    rank_file = bad / "trainer" / "__0_0.distcp"
    rank_file.write_bytes(rank_file.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"file trainer/__0_0\.distcp is 100 bytes, the manifest says 16384: it "
                                              r"is truncated"):
        checkpoints.find(bad, ident)


def test_an_altered_file_is_refused_by_its_checksum(written, tmp_path):
    root, ident, _, _ = written
    bad = _copy(root / "step-000003", tmp_path / "step-000003")
    data = bytearray((bad / "control.pkl").read_bytes())
    data[-3] ^= 0xFF
    (bad / "control.pkl").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"file control\.pkl does not match its SHA-256"):
        checkpoints.Checkpoint.open(bad)


def test_a_partial_checkpoint_is_refused_and_resuming_from_the_folder_takes_the_newest_good_one(written, tmp_path):
    root, ident, _, _ = written
    folder = _copy(root, tmp_path / "ck")
    (folder / "step-000003" / checkpoints.MANIFEST).unlink()          # its writer died before the end
    with pytest.raises(CheckpointError, match="has no manifest.json: it is partial"):
        checkpoints.Checkpoint.open(folder / "step-000003")
    with pytest.warns(RuntimeWarning, match="skipping a newer checkpoint: .*step-000003.* partial"):
        found = checkpoints.find(folder, ident)
    assert found.step == 2
    (folder / "step-000002" / "config.yaml").write_text("tampered")
    with pytest.raises(CheckpointError, match=r"no good checkpoint to resume from .*step-000003.*partial.*"
                                              r"step-000002.*config\.yaml is \d+ bytes"):
        checkpoints.find(folder, ident)


def test_another_config_is_refused_naming_the_keys_that_differ(written):
    root, _, _, cfg = written
    other = _identity(cfg.with_overrides({"rl.staleness": 0, "workload.prompts_per_step": 16}))
    with pytest.raises(CheckpointError) as err:
        checkpoints.find(root, other)
    msg = str(err.value)
    assert "was written by another run" in msg
    assert "config: rl.staleness is 1.0 in the checkpoint, 0.0 in this run" in msg
    assert "config: workload.prompts_per_step is 8 in the checkpoint, 16 in this run" in msg
    assert "Resume with the checkpoint's config" in msg


def test_a_run_resumes_with_other_recovery_settings(written):
    """Where and how often the primary trainer's recovery snapshots go changes nothing the run computes."""
    root, _, _, cfg = written
    other = _identity(cfg.with_overrides({"recovery.snapshot_every": 3, "recovery.snapshot_dir": "/elsewhere"}))
    assert checkpoints.find(root, other).step == 3


def test_another_world_size_is_refused_naming_the_layout(written):
    root, _, _, cfg = written
    bigger = cfg.with_overrides({"cluster.gpus": 16, "cluster.gpus_per_node": 16, "cluster.partition": [4, 12]})
    with pytest.raises(CheckpointError, match=r"world size: gpus is 8 in the checkpoint, 16 in this run.*"
                                              r"world size: trainer_ranks is 6 in the checkpoint, 14 in this run"):
        checkpoints.find(root, _identity(bigger, rollout_gpus=2, trainer_ranks=14))


def test_another_model_policy_or_driver_is_refused(written):
    root, ident, _, cfg = written
    from dataclasses import replace
    for changed, expected in ((replace(ident, model={"name": "other"}), "model: name is 'qwen3-vl-2b' in the "
                                                                         "checkpoint, 'other' in this run"),
                              (replace(ident, policy="no-borrow"), "policy: 'bidirl' in the checkpoint, 'no-borrow'"),
                              (replace(ident, driver="engines"), "driver: the checkpoint was written by a run with "
                                                                 "emulated workers, this run uses engines")):
        with pytest.raises(CheckpointError, match=expected):
            checkpoints.find(root, changed)


def test_writer_arguments_and_missing_folders_get_named_errors(tmp_path):
    with pytest.raises(CheckpointError, match="--keep must be a positive integer"):
        CheckpointWriter(tmp_path, keep=0)
    with pytest.raises(CheckpointError, match="--checkpoint-every must be a positive integer"):
        CheckpointWriter(tmp_path, every=0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is a file; pass a folder"):
        CheckpointWriter(tmp_path / "file")
    with pytest.raises(CheckpointError, match="no such folder"):
        checkpoints.find(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="holds no step-\\* checkpoint"):
        checkpoints.find(tmp_path)


def test_a_writer_removes_what_a_killed_writer_left_and_checkpoints_every_n_steps(tmp_path):
    leftover = tmp_path / (checkpoints.PARTIAL_PREFIX + "step-000004-deadbeef")
    leftover.mkdir()
    writer = CheckpointWriter(tmp_path, every=3, keep=1)
    assert not leftover.exists()
    assert [s for s in range(1, 8) if writer.due(s, last=s == 7)] == [3, 6, 7]


def test_a_run_may_be_resumed_to_more_steps_but_not_to_as_many_as_it_holds(written, tmp_path):
    """``bidirl run --steps 3`` then ``--steps 6 --resume``: the identity ignores the step count, the coordinator
    takes the new goal, and a goal the checkpoint has already reached is refused naming the fix."""
    from dataclasses import replace

    from bidirl.cluster.emulated import EmulatedDriver
    _, _, control, cfg = written
    first = EmulatedDriver(cfg, "bidirl", 1, 0)
    root = tmp_path / "ck"
    writer = CheckpointWriter(root)
    tmp = writer.begin(1)
    writer.commit(tmp, step=1, trainer_version=1, t=control.boundary.t, identity=first.identity(),
                  control=replace(control, driver=first.checkpoint_state()), config_yaml=cfg.to_yaml(), trainer=False)
    with pytest.raises(CheckpointError, match=r"holds 1 steps already; this run asks for 1 in all: pass --steps "
                                              r"greater than 1"):
        EmulatedDriver(cfg, "bidirl", 1, 0, resume=str(root))._load_resume()
    with pytest.raises(CheckpointError, match=r"seed: 0 in the checkpoint, 5 in this run"):
        EmulatedDriver(cfg, "bidirl", 6, 5, resume=str(root))._load_resume()
    longer = EmulatedDriver(cfg, "bidirl", 6, 0, resume=str(root))
    longer._load_resume()
    assert longer.resumed_from.step == 1 and longer.coordinator.settings.steps == 6
    out = longer.coordinator.handle(longer.boundary)
    assert of_type(out, P.StepDone) and not of_type(out, P.RunDone), "the run goes on past its first goal"
    assert longer.coordinator.view().steps_done == 1 and not longer.coordinator.view().finished


def of_type(out, kind) -> list:
    return [m for m in out if isinstance(m, kind)]


def test_a_resumed_run_reserves_its_first_switches_pinned_buffers_from_its_boundary(written, tmp_path):
    """A resumed run's workers start anew at its boundary, so the first switch after it pays what is left of the
    trainer's pinned allocation counted from the boundary — max(0, allocation − time since the boundary) — not from
    the original run's start (``SwitchTimes.take``)."""
    from dataclasses import replace

    from bidirl.cluster.emulated import EmulatedDriver
    _, _, control, cfg = written
    first = EmulatedDriver(cfg, "bidirl", 1, 0)
    root = tmp_path / "ck"
    writer = CheckpointWriter(root)
    tmp = writer.begin(1)
    t = 1000.0 + control.boundary.t              # late in the run: every allocation would be over from t = 0
    writer.commit(tmp, step=1, trainer_version=1, t=t, identity=first.identity(),
                  control=replace(control, boundary=replace(control.boundary, t=t), driver=first.checkpoint_state()),
                  config_yaml=cfg.to_yaml(), trainer=False)
    resumed = EmulatedDriver(cfg, "bidirl", 3, 0, resume=str(root))
    resumed._load_resume()
    assert resumed.switch_times.loaded_at == t
    (direction, phase), alloc = max(resumed.switch_times.first.items(), key=lambda kv: kv[1])
    assert alloc > 0
    assert resumed.switch_times.take(direction, phase, t + alloc / 4)[1] == pytest.approx(alloc * 3 / 4)
    # the coordinator, told of the fresh workers before the boundary, expects (and its gates charge) the same from
    # the boundary on (the checkpoint's profiler counted from the original start, and had no allocation left)
    resumed.coordinator.handle(P.Resumed(t, tuple(resumed.assembly.first_switch.items())))
    profiler = resumed.coordinator.profiler
    assert profiler.loaded_at == t
    assert profiler.allocation_left(direction, "c_" + phase, t + alloc / 4) == pytest.approx(alloc * 3 / 4)
