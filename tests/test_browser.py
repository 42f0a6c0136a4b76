"""A real browser runs every notebook (01–08) in JupyterLab, as a new user would, and the figures answer.

JupyterLab is started once for the module on 127.0.0.1, on a port the OS picks as the server binds it (read back
from the server's record of itself), with a random token, in a temporary root holding copies of the three
notebooks (the repository copies are never written). Debian's
``chromium``, driven by Playwright's Python package (``executable_path``; Playwright's own browser download is
not used), opens each notebook, runs all cells and waits for the kernel to finish. Then:

* **01 quickstart** — the partition sweep and the Gantt chart rendered as plotly SVG, with the trace counts the
  same code gives in this process;
* **02 partition explorer** — clicking the *placement* control re-plans and the chart changes (its number of
  bars becomes the new sweep's), and clicking *simulate all candidates* draws one simulated rate per compatible
  split beside the predicted ones; no control label is cut off;
* **03 live bubbles** — the cells that build the empty chart run first; once it is drawn, the live cell runs
  while a timer in the page samples the Gantt: it must be seen at two sizes while the status line still says
  running (a screenshot is taken then), and at the end the legend names the windows and step lines. Then the
  replay: at two paces (100 and 2,000 run seconds per wall second) ▶ pressed after the end starts over from
  t = 0 and reaches the run's end with every span drawn, the readout saying "t = end of end";
* **04 – 08** — run all cells (04 at CI size, ``BIDIRL_SMOKE=1``, as every notebook here) with no traceback and
  every figure rendered; 05's figure says it is the quick variant, 06's figures say their records are
  synthetic (never measured), 07's says its points are medians. This is the only run of 04 in ``make test``
  where chromium is installed (the notebook part leaves it out: it starts real engines, a minute of worker
  starts), so it checks everything nbval would: every cell ran (a cell that raises stops *Run All*, so the
  prompts never all get numbers) and no output holds a traceback.

On every page of 01–07 a reader must be able to see what is drawn: no figure title, axis title or annotation
runs outside its figure, every axis in use shows at least two tick labels, no table is wider than the page, and
a trend the markdown states is backed by the outputs (a model "learns" only where its mean reward rises by more
than its step-to-step spread).

Screenshots go to the test's tmp folder and to ``results/browser/`` (``quickstart.png``,
``quickstart-sweep.png``, ``partition-explorer.png``, ``partition-explorer-controls.png``,
``live-bubbles-mid-run.png``, ``live-bubbles.png``, ``live-bubbles-replayed.png``, and one ``<notebook>.png``
for 04–07).
Skipped, with the reason, only when chromium or Playwright is missing. Run with ``-m integration``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional

import pytest

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not Path("/usr/bin/chromium").exists(),
                                 reason="chromium is not installed at /usr/bin/chromium "
                                        "(apt-get update && apt-get install -y chromium)")]

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = {name: ROOT / "notebooks" / f"{name}.ipynb"
             for name in ("01-quickstart", "02-partition-explorer", "03-live-bubbles", "04-run-on-ray",
                          "05-reproduce-paper", "06-calibrate-stage-models", "07-scaling", "08-your-run")}
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SHOTS = ROOT / "results" / "browser"
SERVER_START_S = 60
LAB_STARTS = 3              # starts of a server whose own port pick was taken from it (_start_lab) before failing
RUN_ALL_S = 300


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


def _wait_for_server(runtime: Path, token: str, proc: subprocess.Popen, log: Path) -> Optional[str]:
    """The server's base URL once it answers; its port read from the record the server writes in its runtime dir
    (``jpserver-<pid>.json``, what ``jupyter server list`` reads). None when the server exited because the port it
    picked was taken before it listened on it (``_start_lab``)."""
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            if "is already in use" in log.read_text():
                return None
            pytest.fail(f"JupyterLab exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            port = json.loads(next(runtime.glob("jpserver-*.json")).read_text())["port"]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2) as r:
                if r.status == 200:
                    return f"http://127.0.0.1:{port}"
        except (StopIteration, ValueError, OSError):    # no record yet, a record half written, no answer yet
            pass
        time.sleep(0.5)
    pytest.fail(f"JupyterLab did not answer within {SERVER_START_S} s:\n{log.read_text()[-3000:]}")


def _start_lab(cmd: list, env: dict, token: str, root: Path, tmp: Path) -> tuple:
    """Start the server on a port the OS picks (``--port=0``); returns (process, base URL, log).

    No port is picked here and handed to the server: another process (an xdist worker) could take it in between,
    and the server would then listen elsewhere (its default port retries) while the test talks to the port it
    was given. One such window remains inside jupyter_server: it binds port 0 to learn a free port, closes that
    socket and listens on the port a moment later. With ``port_retries=0`` a server that lost that port exits
    saying so, instead of listening on another one; it is started again, at most LAB_STARTS times."""
    for start in range(LAB_STARTS):
        runtime, log = tmp / f"jupyter-runtime-{start}", tmp / f"jupyterlab-{start}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd + ["--port=0", "--ServerApp.port_retries=0"], stdout=out,
                                    stderr=subprocess.STDOUT, env=dict(env, JUPYTER_RUNTIME_DIR=str(runtime)),
                                    cwd=root)
        try:
            base = _wait_for_server(runtime, token, proc, log)
        except BaseException:
            _stop(proc)
            raise
        if base is not None:
            return proc, base, log
    pytest.fail(f"JupyterLab lost the port it picked {LAB_STARTS} times running:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def _expected_trace_counts() -> dict:
    """What notebook 01 draws, computed here with the same inputs (BIDIRL_SMOKE=1 sizes; keep in step with
    the notebook's cells)."""
    import bidirl.job.config
    from bidirl.job.planner import plan
    from bidirl.sim import simulate
    from bidirl.viz.gantt import gantt_figure
    from bidirl.viz.plan import sweep_figure

    free = bidirl.job.config.load("a6000-default").with_overrides({"cluster.partition": None,
                                                               "cluster.placement": "any"})
    sweep = sweep_figure(plan(free))
    gantt = gantt_figure(simulate(free, "bidirl", steps=4, seed=0))
    return {"sweep": len(sweep.data), "gantt": len(gantt.data)}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """One JupyterLab server over a temporary root holding copies of notebooks 01–03."""
    pytest.importorskip("playwright.sync_api", reason="the playwright Python package is not installed")
    tmp = tmp_path_factory.mktemp("lab")
    root = tmp / "root"
    root.mkdir()
    for path in NOTEBOOKS.values():
        if not path.exists():
            pytest.fail(f"{path} is missing")
        shutil.copy(path, root / path.name)
    settings = tmp / "settings"
    _lab_settings(settings)
    token = secrets.token_hex(16)
    env = dict(os.environ, BIDIRL_SMOKE="1", JUPYTER_CONFIG_DIR=str(tmp / "jupyter-config"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])))
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
           f"--LabApp.user_settings_dir={settings}", f"--LabApp.workspaces_dir={tmp / 'workspaces'}",
           "--LabApp.check_for_updates_class=jupyterlab.handlers.announcements.NeverCheckForUpdate"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")          # CI containers run as root
    proc, base, log = _start_lab(cmd, env, token, root, tmp)
    try:
        yield {"base": base, "token": token, "log": log, "tmp": tmp}
    finally:
        _stop(proc)


