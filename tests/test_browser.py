"""A real browser runs the quickstart notebook in JupyterLab and the plotly figures render.

JupyterLab is started on 127.0.0.1 with a random free port and a random token, in a temporary root holding a
copy of ``notebooks/01-quickstart.ipynb`` (the repository copy is never written). Debian's ``chromium``,
driven by Playwright's Python package (``executable_path``; Playwright's own browser download is not used),
opens the notebook, runs all cells and waits for the kernel to finish. The test then checks that the partition
sweep and the Gantt chart rendered as plotly SVG, with the trace counts the same code gives in this process,
and saves a screenshot to the test's tmp folder and to ``results/browser/quickstart.png`` (plus the sweep
figure alone as ``quickstart-sweep.png``).

Skipped, with the reason, only when chromium or Playwright is missing. Run with ``-m integration``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "01-quickstart.ipynb"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOT = ROOT / "results" / "browser" / "quickstart.png"
SERVER_START_S = 60
RUN_ALL_S = 150


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lab_settings(path: Path) -> None:
    """User settings for a quiet, fully rendered lab: no news/update toasts, every cell kept in the DOM
    (JupyterLab's windowed notebook would otherwise skip rendering cells outside the viewport)."""
    files = {
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                            "checkForUpdates": False},
    }
    for name, content in files.items():
        target = path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(content))


