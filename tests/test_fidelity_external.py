"""The external fidelity check (bidirl.experiments.fidelity_external): the row file, and a fit that reads only the
calibrating row."""

import dataclasses

import pytest
import yaml

from bidirl.experiments import fidelity_external as F


@pytest.fixture(scope="module")
def rows():
    return F.load()


def test_the_shipped_row_file_has_one_calibrating_row_and_valid_settings(rows):
    assert [r.id for r in rows.rows if r.calibrating] == ["colocated-64"]
    assert len(rows.rows) >= 10
    for r in rows.rows:
        cfg = rows.config(r)
        assert cfg.model == "qwen2.5-math-7b" and cfg.hardware == "h20"
        assert cfg.cluster.rollout_tensor_parallel == 4 and cfg.rl.sequence_parallel == 4


def test_a_sealed_row_refuses_its_published_numbers(rows):
    row = rows.row("async-16-16")
    assert row.published("step") == pytest.approx(294.77)
    sealed = row.sealed()
    assert sealed.has("step")
    with pytest.raises(F.SealedRowError, match="async-16-16"):
        sealed.published("step")


def test_for_fit_seals_every_predicted_row_and_no_calibrating_row(rows):
    for r in rows.for_fit():
        if r.calibrating:
            assert r.published("step") > 0
        else:
            with pytest.raises(F.SealedRowError):
                r.published("step")


def test_the_fit_reads_only_the_calibrating_row(rows, tmp_path):
    """The fit runs on sealed predicted rows (a read would raise), and gives the same knobs whatever the predicted
    rows publish."""
    fitted = F.fit(rows, rows.for_fit(), tmp_path / "a", quick=True)
    scrambled = tuple(r if r.calibrating else dataclasses.replace(
        r, _published={k: 10 * v for k, v in r._published.items()}) for r in rows.for_fit())

    again = F.fit(rows, scrambled, tmp_path / "b", quick=True)
    assert again.knobs == fitted.knobs
    assert fitted.rows == ("colocated-64",)


def test_a_fit_that_reads_a_predicted_row_is_caught(rows, tmp_path):
    """The guard the test above relies on: calling the fit on rows whose only calibrating row is sealed fails."""
    only_predicted = tuple(r.sealed() if r.calibrating else r for r in rows.for_fit())
    with pytest.raises(F.SealedRowError):
        F.fit(rows, only_predicted, tmp_path, quick=True)


def _write(tmp_path, data):
    path = tmp_path / "rows.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _minimal():
    return {"source": "x", "model": "qwen2.5-math-7b", "hardware": "h20",
            "common": {"workload.dataset": "dapo-math", "workload.max_response_len": 4096},
            "systems": {"colocated": {"policy": "verl-colocated", "overrides": {"rl.staleness": 0}}},
            "rows": [{"id": "a", "system": "colocated", "role": "calibrate", "overrides": {"cluster.gpus": 8},
                      "published": {"step": 10.0}, "total_time": ["17m", "34m"]},
                     {"id": "b", "system": "colocated", "overrides": {"cluster.gpus": 16},
                      "published": {"step": 6.0}}]}


def test_a_row_file_with_two_calibrating_rows_is_refused_by_name(tmp_path):
    data = _minimal()
    data["rows"][1]["role"] = "calibrate"
    with pytest.raises(F.FidelityDataError, match="rows.role.*2 calibrating rows"):
        F.load(_write(tmp_path, data))


@pytest.mark.parametrize("edit, field", [
    (lambda d: d["rows"][0].update(role="fit"), r"rows\[0\].role"),
    (lambda d: d["rows"][1].update(system="async"), r"rows\[1\].system"),
    (lambda d: d["rows"][1].update(published={"step": -1}), r"rows\[1\].published"),
    (lambda d: d["rows"][1].update(published={"gen": 3}), r"rows\[1\].published"),
    (lambda d: d["rows"][1].update(overrides={"rl.staleness": "soon"}), r"rows\[b\].overrides"),
    (lambda d: d["systems"]["colocated"].update(policy="verl-sync"), r"systems.colocated.policy"),
    (lambda d: d.update(speedups=[{"faster": "b", "slower": "zz"}]), r"speedups\[0\].slower"),
    (lambda d: d["rows"][1].update(total_time=["2h", "1h"]), r"rows\[1\].total_time\[1\]"),
    (lambda d: d["rows"][1].update(total_time=["two hours"]), r"rows\[1\].total_time\[0\]"),
    (lambda d: d["rows"][1].update(total_time="1h"), r"rows\[1\].total_time"),
    (lambda d: d["rows"][0].pop("total_time"), r"rows\[0\].total_time"),
    (lambda d: d["rows"][0].update(total_time=["1h"]), r"rows\[0\].total_time"),
])
def test_bad_row_files_name_the_field(tmp_path, edit, field):
    data = _minimal()
    edit(data)
    with pytest.raises(F.FidelityDataError, match=field):
        F.load(_write(tmp_path, data))


def test_interval_step_times_are_the_differences_of_the_cumulative_times(rows):
    """colocated-64's published total times 10h22m, 20h45m, 1d7h6m, 1d17h32m after 100, 200, 300, 400 steps."""
    times = rows.row("colocated-64").interval_step_times()
    assert times == pytest.approx((37320 / 100, (74700 - 37320) / 100, (111960 - 74700) / 100,
                                   (149520 - 111960) / 100))
    with pytest.raises(F.SealedRowError, match="total_time"):
        rows.row("colocated-32").sealed().interval_step_times()


def test_a_calibrating_row_that_is_not_one_operating_point_is_refused_by_name(rows, tmp_path):
    """colocated-32's interval step times (494, 503, 1,067, 1,142 s) depart 42 % from their mean, colocated-128's
    16 %: beyond STEADY_BOUND, so neither may calibrate; the same file with a steady calibrating row loads."""
    for rid in ("colocated-32", "colocated-128"):
        with pytest.raises(F.FidelityDataError, match=rf"rows\[{rid}\].role.*not one operating point"):
            rows.calibrated_on(rid)
    data = _minimal()
    data["rows"][0]["total_time"] = ["10m", "40m"]          # 600 s then 1,800 s per 100 steps: 50 % off the mean
    with pytest.raises(F.FidelityDataError, match=r"rows\[0\].role.*not one operating point"):
        F.load(_write(tmp_path, data))
    data["rows"][0]["total_time"] = ["10m", "21m"]          # 600 and 660 s: 4.8 % off the mean, within 10 %
    assert F.load(_write(tmp_path, data)).row("a").drift() == pytest.approx(30 / 630)