def _sessions(lab: dict) -> list:
    with urllib.request.urlopen(f"{lab['base']}/api/sessions?token={lab['token']}", timeout=5) as r:
        return json.loads(r.read())


def _wait_for_kernel(lab: dict, notebook: str) -> None:
    """Until the notebook's kernel has started and reports idle (the Run menu does nothing before)."""
    deadline = time.monotonic() + SERVER_START_S
    sessions: list = []
    while time.monotonic() < deadline:
        sessions = _sessions(lab)
        if any(x.get("path", "").endswith(notebook) and (x.get("kernel") or {}).get("execution_state") == "idle"
               for x in sessions):
            return
        time.sleep(0.5)
    pytest.fail(f"no idle kernel for {notebook} within {SERVER_START_S} s; sessions: {sessions}")


@contextlib.contextmanager
def notebook_page(lab: dict, name: str, profile: Path):
    """Chromium showing notebook ``name`` with its kernel idle and the file browser hidden; yields the page."""
    from playwright.sync_api import sync_playwright

    file = NOTEBOOKS[name].name
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile), executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1400, "height": 1300})
        try:
            page = context.pages[0] if context.pages else context.new_page()
            page.set_default_timeout(60_000)
            # a workspace of its own, reset: only this notebook open, whatever an earlier test left
            page.goto(f"{lab['base']}/lab/workspaces/{name}/tree/{file}?reset&token={lab['token']}")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            _wait_for_kernel(lab, file)
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)
            page.keyboard.press("Control+b")            # hide the file browser: more room for the figures
            yield page
        finally:
            context.close()


