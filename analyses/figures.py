"""A figure for a report page: inline SVG markup drawn by ``analyses.svg`` (every analysis and
``probe compare``), or a matplotlib figure (``probe experiment``'s), embedded as PNG or SVG."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure as MplFigure


@dataclass
class Figure:
    """A figure, its caption and its text alternative. ``format`` says what ``figure`` is:
    ``"markup"``, SVG already drawn and escaped; ``"png"`` or ``"svg"``, a matplotlib figure
    to embed in that format."""

    id: str
    title: str
    alt: str
    figure: MplFigure | str
    format: str = "png"
