"""``bidirl reproduce --quick`` end to end: every claim of data/paper gets a computed row (integration)."""

import json
import subprocess
import sys

import pytest
import yaml

from bidirl.job import presets

pytestmark = pytest.mark.integration


def test_quick_reproduction_covers_every_claim(tmp_path):
    out = tmp_path / "paper"
    proc = subprocess.run([sys.executable, "-m", "bidirl.cli", "reproduce", "--out", str(out), "--quick"],
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    claims = yaml.safe_load((presets.data_dir() / "paper" / "claims.yaml").read_text())
    ids = {c["id"] for c in (claims["claims"] if isinstance(claims, dict) else claims)}
    rows = {row["id"]: row for row in report["claims"]}
    assert ids == set(rows)
    for row in rows.values():
        assert row["status"] in ("match", "mismatch", "not run", "not reproducible in simulation")
        assert (row["match"] is None) == (row["status"] in ("not run", "not reproducible in simulation"))
    assert (out / "report.md").exists() and any((out / "figures").glob("*.html"))