def _finished(prompts: list) -> bool:
    return bool(prompts) and all(p.startswith("[") and p[1:-2].strip().isdigit() for p in prompts)


def _start(page, command: str) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text=command).first.click()


def _run_all(page, log: Path, while_running=None, command: str = "Run All Cells", done=_finished,
             limit_s: float = RUN_ALL_S) -> list:
    """Run ▸ ``command`` (Run All Cells by default), as a person would; re-issued once if no cell started (a
    click lost while the lab was still settling). ``while_running(page, prompts)`` is called on every poll
    until ``done(prompts)``. Returns the final prompts."""
    deadline = time.monotonic() + limit_s
    prompts: list = []
    for attempt in range(2):
        before = page.evaluate(CELL_STATE_JS)
        _start(page, command)
        started = time.monotonic()
        while time.monotonic() < deadline:
            prompts = page.evaluate(CELL_STATE_JS)
            if while_running is not None:
                while_running(page, prompts)
            if done(prompts):
                return prompts
            errors = page.evaluate(ERRORS_JS)
            if errors:
                pytest.fail(f"a cell raised:\n{errors[0]}")
            if attempt == 0 and prompts == before and "[*]:" not in prompts and time.monotonic() - started > 15:
                break
            page.wait_for_timeout(250)
    pytest.fail(f"the notebook did not finish within {limit_s} s; cell prompts: {prompts}\n"
                f"{log.read_text()[-2000:]}")


def _save(shot: Path, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, SHOTS / name)
    assert shot.stat().st_size > 10_000, f"the screenshot {name} is suspiciously small"


#: a figure's traces as plotly.js decoded them (``data`` may hold numpy arrays still base64-encoded)
TRACES_JS = "(d) => (d._fullData || d.data || []).map(t => ({name: t.name, type: t.type, " \
            "x: Array.from(t.x || []), y: Array.from(t.y || [])}))"
CELL_STATE_JS = """() => Array.from(document.querySelectorAll('.jp-CodeCell')).map(c => {
    const p = c.querySelector('.jp-InputArea-prompt');
    return p ? p.textContent.trim() : '';
})"""
PLOTS_JS = f"""() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(d => ({{
    traces: (d.data || []).length,
    svg: d.querySelectorAll('svg.main-svg').length,
    bars: d.querySelectorAll('g.trace.bars, g.barlayer g.trace').length,
    points: ({TRACES_JS})(d).reduce((n, t) => n + t.x.filter(v => v !== null).length, 0),
    title: (d.layout && d.layout.title && d.layout.title.text) || '',
    legend: Array.from(d.querySelectorAll('g.legend text.legendtext')).map(e => e.textContent)
}}))"""
ERRORS_JS = """() => Array.from(document.querySelectorAll('.jp-OutputArea-output'))
    .map(e => e.textContent).filter(t => t.includes('Traceback')).map(t => t.slice(0, 1500))"""
