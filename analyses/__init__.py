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
