"""A trainer rank's recovery snapshots on its node's disk (``bidirl.cluster.engines.workers.snapshot_files``)."""

from __future__ import annotations

import pytest
import torch

from bidirl.cluster.engines.workers import snapshot_files as sf


def _shard(version: int) -> dict:
    return {"version": version, "state": {"model": {"w": torch.full((3, 4), float(version))},
                                          "optim": {"state": {"w": {"exp_avg": torch.zeros(3, 4)}}}}}


def test_a_written_snapshot_reads_back_exactly_and_each_rank_keeps_its_last_two(tmp_path):
    writer = sf.SnapshotWriter()
    for version in (3, 6, 9):
        writer.write(tmp_path, version, rank=1, shard=_shard(version))
        report = writer.flush()
        assert report["version"] == version and report["bytes"] > 0 and report["seconds"] >= 0
    assert writer.flush() == {}, "nothing in flight"
    assert sf.versions_on_disk(tmp_path) == [6, 9]
    back = sf.read(tmp_path, 9, rank=1)
    assert back["version"] == 9 and torch.equal(back["state"]["model"]["w"], torch.full((3, 4), 9.0))
    assert not list(tmp_path.rglob("*.tmp")), "a complete file is renamed into place"
    with pytest.raises(FileNotFoundError, match="rank00000.pt"):
        sf.read(tmp_path, 9, rank=0)              # another rank's node


def test_a_write_that_fails_names_the_file_and_the_setting(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the snapshot folder would go")
    writer = sf.SnapshotWriter()
    writer.write(blocker, 1, rank=0, shard=_shard(1))
    with pytest.raises(OSError, match="recovery.snapshot_dir"):
        writer.flush()