#: the explorer's chart (the first plotly figure of notebook 02): bars per split, simulated rates drawn
SWEEP_JS = f"""() => {{
    const d = document.querySelectorAll('.js-plotly-plot')[0];
    const data = ({TRACES_JS})(d);
    const sim = data.find(t => t.name === 'simulated rate');
    const shown = (a) => a.filter(v => v !== null && v !== undefined && !Number.isNaN(v)).length;
    return {{splits: data[0].x.length, rendered: d.querySelectorAll('g.barlayer g.point path').length,
             rates: shown(data[0].y), simulated: shown(sim.y)}};
}}"""
#: spans drawn in the live Gantt (the first plotly figure of notebook 03)
GANTT_SPANS_JS = f"""() => {{
    const d = document.querySelectorAll('.js-plotly-plot')[0];
    return d ? ({TRACES_JS})(d).filter(t => t.type === 'bar').reduce((n, t) => n + t.x.length, 0) : 0;
}}"""


def test_quickstart_renders_in_chromium(lab, tmp_path):
    expected = _expected_trace_counts()
    with notebook_page(lab, "01-quickstart", tmp_path / "profile") as page:
        _run_all(page, lab["log"])
        errors = page.evaluate(ERRORS_JS)
        assert not errors, f"cells raised errors: {errors}"
        page.wait_for_function("document.querySelectorAll('.js-plotly-plot svg.main-svg').length >= 2",
                               timeout=30_000)
        plots = page.evaluate(PLOTS_JS)
        assert_readable("01-quickstart", page)
        figures = page.locator(".js-plotly-plot")
        sweep_shot = tmp_path / "quickstart-sweep.png"
        figures.first.scroll_into_view_if_needed()
        figures.first.screenshot(path=str(sweep_shot))
        figures.last.scroll_into_view_if_needed()         # the page as a person sees it, scrolled to the Gantt
        page.wait_for_timeout(500)
        shot = tmp_path / "quickstart.png"
        page.screenshot(path=str(shot))
    _save(shot, "quickstart.png")
    _save(sweep_shot, "quickstart-sweep.png")
    assert len(plots) == 2, f"expected the sweep and the Gantt, found {len(plots)} plotly figures: {plots}"
    sweep, gantt = plots
    assert all(p["svg"] >= 1 for p in plots), f"a figure has no rendered SVG: {plots}"
    assert sweep["traces"] == expected["sweep"], (sweep, expected)
    assert gantt["traces"] == expected["gantt"], (gantt, expected)
    assert gantt["bars"] >= 1 and sweep["bars"] >= 1, f"no bar traces were drawn: {plots}"
    assert "simulated (model prediction)" in gantt["title"]
    assert "end of a training step" in gantt["legend"] and "generation" in gantt["legend"]


def test_partition_explorer_answers_a_click(lab, tmp_path):
    import bidirl.job.config
    from bidirl.job.planner import plan

    with notebook_page(lab, "02-partition-explorer", tmp_path / "profile") as page:
        _run_all(page, lab["log"])
        chart = page.locator(".js-plotly-plot").first
        chart.scroll_into_view_if_needed()
        before = page.evaluate(SWEEP_JS)
        # the notebook ends on the paper's default job with any placement: click "node-aligned"
        page.locator(".widget-toggle-button", has_text="node-aligned").first.click()
        page.wait_for_function(f"({SWEEP_JS})().splits !== {before['splits']}", timeout=60_000)
        after = page.evaluate(SWEEP_JS)
        node = plan(bidirl.job.config.load("a6000-default").with_overrides({"cluster.partition": None}))
        assert after["splits"] == len(node.sweep) != before["splits"], (before, after)
        # back to any placement, then simulate every compatible split in the page
        page.locator(".widget-toggle-button", has_text="any").first.click()
        page.wait_for_function(f"({SWEEP_JS})().splits === {before['splits']}", timeout=60_000)
        page.locator("button", has_text="simulate all candidates").first.click()
        page.wait_for_function(f"({SWEEP_JS})().simulated > 0", timeout=120_000)
        page.wait_for_timeout(500)
        drawn = page.evaluate(SWEEP_JS)
        assert_readable("02-partition-explorer", page)
        shot = tmp_path / "partition-explorer.png"
        chart.screenshot(path=str(shot))
        status = page.locator(".widget-html-content", has_text="best simulated split").first.text_content()
        controls = page.locator(".widget-vbox", has_text="GPU budget G").first
        controls.scroll_into_view_if_needed()
        page.wait_for_timeout(300)
        labels = page.evaluate("() => Array.from(document.querySelectorAll('.widget-label'))"
                               ".filter(e => e.scrollWidth > e.clientWidth + 1).map(e => e.textContent)")
        controls_shot = tmp_path / "partition-explorer-controls.png"
        page.screenshot(path=str(controls_shot))
    _save(shot, "partition-explorer.png")
    _save(controls_shot, "partition-explorer-controls.png")
    assert not labels, f"control labels cut off: {labels}"
    anyp = plan(bidirl.job.config.load("a6000-default").with_overrides({"cluster.partition": None,
                                                                    "cluster.placement": "any"}))
    assert drawn["simulated"] == int(anyp.sweep["compatible"].sum()), drawn
    assert drawn["rendered"] >= drawn["rates"] > 0, f"bars not rendered: {drawn}"
    assert "simulated" in status


