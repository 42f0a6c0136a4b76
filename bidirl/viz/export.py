"""Figures to files: a self-contained HTML file always, PNG through kaleido where it can drive a browser, with
a cache of rendered PNGs by figure content (rendering is most of a report re-run's time)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Mapping, Optional, Union

import plotly.graph_objects as go

#: (width, height) px of a PNG whose figure sets no size of its own
PNG_SIZE: tuple = (1000, 600)


def write_pngs(figures: Mapping[Union[str, Path], go.Figure], cache_dir: Optional[Union[str, Path]] = None,
               ) -> Optional[str]:
    """Write each figure as PNG at its path with kaleido, in one batch (one browser start for all); returns
    ``None`` when written, else why not (kaleido missing, or no browser it can drive) — nothing is left half
    written. PNG export is optional; HTML always works.

    With ``cache_dir``, a PNG is kept there under a hash of the figure's JSON, its size and kaleido's version, and
    a figure seen before is copied from it instead of rendered again (a browser start and ≈ 1 s a figure), so a
    re-run whose figures did not change writes its PNGs at once.
    """
    try:
        import kaleido
    except ImportError:
        return "kaleido is not installed (pip install kaleido; it also needs a Chrome or Chromium)"
    import plotly.io as pio
    # kaleido renders at its default size unless told; use each figure's own, so the PNG looks like the HTML
    jobs = [(Path(p), f, int(f.layout.width or PNG_SIZE[0]), int(f.layout.height or PNG_SIZE[1]))
            for p, f in figures.items()]
    cached = {}
    if cache_dir is not None:
        cache = Path(cache_dir)
        version = getattr(kaleido, "__version__", "")
        for path, fig, w, h in jobs:
            key = hashlib.sha256(f"{fig.to_json()}|{w}x{h}|{version}".encode()).hexdigest()
            cached[path] = cache / key[:2] / f"{key}.png"
    render = [j for j in jobs if j[0] not in cached or not cached[j[0]].is_file()]
    try:
        if render:
            pio.write_images([j[1] for j in render], [str(j[0]) for j in render],
                             width=[j[2] for j in render], height=[j[3] for j in render])
    except Exception as exc:  # noqa: BLE001 — no browser, a kaleido/Chrome mismatch, ...
        for path, *_ in jobs:
            path.unlink(missing_ok=True)
        return f"kaleido could not render ({type(exc).__name__}: {str(exc)[:160]})"
    rendered = {j[0] for j in render}
    for path, entry in cached.items():
        if path in rendered:
            entry.parent.mkdir(parents=True, exist_ok=True)
            tmp = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")   # atomic: no half entry is ever read
            shutil.copyfile(path, tmp)
            os.replace(tmp, entry)
        else:
            shutil.copyfile(entry, path)
    return None


def write_png(fig: go.Figure, path: Union[str, Path]) -> Optional[str]:
    """:func:`write_pngs` for one figure."""
    return write_pngs({path: fig})


def export_figure(fig: go.Figure, path: Union[str, Path], png: bool = True) -> dict:
    """Save ``fig`` as a self-contained HTML file at ``path`` (``.html`` added when missing) and, with ``png``,
    beside it as PNG where kaleido can render. Returns ``{"html": Path, "png": Path or None, "note": str}``."""
    path = Path(path)
    html = path if path.suffix == ".html" else path.with_name(path.name + ".html")
    html.parent.mkdir(parents=True, exist_ok=True)
    fig.write_html(str(html), include_plotlyjs=True)
    out = {"html": html, "png": None, "note": "HTML only"}
    if png:
        target = html.with_suffix(".png")
        why = write_png(go.Figure(fig), target)
        out.update(png=None if why else target, note=f"PNG skipped: {why}" if why else "HTML and PNG")
    return out
