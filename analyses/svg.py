"""Figures drawn as inline SVG markup, without matplotlib: layer x head heatmaps, line charts
and scatter plots (points of several shapes, on logarithmic or categorical axes).

They take milliseconds to draw where matplotlib took over a second (and half a second more to
import), stay sharp at any zoom, and name their values when hovered (each cell and point has a
``<title>``). Text and axes are drawn in ``currentColor``, so a figure follows the page's light
or dark theme. Every label is escaped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

from probe.lazy import lazy

np = lazy("numpy")
pd = lazy("pandas")


# Colour maps as evenly spaced anchors, interpolated linearly in RGB.
VIRIDIS = ("#440154", "#472d7b", "#3b528b", "#2c728e", "#21918c", "#28ae80", "#5ec962",
           "#addc30", "#fde725")  # fmt: skip
MAGMA = ("#000004", "#1c1044", "#4f127b", "#812581", "#b5367a", "#e55064", "#fb8761",
         "#fec287", "#fcfdbf")  # fmt: skip
BLUE_RED = (
    "#053061",
    "#2166ac",
    "#4393c3",
    "#92c5de",
    "#d1e5f0",
    "#f7f7f7",
    "#fddbc7",
    "#f4a582",
    "#d6604d",
    "#b2182b",
    "#67001f",
)  # fmt: skip  (ColorBrewer RdBu, reversed)
# Line colours, one per series in turn.
CATEGORIES = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
              "#7f7f7f", "#bcbd22", "#17becf")  # fmt: skip
MISSING = "#d0d3d8"  # a cell without a value
FONT = 'font-family="system-ui, sans-serif" fill="currentColor"'


def colour(anchors: Sequence[str], t: float) -> str:
    """The colour at ``t`` in [0, 1] (clipped) of a map given by its anchors."""
    if not math.isfinite(t):
        return MISSING
    position = min(max(t, 0.0), 1.0) * (len(anchors) - 1)
    i = min(int(position), len(anchors) - 2)
    low, high = (np.array([int(a[k : k + 2], 16) for k in (1, 3, 5)]) for a in anchors[i : i + 2])
    r, g, b = np.rint(low + (position - i) * (high - low)).astype(int)
    return f"#{r:02x}{g:02x}{b:02x}"


def spread(anchors: Sequence[str], n: int) -> list[str]:
    """``n`` colours evenly spaced along a map (e.g. one per layer)."""
    return [colour(anchors, k / max(n - 1, 1)) for k in range(n)]


@dataclass
class Grid:
    """One heatmap: by default rows are layers and columns heads (as in a pivot table), with
    ``axes`` naming them otherwise; optionally a ★ on one cell (its row and column labels)."""

    title: str
    values: pd.DataFrame
    star: tuple[int, int] | None = None
    axes: tuple[str, str] = ("layer", "head")


def heatmaps(
    grids: Sequence[Grid],
    *,
    vmin: float,
    vmax: float,
    anchors: Sequence[str],
    label: str,
    alt: str,
    name: str,
    columns: int = 4,
    size: tuple[int, int] = (190, 130),
) -> str:
    """Small multiples of layer x head heatmaps on one colour scale, with its colour bar.

    Parameters
    ----------
    grids : sequence of Grid
    vmin, vmax : float
        The colour scale's ends (values beyond are clipped to them).
    anchors : sequence of str
        The colour map (``VIRIDIS``, ``MAGMA``, ``BLUE_RED``).
    label : str
        What the colour bar measures.
    alt : str
        The figure's text alternative.
    name : str
        Unique on the page (it names the colour bar's gradient).
    columns : int
        Heatmaps per row.
    size : (int, int)
        Each heatmap's plotting area in pixels (width, height).
    """
    pw, ph = size
    left, top, gap_x, gap_y, bar = 34, 24, 50, 54, 100
    columns = max(1, min(columns, len(grids)))
    rows = -(-len(grids) // columns)
    bar_x = left + columns * (pw + gap_x) - gap_x + 24
    width = bar_x + bar - 24
    height = top + rows * (ph + gap_y)
    parts = [_open(width, height, alt)]
    scale = max(vmax - vmin, 1e-12)
    for k, grid in enumerate(grids):
        x0 = left + (k % columns) * (pw + gap_x)
        y0 = top + (k // columns) * (ph + gap_y)
        values = grid.values.to_numpy(dtype=float)
        row_name, column_name = grid.axes
        n_rows, n_cols = values.shape
        cw, ch = pw / max(n_cols, 1), ph / max(n_rows, 1)
        parts.append(_text(x0, y0 - 8, grid.title, size=10))
        for i, layer in enumerate(grid.values.index):
            for j, head in enumerate(grid.values.columns):
                v = values[i, j]
                fill = colour(anchors, (v - vmin) / scale)
                shown = "no value" if not math.isfinite(v) else f"{v:.3g}"
                parts.append(
                    f'<rect x="{x0 + j * cw:.1f}" y="{y0 + i * ch:.1f}" width="{cw + 0.3:.1f}" '
                    f'height="{ch + 0.3:.1f}" fill="{fill}"><title>'
                    f"{escape(f'{row_name} {layer}, {column_name} {head}')}: {shown}</title></rect>"
                )
        if grid.star is not None and grid.star[0] in grid.values.index:
            i = list(grid.values.index).index(grid.star[0])
            j = list(grid.values.columns).index(grid.star[1])
            parts.append(_text(x0 + (j + 0.5) * cw, y0 + (i + 0.5) * ch + 5, "★", size=14,
                               anchor="middle", fill="#ffd400", stroke="#000"))  # fmt: skip
        parts += _ticks_x(x0, y0 + ph, cw, list(grid.values.columns), column_name)
        parts += _ticks_y(x0, y0, ch, list(grid.values.index), row_name)
    parts.append(_colour_bar(f"{name}-bar", bar_x, top, 12, min(ph * rows, 220),
                             vmin, vmax, anchors, label))  # fmt: skip
    parts.append("</svg>")
    return "".join(parts)


# The shapes a point can be drawn as (``Series.shape``).
SHAPES = ("circle", "square", "diamond", "dash")


@dataclass
class Series:
    """One line of a chart; ``markers`` draws (and titles) each point, as a ``shape`` of
    ``SHAPES``; without ``line``, the points alone (a scatter plot)."""

    label: str
    x: Sequence[float]
    y: Sequence[float]
    colour: str | None = None
    markers: bool = True
    dashed: bool = False
    line: bool = True
    shape: str = "circle"


@dataclass
class Chart:
    """One panel of line charts. With ``x_labels``, the x axis is categorical: x = k is the
    k-th label (points may sit between, e.g. side by side around their category)."""

    title: str
    series: list[Series]
    xlabel: str
    ylabel: str
    log_y: bool = False
    integer_x: bool = True
    legend: bool = True
    log_x: bool = False
    x_labels: Sequence[str] | None = None
    x_max: float | None = None  # where the x axis ends, labelled (a total), not a round tick


def charts(panels: Sequence[Chart], *, alt: str, size: tuple[int, int] = (330, 210)) -> str:
    """Line charts side by side, each with its axes and its legend on the right.

    Parameters
    ----------
    panels : sequence of Chart
    alt : str
        The figure's text alternative.
    size : (int, int)
        Each chart's plotting area in pixels (width, height).
    """
    pw, ph = size
    left, top, bottom, legend_w = 58, 26, 42, 150
    panel_w = left + pw + (legend_w if any(p.legend for p in panels) else 12)
    width, height = panel_w * len(panels), top + ph + bottom
    parts = [_open(width, height, alt)]
    for k, panel in enumerate(panels):
        parts += _chart(panel, k * panel_w + left, top, pw, ph)
    parts.append("</svg>")
    return "".join(parts)


@dataclass
class _Axis:
    """Data values to pixels: ``low`` maps to ``start``, ``high`` to ``end`` (log10 first on a
    logarithmic axis)."""

    low: float
    high: float
    start: float
    end: float
    log: bool = False

    def __call__(self, v):
        scale = np.log10 if self.log else np.asarray
        low, high = float(scale(self.low)), float(scale(self.high))
        v = scale(np.asarray(v, float))
        return self.start + (v - low) / max(high - low, 1e-12) * (self.end - self.start)


def _chart(panel: Chart, x0: float, y0: float, pw: float, ph: float) -> list[str]:
    """One chart whose plotting area starts at (x0, y0)."""
    parts = [_text(x0, y0 - 10, panel.title, size=12)]
    points = [(np.asarray(s.x, float), np.asarray(s.y, float)) for s in panel.series]
    if panel.log_y:  # a logarithmic axis shows positive values only
        points = [(x[y > 0], y[y > 0]) for x, y in points]
    if panel.log_x:
        points = [(x[x > 0], y[x > 0]) for x, y in points]
    xs = np.concatenate([x for x, _ in points]) if points else np.array([])
    ys = np.concatenate([y for _, y in points]) if points else np.array([])
    xs, ys = xs[np.isfinite(xs)], ys[np.isfinite(ys)]
    if not xs.size or not ys.size:  # nothing to draw: empty axes
        xs, ys = np.array([1.0, 10.0] if panel.log_x else [0.0, 1.0]), np.array([1.0, 1.0])
    if panel.x_labels is not None:
        x_ticks = list(range(len(panel.x_labels)))
        to_x = _Axis(-0.5, len(x_ticks) - 0.5, x0, x0 + pw)
    else:
        x_ticks = _x_ticks(panel, xs)
        to_x = _Axis(x_ticks[0], x_ticks[-1], x0, x0 + pw, log=panel.log_x)
    y_ticks = _decades(ys) if panel.log_y else _nice_ticks(min(ys.min(), 0.0), ys.max())
    to_y = _Axis(y_ticks[0], y_ticks[-1], y0 + ph, y0, log=panel.log_y)
    parts.append('<g stroke="currentColor" stroke-opacity="0.25" stroke-width="1">')
    for t in y_ticks:
        y = float(to_y(t))
        parts.append(f'<line x1="{x0}" x2="{x0 + pw}" y1="{y:.1f}" y2="{y:.1f}"/>')
    parts.append("</g>")
    parts.append(f'<rect x="{x0}" y="{y0}" width="{pw}" height="{ph}" fill="none" '
                 'stroke="currentColor" stroke-opacity="0.6"/>')  # fmt: skip
    for t in x_ticks:
        text = f"1e{round(math.log10(t))}" if panel.log_x else _x_text(panel, t)
        parts.append(_text(float(to_x(t)), y0 + ph + 14, text, size=10, anchor="middle"))
    for t in y_ticks:
        text = f"1e{round(math.log10(t))}" if panel.log_y else _number(t)
        parts.append(_text(x0 - 5, float(to_y(t)) + 3.5, text, size=10, anchor="end"))
    parts.append(_text(x0 + pw / 2, y0 + ph + 32, panel.xlabel, size=11, anchor="middle"))
    parts.append(_vertical(x0 - 44, y0 + ph / 2, panel.ylabel, size=11))
    per_column = max(1, int(ph // 14))
    for n, (series, (x, y)) in enumerate(zip(panel.series, points, strict=True)):
        c = series.colour or CATEGORIES[n % len(CATEGORIES)]
        px, py = to_x(x), to_y(y)
        label = escape(series.label)
        path = " ".join(f"{a:.1f},{b:.1f}" for a, b in zip(px, py, strict=True))
        dash = ' stroke-dasharray="5 3"' if series.dashed else ""
        if series.line:
            parts.append(f'<polyline points="{path}" fill="none" stroke="{c}" stroke-width="1.6"'
                         f"{dash}><title>{label}</title></polyline>")  # fmt: skip
        if series.markers or not series.line:
            for a, b, vx, vy in zip(px, py, x, y, strict=True):
                title = f"{label}: {escape(_x_text(panel, vx))}, {vy:.3g}"
                parts.append(_marker(series.shape, a, b, c, title))
        if panel.legend:
            lx = x0 + pw + 10 + (n // per_column) * 72
            ly = y0 + 8 + (n % per_column) * 14
            key = (f'<line x1="{lx}" x2="{lx + 14}" y1="{ly}" y2="{ly}" stroke="{c}" '
                   f'stroke-width="2"{dash}/>' if series.line
                   else _marker(series.shape, lx + 7, ly, c))  # fmt: skip
            parts.append(f'{key}<text x="{lx + 18}" y="{ly + 3.5}" font-size="10" {FONT}>'
                         f"{label}</text>")  # fmt: skip
    return parts


def _x_ticks(panel: Chart, xs: np.ndarray) -> list[float]:
    """The x axis's ticks over ``xs``, ending at ``panel.x_max`` where it is given."""
    if panel.log_x:
        return _decades(xs)
    ticks = _nice_ticks(xs.min(), xs.max(), integer=panel.integer_x)
    if panel.x_max is not None:  # round ticks short of it, then it
        near = 0.1 * (panel.x_max - ticks[0])  # a tick this close would overprint it
        ticks = [t for t in ticks if t < panel.x_max - near] + [panel.x_max]
    return ticks


def _x_text(panel: Chart, v: float) -> str:
    """What the x axis calls the value ``v``: on a categorical axis, the nearest label."""
    if panel.x_labels is not None:
        return str(panel.x_labels[min(max(round(v), 0), len(panel.x_labels) - 1)])
    return _number(v)


def _marker(shape: str, x: float, y: float, c: str, title: str = "") -> str:
    """A point drawn as one of ``SHAPES`` centred on (x, y), with its (escaped) title."""
    inner = f"<title>{title}</title>" if title else ""
    if shape == "circle":
        return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{c}">{inner}</circle>'
    if shape == "square":
        return (f'<rect x="{x - 3:.1f}" y="{y - 3:.1f}" width="6" height="6" fill="{c}">'
                f"{inner}</rect>")  # fmt: skip
    if shape == "diamond":
        corners = f"{x:.1f},{y - 4:.1f} {x + 4:.1f},{y:.1f} {x:.1f},{y + 4:.1f} {x - 4:.1f},{y:.1f}"
        return f'<polygon points="{corners}" fill="{c}">{inner}</polygon>'
    if shape == "dash":
        return (f'<line x1="{x - 6:.1f}" x2="{x + 6:.1f}" y1="{y:.1f}" y2="{y:.1f}" stroke="{c}" '
                f'stroke-width="2">{inner}</line>')  # fmt: skip
    raise ValueError(f"unknown marker shape {shape!r}; use one of {', '.join(SHAPES)}")


def _open(width: float, height: float, alt: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width:.0f} {height:.0f}" '
            f'width="{width:.0f}" height="{height:.0f}" role="img" '
            f'aria-label="{escape(alt)}">')  # fmt: skip