#: an in-page sampler of the live Gantt (a timer in the page, so it also shows how responsive the page stays):
#: every 200 ms ``[ms since start, spans drawn, whether the status line says a run is still running]``
SAMPLER_JS = f"""() => {{
    window.__gantt = [];
    const t0 = performance.now();
    const spans = {GANTT_SPANS_JS};
    setInterval(() => {{
        const status = Array.from(document.querySelectorAll('.widget-html-content'))
            .map(e => e.textContent).find(t => t.includes(' step ')) || '';
        window.__gantt.push([Math.round(performance.now() - t0), spans(), status.includes('(running)')]);
    }}, 200);
}}"""


CHART_DRAWN_JS = ("(() => { const d = document.querySelector('.js-plotly-plot');"
                  " return !!d && (d.data || []).length > 0; })()")
IDLE_JS = "!Array.from(document.querySelectorAll('.jp-InputArea-prompt')).some(p => p.textContent.includes('*'))"


def _wait_for_chart(page, attempts: int = 3) -> None:
    """Until the live chart shows its traces. plotly's widget draws an empty placeholder first, then the traces;
    on a heavily loaded machine it now and then never gets to the second step, and a person then runs the cell
    again — so does this (at most ``attempts`` tries, each given a minute)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    chart_cell = page.locator(".jp-CodeCell", has_text="LiveGantt(labels").first
    for attempt in range(attempts):
        try:
            page.wait_for_function(CHART_DRAWN_JS, timeout=60_000)
            return
        except PlaywrightTimeout:
            if attempt == attempts - 1:
                raise
            chart_cell.locator(".jp-InputPrompt").click()
            page.keyboard.press("Shift+Enter")
            page.wait_for_function(IDLE_JS, timeout=60_000)


#: the live Gantt's readout, "t = 12.3 s of 456.7 s", as [t, end] (null when absent)
READOUT_JS = r"""() => {
    const text = Array.from(document.querySelectorAll('.widget-html-content')).map(e => e.textContent.trim())
        .find(t => /^t = [\d,.]+ s of [\d,.]+ s$/.test(t));
    if (!text) return null;
    const m = text.replace(/,/g, '').match(/^t = ([\d.]+) s of ([\d.]+) s$/);
    return [parseFloat(m[1]), parseFloat(m[2])];
}"""
#: every 100 ms while a replay plays: [readout t, readout end, spans drawn]
REPLAY_SAMPLER_JS = f"""() => {{
    window.__replay = [];
    const spans = {GANTT_SPANS_JS}, readout = {READOUT_JS};
    window.__replayTimer = setInterval(() => {{
        const r = readout();
        if (r) window.__replay.push([r[0], r[1], spans()]);
    }}, 100);
}}"""


def _readout(page) -> list:
    value = page.evaluate(READOUT_JS)
    assert value is not None, "the live Gantt's readout 't = … s of … s' is not on the page"
    return value


def _replay(page, pace: str, end: float, final: int, stop_first: bool = True) -> list:
    """Choose ``pace`` in the pace control, press ■ (``stop_first``) and ▶ and wait until the readout is back at
    the end with ``final`` spans drawn; returns the samples of the replay."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    page.locator(".widget-dropdown", has_text="pace").locator("select").first.select_option(label=pace)
    page.wait_for_timeout(300)
    if stop_first:
        page.locator(".widget-play button").nth(1).click()
        page.wait_for_timeout(300)
    page.evaluate(REPLAY_SAMPLER_JS)
    page.locator(".widget-play button").first.click()
    try:
        page.wait_for_function(f"""(() => {{
            const s = window.__replay || [];
            const started = s.some(x => x[0] < {end});
            const last = s[s.length - 1];
            return started && last && last[0] === {end} && last[2] === {final};
        }})()""", timeout=120_000)
    except PlaywrightTimeout:
        seen = page.evaluate("() => window.__replay")
        pytest.fail(f"the replay at {pace} did not end on t = {end} s with {final} spans; samples "
                    f"[t, end, spans]: {seen[:5]} … {seen[-5:]} ({len(seen)} samples)")
    page.wait_for_timeout(1200)                     # two more frames' time: the replay stays at the end
    seen = page.evaluate("() => { clearInterval(window.__replayTimer); return window.__replay; }")
    return [tuple(x) for x in seen]


