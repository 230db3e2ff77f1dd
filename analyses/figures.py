"""Figures for the report: inline SVG markup (``analyses.svg``), or matplotlib figures drawn
with its object API (no pyplot, no display), imported only when one is drawn."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure as MplFigure


@dataclass
class Figure:
    """A figure for the report: heatmaps are embedded as PNG, line charts as inline SVG; a
    figure drawn without matplotlib is its SVG markup (``format="markup"``), already escaped."""

    id: str
    title: str
    alt: str
    figure: MplFigure | str
    format: str = "png"


def heatmap(
    ax,
    grid,
    *,
    vmin: float,
    vmax: float,
    cmap: str,
    label: str | None = None,
    x_axis: bool = True,
    y_axis: bool = True,
):
    """A layer x head heatmap (rows: layers, columns: heads, both 0-based).

    Drawn with ``imshow`` (seaborn's heatmap re-measures its tick labels by drawing the figure
    many times, which dominated report rendering). Small multiples label only their outer axes.
    """
    image = ax.imshow(grid.to_numpy(dtype=float), vmin=vmin, vmax=vmax, cmap=cmap, aspect="auto")
    for labelled, size, names, set_ticks, set_label, title in (
        (x_axis, grid.shape[1], grid.columns, ax.set_xticks, ax.set_xlabel, "head"),
        (y_axis, grid.shape[0], grid.index, ax.set_yticks, ax.set_ylabel, "layer"),
    ):
        if labelled:
            step = max(1, size // 16)
            set_ticks(range(0, size, step), [str(n) for n in names[::step]], fontsize="x-small")
            set_label(title)
        else:
            set_ticks([])
    if label is not None:
        ax.figure.colorbar(image, ax=ax, label=label, shrink=0.9)
    return image
