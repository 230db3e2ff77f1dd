"""The QK analysis's figure: a head's score split into query source x key source, as a seaborn
heat map (``probe figures``, ``probe.plot.qk_sources``); the page shows the same as a table."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes


def split_heads(tables: dict[str, pd.DataFrame]) -> list[tuple[int, int, str]]:
    """The (layer, head, role) of each split, in the order of ``qk_scores`` (the section's)."""
    scores = tables["qk_scores"]
    return [(int(r.layer), int(r.head), str(r.role)) for r in scores.itertuples()]


def qk_sources(
    tables: dict[str, pd.DataFrame],
    ax: Axes | None = None,
    shown: int = 0,
    head: str | None = None,
) -> Axes:
    """One head's mean terms, query sources (rows) x key sources (columns): its largest
    sources of each side, the rest summed into ``other``.

    Parameters
    ----------
    tables : dict of pandas.DataFrame
        A report's tables, with ``qk_pairs`` and ``qk_scores``.
    ax : matplotlib Axes, optional
    shown : int
        Which split to draw, in the section's order (0: the first), where ``head`` is None.
    head : str, optional
        A head as ``"layer-head"`` (its first role).
    """
    import seaborn as sns

    from analyses.paper import HEIGHT, WIDTHS

    splits = split_heads(tables)
    if head is not None:
        found = [s for s in splits if f"{s[0]}-{s[1]}" == head]
        if not found:
            listed = ", ".join(dict.fromkeys(f"{s[0]}-{s[1]}" for s in splits))
            raise ValueError(f"head {head!r} was not split; the report splits {listed}")
        splits = found
    if ax is None:
        import matplotlib.pyplot as plt

        figure = plt.figure(figsize=(WIDTHS["column"], HEIGHT), layout="constrained")
        ax = figure.add_subplot()
    if shown >= len(splits):
        ax.set_axis_off()
        return ax
    layer, number, role = splits[0 if head is not None else shown]
    pairs = tables["qk_pairs"]
    own = pairs[(pairs.layer == layer) & (pairs["head"] == number) & (pairs.role == role)]
    grid = own.pivot_table(index="query_source", columns="key_source", values="contribution",
                           aggfunc="sum", fill_value=0.0)  # fmt: skip
    order = grid.abs().sum(axis=1).sort_values(ascending=False).index
    columns = grid.abs().sum(axis=0).sort_values(ascending=False).index
    grid = grid.loc[order, columns]
    limit = float(grid.abs().to_numpy().max()) or 1.0
    sns.heatmap(grid, ax=ax, cmap="RdBu_r", vmin=-limit, vmax=limit, center=0,
                cbar_kws={"label": "mean term", "shrink": 0.8})  # fmt: skip
    ax.set_title(f"{layer}-{number} ({role})", fontsize="small")
    ax.set_xlabel("key source")
    ax.set_ylabel("query source")
    ax.tick_params(length=0, labelsize="x-small")
    return ax