def test_live_gantt_grows_while_the_cell_runs(lab, tmp_path):
    mid = tmp_path / "live-bubbles-mid-run.png"

    def watch(page, _prompts):
        if mid.exists():
            return
        drawn = page.evaluate("() => new Set((window.__gantt || []).filter(s => s[2] && s[1] > 0)"
                              ".map(s => s[1])).size")
        if drawn >= 2:                          # the chart has grown at least once while the run ran
            page.screenshot(path=str(mid))

    with notebook_page(lab, "03-live-bubbles", tmp_path / "profile") as page:
        page.set_viewport_size({"width": 1400, "height": 1600})
        # as a person would: run the cells that build the (empty) chart, let it render, then run the live cell
        live_cell = page.locator(".jp-CodeCell", has_text="gantt.run(").first
        index = page.locator(".jp-CodeCell").evaluate_all(
            "(cells) => cells.findIndex(c => c.textContent.includes('gantt.run('))")
        live_cell.locator(".jp-InputPrompt").click()
        _run_all(page, lab["log"], command="Run All Above Selected Cell", done=lambda p: _finished(p[:index]))
        _wait_for_chart(page)
        live_cell.locator(".jp-InputPrompt").click()
        page.evaluate(SAMPLER_JS)
        _run_all(page, lab["log"], while_running=watch, command="Run Selected Cell and All Below")
        final = page.evaluate(GANTT_SPANS_JS)
        assert_readable("03-live-bubbles", page)
        samples = page.evaluate("() => window.__gantt")
        plots = page.evaluate(PLOTS_JS)
        page.locator(".js-plotly-plot").first.scroll_into_view_if_needed()
        page.wait_for_timeout(500)
        shot = tmp_path / "live-bubbles.png"
        page.screenshot(path=str(shot))
        end = _readout(page)[1]
        replays = {pace: _replay(page, pace, end, final) for pace in ("500 s per s", "2000 s per s")}
        replayed = tmp_path / "live-bubbles-replayed.png"
        page.screenshot(path=str(replayed))
        # ▶ alone, with the replay at its end, starts it over
        restarted = _replay(page, "500 s per s", end, final, stop_first=False)
    running = sorted({n for _, n, live in samples if live and n > 0})
    assert len(running) >= 2, f"the live Gantt was not seen growing while its run was running: {samples}"
    assert running[-1] <= final, (running, final)
    gaps = [b[0] - a[0] for a, b in zip(samples, samples[1:])]
    print(f"live Gantt: {len(running)} distinct sizes drawn while running, final {final} spans; "
          f"longest stall of the page's 200 ms timer {max(gaps, default=0)} ms")
    assert mid.exists(), "no screenshot was taken while the run was running"
    _save(mid, "live-bubbles-mid-run.png")
    _save(shot, "live-bubbles.png")
    live = plots[0]
    assert "simulated (model prediction)" in live["title"]
    assert {"window: trainer pool lent to rollout", "window: rollout pool lent to training",
            "end of a training step"} <= set(live["legend"]), live["legend"]
    _save(replayed, "live-bubbles-replayed.png")
    for pace, seen in replays.items():
        times = [t for t, _, _ in seen]
        # ▶ after the end started over (a frame before the end) and the replay's last frame is the run's end,
        # with every span drawn
        assert any(t < end for t in times), (pace, seen)
        assert seen[-1] == (end, end, final), (pace, seen[-1], end, final)
    assert any(t < end for t, _, _ in restarted) and restarted[-1] == (end, end, final), restarted[-5:]