def _wait_for_server(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"JupyterLab exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"JupyterLab did not answer within {SERVER_START_S} s:\n{log.read_text()[-3000:]}")


def _expected_trace_counts() -> dict:
    """What notebook 01 draws, computed here with the same inputs (BIDIRL_SMOKE=1 sizes; keep in step with
    the notebook's cells)."""
    import bidirl.config
    from bidirl.planner import plan
    from bidirl.sim import simulate
    from bidirl.viz import gantt_figure
    from bidirl.viz_plan import sweep_figure

    free = bidirl.config.load("a6000-default").with_overrides({"cluster.partition": None,
                                                               "cluster.placement": "any"})
    sweep = sweep_figure(plan(free))
    gantt = gantt_figure(simulate(free, "bidirl", steps=4, seed=0).log)
    return {"sweep": len(sweep.data), "gantt": len(gantt.data)}


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server over a temporary root holding a copy of notebook 01; yields (url, root)."""
    if not NOTEBOOK.exists():
        pytest.fail(f"{NOTEBOOK} is missing")
    root = tmp_path / "lab"
    root.mkdir()
    shutil.copy(NOTEBOOK, root / NOTEBOOK.name)
    settings = tmp_path / "settings"
    _lab_settings(settings)
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, BIDIRL_SMOKE="1", JUPYTER_CONFIG_DIR=str(tmp_path / "jupyter-config"),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "jupyter-runtime"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])))
    log = tmp_path / "jupyterlab.log"
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
           f"--LabApp.user_settings_dir={settings}", f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",
           "--LabApp.check_for_updates_class=jupyterlab.handlers.announcements.NeverCheckForUpdate"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")          # CI containers run as root
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=root)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_for_server(f"{base}/api/status?token={token}", proc, log)
        yield {"url": f"{base}/lab/tree/{NOTEBOOK.name}?token={token}", "api": base, "token": token, "log": log}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _wait_for_kernel(base: str, token: str) -> None:
    """Until the notebook's kernel has started and reports idle (the Run menu does nothing before)."""
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{base}/api/sessions?token={token}", timeout=5) as r:
            sessions = json.loads(r.read())
        if any((x.get("kernel") or {}).get("execution_state") == "idle" for x in sessions):
            return
        time.sleep(0.5)
    pytest.fail(f"no idle kernel within {SERVER_START_S} s; sessions: {sessions}")


def _finished(prompts: list) -> bool:
    return bool(prompts) and all(p.startswith("[") and p[1:-2].strip().isdigit() for p in prompts)


def _run_all(page, log: Path) -> list:
    """Run ▸ Run All Cells, as a person would; re-issued once if no cell started (a click lost while the lab
    was still settling). Returns the final prompts (``[n]:`` each)."""
    deadline = time.monotonic() + RUN_ALL_S
    prompts: list = []
    for attempt in range(2):
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
        started = time.monotonic()
        while time.monotonic() < deadline:
            prompts = page.evaluate(CELL_STATE_JS)
            if _finished(prompts):
                return prompts
            errors = page.evaluate(ERRORS_JS)
            if errors:
                pytest.fail(f"a cell raised:\n{errors[0]}")
            if attempt == 0 and all(p in ("[ ]:", "") for p in prompts) and time.monotonic() - started > 15:
                break
            page.wait_for_timeout(500)
    pytest.fail(f"the notebook did not finish within {RUN_ALL_S} s; cell prompts: {prompts}\n"
                f"{log.read_text()[-2000:]}")


CELL_STATE_JS = """() => Array.from(document.querySelectorAll('.jp-CodeCell')).map(c => {
    const p = c.querySelector('.jp-InputArea-prompt');
    return p ? p.textContent.trim() : '';
})"""
PLOTS_JS = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(d => ({
    traces: (d.data || []).length,
    svg: d.querySelectorAll('svg.main-svg').length,
    bars: d.querySelectorAll('g.trace.bars, g.barlayer g.trace').length,
    title: (d.layout && d.layout.title && d.layout.title.text) || ''
}))"""
ERRORS_JS = """() => Array.from(document.querySelectorAll('.jp-OutputArea-output'))
    .map(e => e.textContent).filter(t => t.includes('Traceback')).map(t => t.slice(0, 1500))"""


@pytest.mark.skipif(not CHROMIUM.exists(), reason="chromium is not installed at /usr/bin/chromium "
                                                   "(apt-get update && apt-get install -y chromium)")
def test_quickstart_renders_in_chromium(lab, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright Python package is not installed")
    expected = _expected_trace_counts()

    with sync_api.sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=str(CHROMIUM), headless=True,
            args=CHROMIUM_FLAGS, viewport={"width": 1400, "height": 1300})
        try:
            page = context.pages[0] if context.pages else context.new_page()
            page.set_default_timeout(60_000)
            page.goto(lab["url"])
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            _wait_for_kernel(lab["api"], lab["token"])
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)
            page.keyboard.press("Control+b")            # hide the file browser: more room for the figures
            prompts = _run_all(page, lab["log"])
            errors = page.evaluate(ERRORS_JS)
            assert not errors, f"cells raised errors: {errors}"
            page.wait_for_function("document.querySelectorAll('.js-plotly-plot svg.main-svg').length >= 2",
                                   timeout=30_000)
            plots = page.evaluate(PLOTS_JS)
            figures = page.locator(".js-plotly-plot")
            sweep_shot = tmp_path / "quickstart-sweep.png"
            figures.first.scroll_into_view_if_needed()
            figures.first.screenshot(path=str(sweep_shot))
            # the page as a person sees it, scrolled to the Gantt
            figures.last.scroll_into_view_if_needed()
            page.wait_for_timeout(500)
            shot = tmp_path / "quickstart.png"
            page.screenshot(path=str(shot))
        finally:
            context.close()

    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, SCREENSHOT)
    shutil.copy(sweep_shot, SCREENSHOT.with_name("quickstart-sweep.png"))
    assert shot.stat().st_size > 10_000, "the screenshot is suspiciously small"
    assert len(plots) == 2, f"expected the sweep and the Gantt, found {len(plots)} plotly figures: {plots}"
    sweep, gantt = plots
    assert all(p["svg"] >= 1 for p in plots), f"a figure has no rendered SVG: {plots}"
    assert sweep["traces"] == expected["sweep"], (sweep, expected)
    assert gantt["traces"] == expected["gantt"], (gantt, expected)
    assert gantt["bars"] >= 1 and sweep["bars"] >= 1, f"no bar traces were drawn: {plots}"
