"""The notebooks are committed clean and CI-ready (they are *run* by nbval, see the Makefile's test-notebooks).

Clean a notebook for committing with ``python notebooks/clean.py notebooks/*.ipynb`` after running it.
Checks, without a kernel: every notebook parses; no saved widget state (``metadata.widgets``); the smoke
switch is the first code cell; only ``# NBVAL_CHECK_OUTPUT`` cells carry outputs — plain text, nbval's
reference — and every other cell is committed unrun; a notebook that uses Ray shuts it down in its last
cell; no machine-specific paths; the sanitizer file is well formed.
"""

from __future__ import annotations

import configparser
import re
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
EXPECTED = ("01-quickstart", "02-partition-explorer", "03-live-bubbles", "04-run-on-ray", "05-reproduce-paper",
            "06-calibrate-stage-models", "07-scaling", "08-your-run")
SMOKE_LINE = 'SMOKE = os.environ.get("BIDIRL_SMOKE", "0") == "1"'
CHECK = "# NBVAL_CHECK_OUTPUT"
TEXT_OUTPUTS = {"stream", "execute_result"}
MACHINE_PATHS = re.compile(r"(?<![\w.])/(work|farm|tmp)/")

PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))


def _code(book) -> list:
    return [c for c in book.cells if c.cell_type == "code"]


def test_every_notebook_is_there():
    assert [p.stem for p in PATHS] == list(EXPECTED)


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_notebook_is_committed_clean(path):
    book = nbformat.read(path, as_version=4)
    nbformat.validate(book)
    assert "widgets" not in book.metadata, f"{path.name}: strip metadata.widgets before committing"
    assert book.metadata.get("kernelspec", {}).get("name") == "python3"
    cells = _code(book)
    assert cells and SMOKE_LINE in cells[0].source, f"{path.name}: the first code cell must define {SMOKE_LINE}"
    for i, cell in enumerate(cells):
        checked = cell.source.lstrip().startswith(CHECK)
        if not checked:
            assert not cell.outputs and cell.execution_count is None, \
                f"{path.name} code cell {i}: commit it without outputs (only {CHECK} cells keep theirs)"
            continue
        assert cell.outputs and cell.execution_count is not None, \
            f"{path.name} code cell {i}: a {CHECK} cell needs its reference output (nbval skips unrun cells)"
        for out in cell.outputs:
            assert out.output_type in TEXT_OUTPUTS, f"{path.name} cell {i}: {out.output_type} output"
            if out.output_type == "execute_result":
                assert set(out.data) == {"text/plain"}, f"{path.name} cell {i}: keep only text/plain"
    for cell in book.cells:
        assert "execution" not in cell.metadata, f"{path.name}: run timestamps saved; run notebooks/clean.py"
        text = cell.source + "".join(str(o) for o in cell.get("outputs", []))
        assert not MACHINE_PATHS.search(text), f"{path.name}: a machine-specific path in {cell.source[:60]!r}"


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_ray_is_shut_down_at_the_end(path):
    book = nbformat.read(path, as_version=4)
    cells = _code(book)
    if any(re.search(r"^\s*(import ray|from bidirl\.cluster)", c.source, re.M) for c in cells):
        assert "ray.shutdown()" in cells[-1].source, f"{path.name} uses Ray: end with ray.shutdown()"


def test_sanitizer_file_is_well_formed():
    from nbval.plugin import get_sanitize_patterns

    text = (NOTEBOOKS / "sanitize.cfg").read_text()
    parser = configparser.RawConfigParser()
    parser.read_string(text)
    pairs = get_sanitize_patterns(text)                  # what nbval itself reads
    assert parser.sections() and len(pairs) == len(parser.sections())
    for regex, _replace in pairs:
        re.compile(regex)


def test_a_notebook_left_to_the_browser_test_has_nothing_only_nbval_would_check():
    """The Makefile's notebook part leaves out what the browser test runs (``BROWSER_RUN``, ignored by nbval
    where chromium is installed): such a notebook must be one the browser test runs, with no
    ``# NBVAL_CHECK_OUTPUT`` cell (whose output nbval compares and the browser test does not)."""
    makefile = (NOTEBOOKS.parent / "Makefile").read_text()
    line = next(ln for ln in makefile.splitlines() if ln.startswith("BROWSER_RUN :="))
    left_out = line.split(":=", 1)[1].split()
    assert left_out, line
    assert "$(BROWSER_RUN:%=--ignore=notebooks/%.ipynb)" in makefile, "nbval no longer ignores BROWSER_RUN"
    browser = (NOTEBOOKS.parent / "tests" / "test_browser.py").read_text()
    for name in left_out:
        assert f'"{name}"' in browser, f"{name} is left out of nbval but the browser test does not run it"
        book = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
        assert not any(c.source.lstrip().startswith(CHECK) for c in _code(book)), \
            f"{name} has {CHECK} cells: only nbval checks them, so it cannot be left to the browser test"