#: notebook -> (plotly figures it draws at CI size, words a figure title must hold, words no title may hold)
OTHERS = {"04-run-on-ray": (2, ("emulated", "measured"), ()),
          "05-reproduce-paper": (1, ("quick variant",), ()),
          "06-calibrate-stage-models": (2, ("synthetic",), ("measured",)),
          "07-scaling": (1, ("median of",), ()),
          # an imported file: the importer cannot know how it was made, so never "measured (real engines)"
          "08-your-run": (7, ("imported from", "policy bidirl"), ("measured (real engines)",))}


#: what a reader cannot see: per plotly figure, the title/axis-title/annotation texts that run outside the figure's
#: SVG (clipped), and the axes drawn with tick labels shown but fewer than two; per table, whether it is wider
#: than its output area (the page). An axis counts when a trace uses it and it shows tick labels (a shared x
#: axis hides its upper copy's labels on purpose).
LAYOUT_JS = """() => {
    const out = {clipped: [], axes: [], tables: []};
    document.querySelectorAll('.js-plotly-plot').forEach((d, i) => {
        const svg = d.querySelector('svg.main-svg');
        if (!svg) return;
        const box = svg.getBoundingClientRect();
        d.querySelectorAll('text.gtitle, .g-xtitle text, .g-ytitle text, .g-x2title text, .g-y2title text, '
                           + '.g-x3title text, .g-y3title text, .annotation-text').forEach(t => {
            const r = t.getBoundingClientRect();
            if (r.width > 0 && (r.left < box.left - 1 || r.right > box.right + 1 || r.top < box.top - 1
                                || r.bottom > box.bottom + 1))
                out.clipped.push(`figure ${i}: "${t.textContent.slice(0, 80)}"`);
        });
        const full = d._fullLayout || {}, data = d._fullData || [];
        Object.keys(full).filter(k => /^[xy]axis[0-9]*$/.test(k)).forEach(k => {
            const ax = full[k], id = ax._id;
            const used = data.some(t => t.visible !== false && (t.xaxis === id || t.yaxis === id)
                                        && (t.x || t.y || []).length > 0);
            if (!used || ax.visible === false || ax.showticklabels === false) return;
            const labels = new Set(Array.from(d.querySelectorAll(`g.${id}tick text`))
                .map(e => e.textContent.trim()).filter(x => x));
            if (labels.size < 2) out.axes.push(`figure ${i} (${(full.title && full.title.text || '').slice(0, 40)}): `
                                               + `${k} shows ${labels.size} tick label(s) ${[...labels]}`);
        });
    });
    document.querySelectorAll('.jp-OutputArea-output table').forEach(t => {
        const area = t.closest('.jp-OutputArea-output');
        const over = t.getBoundingClientRect().width - area.getBoundingClientRect().width;
        if (over > 1) out.tables.push(`a table ${Math.round(over)} px wider than the page: `
                                      + t.textContent.trim().slice(0, 80));
    });
    return out;
}"""
#: the rendered markdown of every markdown cell, and the text of every output, in page order
TEXTS_JS = """() => ({
    markdown: Array.from(document.querySelectorAll('.jp-MarkdownCell .jp-RenderedMarkdown')).map(e => e.textContent),
    outputs: Array.from(document.querySelectorAll('.jp-OutputArea-output')).map(e => e.textContent)})"""


