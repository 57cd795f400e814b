"""A small line chart in plain SVG for the benchmarks' pictures in docs/ (no plotting library).

    parts = line_chart(0, 0, 420, 300, title="...", x_labels=["1M", "4M"], y_label="ms",
                       series=[Series("a", "#1f77b4", [1.0, 3.0])])
    Path("docs/x.svg").write_text(document(460, 380, parts, footnote="..."))

Points sit at evenly spaced (or log-scaled) x positions, one per label; y is linear or
logarithmic; a ``None`` value leaves a gap. ``legend`` lays labels out in columns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from xml.sax.saxutils import escape


@dataclass
class Series:
    label: str
    color: str
    values: list[float | None]
    dash: bool = False


def _ticks(lo: float, hi: float, log_y: bool) -> list[float]:
    if log_y:
        out, v = [], lo
        while v <= hi * 1.0001:
            out.append(v)
            v *= 10
        return out
    return [lo + (hi - lo) * k / 4 for k in range(5)]


def line_chart(
    x0: float,
    y0: float,
    width: float,
    height: float,
    *,
    title: str,
    x_labels: list[str],
    y_label: str,
    series: list[Series],
    log_y: bool = True,
    y_range: tuple[float, float] | None = None,
    x_values: list[float] | None = None,
) -> list[str]:
    """SVG elements of one chart whose outer box starts at (x0, y0).

    With ``x_values`` (all > 0) the labels sit at log-scaled positions, else evenly.
    """
    ml, mt, mb = 60, 28, 30
    pw, ph = width - ml - 10, height - mt - mb
    values = [v for s in series for v in s.values if v is not None and v > 0]
    if y_range is not None:
        lo, hi = y_range
    elif log_y:
        lo = 10 ** math.floor(math.log10(min(values)))
        hi = 10 ** math.ceil(math.log10(max(values)))
    else:
        lo, hi = 0.0, max(values) * 1.1
    left, top = x0 + ml, y0 + mt
    if x_values is not None and len(x_values) > 1:
        a, b = math.log10(min(x_values)), math.log10(max(x_values))
        xs = [left + 20 + (math.log10(v) - a) / (b - a) * (pw - 40) for v in x_values]
    else:
        step = (pw - 40) / max(1, len(x_labels) - 1)
        xs = [left + 20 + k * step for k in range(len(x_labels))]

    def yv(v: float) -> float:
        if log_y:
            frac = (math.log10(v) - math.log10(lo)) / math.log10(hi / lo)
        else:
            frac = (v - lo) / (hi - lo)
        return top + ph - frac * ph

    parts = [
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#333"/>',
        f'<text x="{left + pw / 2}" y="{top - 10}" text-anchor="middle" '
        f'font-weight="bold">{escape(title)}</text>',
        f'<text x="{left - 45}" y="{top + ph / 2}" text-anchor="middle" '
        f'transform="rotate(-90 {left - 45} {top + ph / 2})">{escape(y_label)}</text>',
    ]
    for t in _ticks(lo, hi, log_y):
        y = yv(t)
        parts.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>'
            f'<text x="{left - 5}" y="{y + 4:.1f}" text-anchor="end">{t:g}</text>'
        )
    for label, x in zip(x_labels, xs, strict=True):
        parts.append(
            f'<text x="{x:.1f}" y="{top + ph + 15}" text-anchor="middle">{escape(label)}</text>'
        )
    for s in series:
        pts = [(x, yv(v)) for x, v in zip(xs, s.values, strict=True) if v is not None and v > 0]
        dash = ' stroke-dasharray="6,4"' if s.dash else ""
        line = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
        parts.append(
            f'<polyline points="{line}" fill="none" stroke="{s.color}" stroke-width="2"{dash}/>'
        )
        parts += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{s.color}"/>' for x, y in pts]
    return parts


def legend(x0: float, y0: float, series: list[Series], columns: int, col_width: float) -> list[str]:
    parts = []
    for k, s in enumerate(series):
        lx, ly = x0 + (k % columns) * col_width, y0 + (k // columns) * 16
        dash = ' stroke-dasharray="6,4"' if s.dash else ""
        parts.append(
            f'<line x1="{lx}" x2="{lx + 25}" y1="{ly}" y2="{ly}" stroke="{s.color}" '
            f'stroke-width="3"{dash}/><text x="{lx + 30}" y="{ly + 4}">{escape(s.label)}</text>'
        )
    return parts


def document(width: float, height: float, parts: list[str], footnote: str = "") -> str:
    head = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
    ]
    foot = []
    if footnote:
        foot = [f'<text x="10" y="{height - 8}" fill="#555">{escape(footnote)}</text>']
    return "\n".join(head + parts + foot + ["</svg>"]) + "\n"