def _text(x: float, y: float, text: str, *, size: int, anchor: str = "start", fill: str = "",
          stroke: str = "") -> str:  # fmt: skip
    paint = f'fill="{fill}" stroke="{stroke}" stroke-width="0.6"' if fill else FONT
    font = "" if not fill else 'font-family="system-ui, sans-serif"'
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
            f"{font} {paint}>{escape(text)}</text>")  # fmt: skip


def _ticks_x(x0: float, y: float, cw: float, names: list, title: str) -> list[str]:
    step = max(1, len(names) // 8)
    out = [_text(x0 + (j + 0.5) * cw, y + 11, str(names[j]), size=9, anchor="middle")
           for j in range(0, len(names), step)]  # fmt: skip
    out.append(_text(x0 + cw * len(names) / 2, y + 24, title, size=10, anchor="middle"))
    return out


def _ticks_y(x: float, y0: float, ch: float, names: list, title: str) -> list[str]:
    step = max(1, len(names) // 8)
    out = [_text(x - 4, y0 + (i + 0.5) * ch + 3, str(names[i]), size=9, anchor="end")
           for i in range(0, len(names), step)]  # fmt: skip
    out.append(_vertical(x - 20, y0 + ch * len(names) / 2, title, size=10))
    return out


def _vertical(x: float, y: float, text: str, *, size: int) -> str:
    """Text centred on (x, y), reading upwards."""
    return (f'<text transform="translate({x:.1f},{y:.1f}) rotate(-90)" text-anchor="middle" '
            f'font-size="{size}" {FONT}>{escape(text)}</text>')  # fmt: skip


def _colour_bar(ident: str, x: float, y: float, w: float, h: float, vmin: float, vmax: float,
                anchors: Sequence[str], label: str) -> str:  # fmt: skip
    gradient = "".join(
        f'<stop offset="{k / (len(anchors) - 1):.3f}" stop-color="{a}"/>'
        for k, a in enumerate(reversed(anchors))  # top of the bar: vmax
    )
    ticks = [vmax, (vmin + vmax) / 2, vmin]
    labels = "".join(_text(x + w + 4, y + k * h / 2 + 3.5, _number(t), size=9)
                     for k, t in enumerate(ticks))  # fmt: skip
    return (
        f'<defs><linearGradient id="{ident}" x1="0" x2="0" y1="0" y2="1">{gradient}'
        f'</linearGradient></defs><rect x="{x}" y="{y}" width="{w}" height="{h}" '
        f'fill="url(#{ident})" stroke="currentColor" stroke-opacity="0.4"/>{labels}'
        + _vertical(x + w + 52, y + h / 2, label, size=10)
    )


def _decades(values: np.ndarray) -> list[float]:
    """The powers of ten covering positive ``values``, for a logarithmic axis."""
    low, high = math.floor(np.log10(values.min())), math.ceil(np.log10(values.max()))
    return [10.0**e for e in range(low, max(high, low + 1) + 1)]


def _nice_ticks(low: float, high: float, *, integer: bool = False, target: int = 5) -> list[float]:
    """Round tick values (steps of 1, 2 or 5 times a power of ten) covering [low, high]."""
    if high <= low:
        high = low + 1
    raw = (high - low) / target
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 5, 10) if m * step >= raw)
    if integer:
        step = max(1, round(step))
    start = math.floor(low / step + 1e-9) * step
    ticks = [start]
    while ticks[-1] < high - 1e-9 * step:
        ticks.append(ticks[-1] + step)
    return [round(t, 12) for t in ticks]


def _number(v: float) -> str:
    return f"{v:.0f}" if float(v).is_integer() else f"{v:.3g}"
