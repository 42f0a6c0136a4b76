"""Text and ticks every figure of the package shares: titles that wrap instead of running off the figure, and
log-scaled axes that always show readable tick labels.

Plotly neither wraps a title nor guarantees a tick on a log axis whose data spans less than a decade (``dtick=1``
then draws one label or none). These helpers sit in the results layer so that the simulator's figures
(``bidirl.sim.scaling``) and the experiments' figures (``bidirl.experiments.figures``) use the same rules.
"""

from __future__ import annotations

import math
import textwrap
from typing import Iterable, Optional

#: a title's font size in px, and a subtitle's (plotly's default title font is 16.8 px; a ``<sup>`` under it is
#: about 8 px, too small to read, so subtitles are set in a span of their own size)
TITLE_PX = 16
SUBTITLE_PX = 12
#: average advance of a character of plotly's default font (Open Sans) as a fraction of its size: measured
#: glyph advances of Open Sans average 0.55 em over English text; 0.6 em leaves room for digits and capitals
CHAR_EM = 0.6
#: px a title keeps clear of the figure's edges (plotly's title sits at x = 0.05 of the width, left-aligned)
TITLE_MARGIN_PX = 80


def wrap_lines(text: str, width_px: int, font_px: float) -> list:
    """``text`` broken at spaces into lines that fit ``width_px`` at ``font_px`` (see :data:`CHAR_EM`)."""
    chars = max(20, int((width_px - TITLE_MARGIN_PX) / (CHAR_EM * font_px)))
    return textwrap.wrap(text, width=chars, break_long_words=False, break_on_hyphens=False) or [""]


def wrapped_title(title: str, subtitle: str = "", width_px: int = 1000) -> dict:
    """A plotly ``layout.title`` for a figure ``width_px`` wide: the title and the subtitle each wrapped to fit
    (never clipped), the subtitle in a readable :data:`SUBTITLE_PX` span. Returns ``{"text": …, "font": …}``."""
    lines = wrap_lines(title, width_px, TITLE_PX)
    if subtitle:
        lines += [f"<span style='font-size:{SUBTITLE_PX}px'>{line}</span>"
                  for line in wrap_lines(subtitle, width_px, SUBTITLE_PX)]
    return {"text": "<br>".join(lines), "font": {"size": TITLE_PX}}


def title_height(title: dict) -> int:
    """The top margin in px a :func:`wrapped_title` needs: its lines at 1.3 line heights, plus the gap above the
    plot area (plotly's default top margin is 100 px for a one-line title)."""
    lines = title["text"].count("<br>") + 1
    return int(40 + lines * 1.3 * TITLE_PX)


def _nice(x: float) -> float:
    """``x`` rounded to two significant digits."""
    if x <= 0 or not math.isfinite(x):
        raise ValueError(f"a log axis needs positive finite values, got {x!r}")
    digits = 1 - int(math.floor(math.log10(x)))
    return round(x, digits)


def log_ticks(values: Iterable[float], errors: Optional[Iterable[float]] = None) -> dict:
    """Axis settings for a log-scaled axis over ``values`` (and ``errors``, further values to cover such as
    error-bar ends): ``{"range", "tickvals", "ticktext"}`` with at least two tick labels inside the range.

    Ticks are the 1-2-5 values of each decade in the range; when fewer than two fall inside (data within a factor
    of about 2.5), every integer mantissa; when still fewer, three values evenly spaced in log, rounded to two
    significant digits. The range pads the data by 8 % of its span in log (at least 0.05 decades)."""
    xs = [float(v) for v in values] + [float(v) for v in (errors or ())]
    xs = [v for v in xs if math.isfinite(v)]
    if not xs or min(xs) <= 0:
        raise ValueError(f"log_ticks needs positive finite values, got {xs!r}")
    lo, hi = math.log10(min(xs)), math.log10(max(xs))
    pad = max(0.05, 0.08 * (hi - lo))
    lo, hi = lo - pad, hi + pad
    decades = range(int(math.floor(lo)), int(math.ceil(hi)) + 1)
    ticks: list = []
    for mantissas in ((1, 2, 5), tuple(range(1, 10))):
        ticks = [m * 10.0 ** e for e in decades for m in mantissas if lo <= math.log10(m * 10.0 ** e) <= hi]
        if len(ticks) >= 2:
            break
    if len(ticks) < 2:
        inner = (hi - lo) / 4
        ticks = sorted({_nice(10 ** (lo + inner * k)) for k in (1, 2, 3)})
    return {"range": [lo, hi], "tickvals": ticks, "ticktext": [f"{t:,.10g}" for t in ticks]}


def plain_text(text: str) -> str:
    """A title as a reader reads it: line breaks as spaces, markup (``<span …>``, ``<sup>``) dropped."""
    import re
    return re.sub(r"<[^>]+>", "", re.sub(r"<br\s*/?>", " ", text or ""))
