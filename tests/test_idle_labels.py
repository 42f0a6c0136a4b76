""""Idle" means GPU-weighted idle everywhere a user reads it (GPU-seconds idle over GPU-seconds available, per pool
and overall); a pool-union figure (no GPU of the pool busy) is shown only under its own label. The value tests use
a pool of four 1-GPU rollout replicas of which one is busy: GPU-weighted idle 3/4, pool-union idle 0."""

import json
import re
from pathlib import Path

import pytest

from bidirl.cli import main
from bidirl.core.protocol import StepRecord
from bidirl.ingest import load_foreign
from bidirl.ingest.bubbles import pool_idle
from bidirl.results import metrics
from bidirl.results.trace import EventLog, Span

ROOT = Path(__file__).resolve().parents[1]
#: the notebooks and widgets that show idle figures (issue: notebooks 01–04 and 08, every widget)
SHOWN = sorted([*(ROOT / "notebooks").glob("0[1-4]-*.ipynb"), *(ROOT / "notebooks").glob("08-*.ipynb"),
                *(ROOT / "widgets").glob("*.py")])
#: names and phrases of pool-union quantities: a cell or line using one must say "pool-union"
UNION_USE = re.compile(r"pool_union_idle|idle_pool_union|metrics\.idle\(|\bidle_s\b|union[- ]based idle|"
                       r"idle[^.\n]{0,40}union of (the )?busy|union of (the )?busy[^.\n]{0,40}idle", re.I)


def four_replicas_one_busy() -> EventLog:
    """Steps over [0, 30]; replicas 1–3 load weights before the first step (so the import sees four 1-GPU workers)
    and idle through the steps; replica 0 generates for all of them."""
    log = EventLog()
    for i in range(1, 4):
        log.add_span(Span(f"rollout_pool/rollouter/{i}", "rollout_pool", "primary", "sync", -1.0, 0.0, 0, 0))
    log.add_span(Span("rollout_pool/rollouter/0", "rollout_pool", "primary", "generate", 0.0, 30.0, 0, 0))
    for k in range(3):
        log.add_step(StepRecord(step=k, start=10.0 * k, end=10.0 * (k + 1), tokens=100, samples=4, wait=0.0,
                                consume=10.0, version=k + 1))
    return log


@pytest.fixture()
def replicas(tmp_path) -> Path:
    path = tmp_path / "four-replicas.events.parquet"
    four_replicas_one_busy().save(path)
    return path


def test_four_replicas_one_busy_import_is_75_percent_idle(replicas):
    """3 idle GPUs × 30 s over 4 GPUs × 30 s = 0.75 exactly (binary-exact times); pool-union idle is 0."""
    idle = pool_idle(load_foreign(replicas, "bidirl")).set_index("pool")
    assert idle.loc["rollout_pool", "idle_fraction"] == 0.75
    assert idle.loc["rollout_pool", "idle_gpu_s"] == 90.0
    assert idle.loc["rollout_pool", "pool_union_idle_fraction"] == 0.0
    assert idle.loc[metrics.OVERALL, "idle_fraction"] == 0.75


def test_the_cli_summary_prints_gpu_weighted_idle_and_labels_the_pool_union_figure(replicas, tmp_path, capsys):
    assert main(["trace", "import", str(replicas), "--format", "bidirl", "--out", str(tmp_path / "out")]) == 0
    text = capsys.readouterr().out
    assert f"{metrics.IDLE_LABEL}, over the steps:" in text
    line = next(s for s in text.splitlines() if s.strip().startswith("rollout_pool"))
    assert re.match(r"\s*rollout_pool\s+75\.0 %", line)
    assert f"{metrics.POOL_UNION_LABEL}: 0.0 %" in line
    _every_idle_percentage_is_labelled(text)
    doc = json.loads((tmp_path / "out" / "summary.json").read_text())
    rollout = next(r for r in doc["idle"] if r["pool"] == "rollout_pool")
    assert rollout["idle_fraction"] == 0.75 and rollout["pool_union_idle_fraction"] == 0.0


def _every_idle_percentage_is_labelled(text: str) -> None:
    """On a line about idle, the fixture's pool-union value (0.0 %) appears only after the pool-union label."""
    for line in text.splitlines():
        if "idle" not in line.lower():
            continue
        for m in re.finditer(r"(?<![\d.])0\.0 ?%", line):
            assert metrics.POOL_UNION_LABEL in line[:m.start()], f"an unlabelled pool-union 0.0 % in: {line!r}"


def test_the_run_summary_line_is_gpu_weighted(replicas):
    log = EventLog.load(replicas)
    s = metrics.summary(log, policy="no-borrow", staleness=0, pool_gpus={"rollout_pool": 4, "trainer_pool": 0},
                        gpus_per_worker={f"rollout_pool/rollouter/{i}": 1 for i in range(4)},
                        samples={"generated": 0, "consumed": 0, "lost": 0, "duplicated": 0})
    text = metrics.format_summary(s)
    assert f"{metrics.IDLE_LABEL}: rollout_pool 75.0%, overall 75.0%" in text
    assert f"{metrics.POOL_UNION_LABEL}: rollout_pool 0.0%" in text
    assert metrics.summary_row(s)["idle_rollout_pool"] == 0.75


def test_the_metrics_panel_draws_gpu_weighted_idle():
    pytest.importorskip("ipywidgets")
    from widgets.metrics import SERIES, MetricsPanel
    s = {"policy": "no-borrow", "throughput": 1.0, "idle": {"rollout_pool": 0.75, "trainer_pool": None},
         "idle_overall": 0.75, "idle_pool_union": {"rollout_pool": 0.0, "trainer_pool": None}, "utilization": 0.25,
         "borrows": {}, "samples": {}, "step_times": [10.0], "timing_s/step": 10.0}
    panel = MetricsPanel()
    panel.update({"run": s})
    by_name = {t.meta: t for t in panel.figure.data}
    assert list(by_name["idle_rollout_pool"].y) == [0.75]
    for name, legend, _, _ in SERIES:
        if name.startswith("idle"):
            assert "GPU-weighted" in legend


@pytest.mark.parametrize("path", SHOWN, ids=lambda p: p.name)
def test_no_notebook_or_widget_shows_a_pool_union_figure_as_plain_idle(path):
    """Every cell (notebook) or line (widget) that uses a pool-union quantity or describes idle as the union of
    busy intervals says "pool-union" in the same place."""
    if path.suffix == ".ipynb":
        pieces = ["".join(c["source"]) for c in json.loads(path.read_text())["cells"]]
    else:
        pieces = path.read_text().splitlines()
    for piece in pieces:
        if UNION_USE.search(piece):
            assert "pool-union" in piece.lower() or "pool_union_label" in piece.lower(), \
                f"{path.name}: a pool-union figure not labelled as such: {piece[:300]!r}"


def test_the_label_check_catches_an_unlabelled_union_figure():
    """The check above fails on the defect it guards: a cell printing the union column as plain idle."""
    cell = 'pool_idle(run)[["pool", "pool_union_idle_fraction"]].rename(columns={"pool_union_idle_fraction": "idle"})'
    assert UNION_USE.search(cell) and "pool-union" not in cell
    assert UNION_USE.search("idle per pool (union of busy intervals over the steps)")
