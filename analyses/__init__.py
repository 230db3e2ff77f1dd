"""One module per analysis. Each streams over batches of captures keeping only sums (or, for
weights, reads the model once), and turns its tables into figures for the report."""

from __future__ import annotations

from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")  # figures are rendered to files, never shown

from matplotlib.figure import Figure as _MplFigure


@dataclass
class Figure:
    """A figure for the report: heatmaps are embedded as PNG, line charts as inline SVG."""

    id: str
    title: str
    alt: str
    figure: _MplFigure
    format: str = "png"


def heatmap(ax, grid, *, vmin: float, vmax: float, cmap: str, label: str | None = None):
    """A layer x head heatmap (rows: layers, columns: heads, both 0-based).

    Drawn with ``imshow`` (seaborn's heatmap re-measures its tick labels by drawing the figure
    many times, which dominated report rendering).
    """
    image = ax.imshow(grid.to_numpy(dtype=float), vmin=vmin, vmax=vmax, cmap=cmap, aspect="auto")
    ax.set_xticks(range(grid.shape[1]), [str(c) for c in grid.columns], fontsize="x-small")
    ax.set_yticks(range(grid.shape[0]), [str(i) for i in grid.index], fontsize="x-small")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    if label is not None:
        ax.figure.colorbar(image, ax=ax, label=label, shrink=0.9)
    return image
