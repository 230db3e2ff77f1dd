"""Figures: each analysis declares its own once, as ``Plot``s; the report page draws each as
inline SVG (``analyses.svg``), and ``probe figures`` and ``probe.plot`` draw the same for papers
and notebooks with seaborn (``analyses.paper``).

Also used by ``probe compare`` and ``probe experiment`` for their pages (``Figure``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes

Tables = dict[str, "pd.DataFrame"]


@dataclass
class Figure:
    """A figure, its caption and its text alternative. ``figure`` is inline SVG markup, drawn
    and escaped (``analyses.svg``), which the page embeds as it is."""

    id: str
    title: str
    alt: str
    figure: str


@dataclass(frozen=True)
class Plot:
    """One figure of an analysis, declared once for the page and for paper.

    Attributes
    ----------
    id : str
        Unique within the analysis; ``probe figures`` writes ``<analysis>-<id>.<format>``.
    title : str
        What it shows (the figure file's caption in a paper is the user's).
    paper : str
        ``"module:function"``, the seaborn drawing, imported only when drawn: it takes the
        tables and ``ax=None`` (plus the panel's keywords) and returns the Axes it drew on.
    page : callable, optional
        ``tables -> Figure | None``: the page's inline SVG; None where the page shows the same
        as a table.
    needs : tuple of str
        The tables it reads (``table`` or ``table:column``): it is drawn only when they are
        present, not empty, and hold the columns named.
    panels : tuple of dict
        One Axes per entry, side by side, each drawn with the entry as keywords (e.g. QK and
        OV); ``probe.plot`` draws one at a time.
    width : "column" or "page"
        A paper's column (3.3 in) or its page width (7 in).
    """

    id: str
    title: str
    paper: str
    page: Callable[[Tables], Figure | None] | None = None
    needs: tuple[str, ...] = ()
    panels: tuple[dict[str, Any], ...] = field(default=({},))
    width: Literal["column", "page"] = "column"

    def present(self, tables: Tables) -> bool:
        """Whether the tables hold what it draws."""
        for need in self.needs:
            name, _, column = need.partition(":")
            table = tables.get(name)
            if table is None or table.empty or (column and column not in table):
                return False
        return True

    def figure(self, tables: Tables) -> Figure | None:
        """Its inline SVG for the page, or None."""
        return self.page(tables) if self.page is not None and self.present(tables) else None

    def draw(self, tables: Tables, ax: Axes | None = None, **panel: Any) -> Axes:
        """Its seaborn drawing of one panel (the first, by default) on ``ax`` or a new figure."""
        module, function = self.paper.split(":")
        draw = getattr(importlib.import_module(module), function)
        return draw(tables, ax=ax, **(panel or self.panels[0]))


def page_figures(plots: tuple[Plot, ...], tables: Tables) -> list[Figure]:
    """The page's figures of ``plots``, in their order, those with something to show."""
    return [f for plot in plots if (f := plot.figure(tables)) is not None]
