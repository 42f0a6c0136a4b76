"""``bidirl plan`` and ``bidirl bench`` on the command line (DESIGN.md contract: ``--json`` keys, exit status 2
and ``error: ...`` on stderr for configuration problems, never a traceback)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bidirl import cli
from bidirl.job.planner import CANDIDATE_KEYS, ENVELOPE_KEYS

ROOT = Path(__file__).resolve().parent.parent


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def write_config(tmp_path, **changes) -> str:
    data = yaml.safe_load((ROOT / "data" / "configs" / "a6000-default.yaml").read_text())
    for dotted, value in changes.items():
        node = data
        *parents, last = dotted.split(".")
        for part in parents:
            node = node[part]
        node[last] = value
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_plan_json_has_the_design_keys(capsys):
    code, out, err = run(capsys, "plan", "a6000-default", "--json")
    assert code == 0 and err == ""
    data = json.loads(out)
    assert set(ENVELOPE_KEYS) <= set(data["envelope"])
    assert all(set(CANDIDATE_KEYS) <= set(c) for c in data["candidates"])
    assert out.count("\n") == 1                      # one JSON object on one line


def test_plan_human_table(capsys, tmp_path):
    path = write_config(tmp_path, **{"cluster.partition": None, "cluster.gpus": 32})
    code, out, _ = run(capsys, "plan", path)
    assert code == 0
    assert "envelope 8-24" in out and "planner choice" in out
    assert "16-16" in out and "24-8" in out and "<==" in out


def test_plan_table_is_shortened_for_big_sweeps(capsys, tmp_path):
    path = write_config(tmp_path, **{"cluster.partition": None, "cluster.gpus": 128, "cluster.placement": "any"})
    code, out, _ = run(capsys, "plan", path, "--rows", "10")
    assert code == 0 and "117 more candidates not shown" in out and "<==" in out


def test_plan_html_writes_the_sweep_figure(capsys, tmp_path):
    target = tmp_path / "sweep.html"
    code, out, _ = run(capsys, "plan", "a6000-default", "--html", str(target))
    assert code == 0 and target.exists() and "plotly" in target.read_text()[:200000].lower()
    assert str(target) in out


def test_bad_config_exits_2_without_traceback(capsys, tmp_path):
    code, out, err = run(capsys, "plan", "no-such-config")
    assert code == 2 and out == ""
    assert err.startswith("error: ") and "a6000-default" in err and "Traceback" not in err
    path = write_config(tmp_path, **{"cluster.placement": "any", "cluster.partition": {"rollout": 6, "trainer": 10}})
    code, _, err = run(capsys, "plan", path, "--json")
    assert code == 2 and err.startswith("error: cluster.partition:")
    path = write_config(tmp_path, **{"cluster.gpus": 2, "cluster.placement": "any",
                                     "cluster.partition": None})
    code, _, err = run(capsys, "plan", path)
    assert code == 2 and err.startswith("error: cluster.gpus:")


def test_unwritable_html_is_an_error(capsys, tmp_path):
    code, _, err = run(capsys, "plan", "a6000-default", "--html", str(tmp_path / "missing" / "x.html"))
    assert code == 2 and err.startswith("error: cannot write")


def test_python_m_entry_points():
    proc = subprocess.run([sys.executable, "-m", "bidirl.cli", "plan", "tiny-cpu", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["envelope"]["rollout_gpus"] == 2
    proc = subprocess.run([sys.executable, "-m", "bidirl", "plan", "nope"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr


def test_every_subcommand_is_registered_in_the_table():
    parser = cli.build_parser()
    assert set(cli.COMMANDS) >= {"plan", "bench"}
    with pytest.raises(SystemExit) as info:
        parser.parse_args([])
    assert info.value.code == 2


def test_bench_registry_and_medians():
    registry = cli.load_benchmarks()
    assert {"planner_g4096", "rollout_mr", "trainer_mt"} <= set(registry)
    values = iter([1.0, 5.0, 3.0])
    figures = cli.run_benchmarks({"fake": lambda quick: {"t": (next(values), "s")}}, repeats=3, quick=True)
    assert figures["fake.t"]["value"] == 3.0 and figures["fake.t"]["unit"] == "s"


def test_bench_json(capsys):
    code, out, _ = run(capsys, "bench", "--json", "--quick", "--repeats", "1", "--only", "trainer_mt")
    assert code == 0
    data = json.loads(out)
    fig = data["figures"]["trainer_mt.m_t_1024samples_d8_seconds"]
    assert fig["unit"] == "s" and fig["value"] > 0
    code, _, err = run(capsys, "bench", "--only", "nothing-matches")
    assert code == 2 and err.startswith("error: ")


def test_bench_size_reaches_the_benchmarks_that_take_one():
    seen = []

    def sized(quick, size=None):
        seen.append(size)
        return {"t": (1.0, "s")}
    figures = cli.run_benchmarks({"sized": sized, "plain": lambda quick: {"t": (2.0, "s")}}, repeats=1, quick=True,
                                 size="4b")
    assert seen == ["4b"] and figures["plain.t"]["value"] == 2.0
    assert "trainer_scale" in cli.load_benchmarks()


def test_trainer_records_are_written_in_the_profile_format(tmp_path):
    import pandas as pd

    from bidirl.calibrate import records
    row = {"point": 0, "rep": 0, "stage": "actor_update", "batch": 1, "requests": 4, "prompt_len": 64,
           "response_len": 256, "d": 1, "observed": 0.5}
    meta = {"model": "qwen3-small", "hardware": "cpu", "grid": {"name": "trainer_scale"}, "seed": 0,
            "engines": {"torch": "x"}, "machine": {}, "settings": {}, "date": "2026-11-26T00:00:00+00:00"}
    folder = records.save_trainer_records(tmp_path / "p", meta, records.records_frame([row], "trainer"))
    df = pd.read_csv(folder / records.TRAINER_FILE)
    assert list(df.columns) == list(records.TRAINER_FIELDS) and df["observed"].tolist() == [0.5]
    assert json.loads((folder / records.META_FILE).read_text())["format"] == records.FORMAT
    with pytest.raises(records.ProfileError, match="observed"):
        records.save_trainer_records(tmp_path / "q", meta, records.records_frame([dict(row, observed=0.0)], "trainer"))