def reward_rises(outputs: list) -> tuple:
    """Whether the run's "mean reward per step: …" line rises by more than its step-to-step spread: the fitted
    change first → last (least-squares slope × steps spanned) above the standard deviation (ddof 1) of the
    step-to-step changes; fewer than three steps cannot show a trend."""
    import re

    import numpy as np
    lines = [m.group(1) for text in outputs for m in re.finditer(r"mean reward per step: ([-\d. ]+)", text)]
    if not lines:
        return False, "no 'mean reward per step' line in the outputs"
    r = np.array([float(x) for x in lines[-1].split()])
    if r.size < 3:
        return False, f"{r.size} step(s) of reward: too few to show a trend"
    rise, spread = np.polyfit(np.arange(r.size), r, 1)[0] * (r.size - 1), np.std(np.diff(r), ddof=1)
    return bool(rise > spread), f"reward {r.tolist()}: fitted change {rise:+.3f}, step-to-step spread {spread:.3f}"


#: notebook -> [(words in its markdown that state a trend, the check its outputs must pass)]: a sentence saying a
#: model "learns" needs a reward that rises by more than its step-to-step spread
TRENDS = {"04-run-on-ray": [(r"\blearns\b", reward_rises)]}


def unbacked_trends(name: str, texts: dict) -> list:
    """The trend words of ``name``'s markdown whose check fails on the notebook's outputs, with the numbers."""
    import re
    found = []
    for pattern, check in TRENDS.get(name, ()):
        said = [t for t in texts["markdown"] if re.search(pattern, t)]
        if said:
            ok, numbers = check(texts["outputs"])
            if not ok:
                found.append(f"the page says {pattern!r} ({said[0].strip()[:90]!r}) but {numbers}")
    return found


#: the notebooks whose figures and tables the layout checks hold to (08's figures belong to another change)
LAYOUT_CHECKED = {"01-quickstart", "02-partition-explorer", "03-live-bubbles", "04-run-on-ray", "05-reproduce-paper",
                  "06-calibrate-stage-models", "07-scaling"}


def assert_readable(name: str, page) -> None:
    """Every title visible in full, every axis with two tick labels, no table wider than the page, no trend word
    its outputs do not back (:data:`LAYOUT_JS`, :data:`TRENDS`)."""
    if name not in LAYOUT_CHECKED:
        return
    layout = page.evaluate(LAYOUT_JS)
    problems = ([f"clipped: {c}" for c in layout["clipped"]] + [f"axis: {a}" for a in layout["axes"]]
                + layout["tables"] + unbacked_trends(name, page.evaluate(TEXTS_JS)))
    assert not problems, f"{name}: what a reader cannot see or the outputs do not back:\n" + "\n".join(problems)


@pytest.mark.parametrize("name", list(OTHERS))
def test_the_other_notebooks_run_in_chromium(lab, tmp_path, name):
    figures, needed, refused = OTHERS[name]
    with notebook_page(lab, name, tmp_path / "profile") as page:
        _run_all(page, lab["log"], limit_s=900 if name == "04-run-on-ray" else RUN_ALL_S)
        errors = page.evaluate(ERRORS_JS)
        page.wait_for_function(f"document.querySelectorAll('.js-plotly-plot svg.main-svg').length >= {figures}",
                               timeout=60_000)
        plots = page.evaluate(PLOTS_JS)
        assert_readable(name, page)
        page.locator(".js-plotly-plot").last.scroll_into_view_if_needed()
        page.wait_for_timeout(500)
        shot = tmp_path / f"{name}.png"
        page.screenshot(path=str(shot))
    _save(shot, f"{name}.png")
    assert not errors, f"cells raised errors: {errors}"
    assert len(plots) >= figures and all(p["svg"] >= 1 for p in plots), plots
    titles = " | ".join(p["title"] for p in plots)
    assert all(w in titles for w in needed), (needed, titles)
    assert not any(w in titles for w in refused), (refused, titles)
