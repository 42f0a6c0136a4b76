"""Prepare notebooks for committing: ``python notebooks/clean.py notebooks/*.ipynb``.

Run a notebook top to bottom first (``BIDIRL_SMOKE=1`` gives the CI sizes), save it, then clean it. Every code
cell loses its outputs and execution count, except the cells marked ``# NBVAL_CHECK_OUTPUT``: they keep
their plain-text outputs, which nbval compares against (it does not check a cell saved unrun). Saved widget
state (``metadata.widgets``), run timestamps (``metadata.execution``) and the kernel's version details
(``metadata.language_info`` beyond its name) are dropped. ``tests/test_notebooks.py`` checks the result.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

CHECK = "# NBVAL_CHECK_OUTPUT"


def clean(book) -> int:
    """Clean ``book`` in place; returns the number of checked cells kept with outputs."""
    book.metadata.pop("widgets", None)
    book.metadata["language_info"] = {"name": "python"}       # the kernel's version details change per machine
    kept = 0
    for cell in book.cells:
        for key in ("execution", "scrolled", "collapsed"):      # run timestamps and view state
            cell.metadata.pop(key, None)
        if cell.cell_type != "code":
            cell.pop("outputs", None)
            cell.pop("execution_count", None)
            continue
        if not cell.source.lstrip().startswith(CHECK):
            cell.outputs, cell.execution_count = [], None
            continue
        if cell.execution_count is None or not cell.outputs:
            raise ValueError(f"checked cell {cell.get('id', '?')!r} has no output; run the notebook before cleaning")
        kept += 1
        outputs = []
        for out in cell.outputs:
            if out.output_type == "stream":
                outputs.append(nbformat.v4.new_output("stream", name=out.name, text=out.text))
            elif out.output_type == "execute_result" and "text/plain" in out.data:
                outputs.append(nbformat.v4.new_output("execute_result", data={"text/plain": out.data["text/plain"]},
                                                      execution_count=kept))
        cell.outputs, cell.execution_count = outputs, kept
    return kept


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path)
    args = parser.parse_args(argv)
    for path in args.paths:
        book = nbformat.read(path, as_version=4)
        try:
            kept = clean(book)
        except ValueError as exc:
            print(f"{path}: {exc}", file=sys.stderr)
            return 1
        nbformat.validate(book)
        nbformat.write(book, path)
        print(f"{path}: cleaned ({kept} checked cell(s) keep their output)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
