"""The circuit analysis's trust figures for papers (``probe figures``, ``probe.plot``): the
faithfulness curve under each ablation, and each pair's faithfulness. Each takes the tables and
``ax=None`` and returns the Axes it drew on, as ``analyses.paper``'s drawings do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from analyses.paper import _axes

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes


def circuit_ablations(tables: dict[str, pd.DataFrame], ax: Axes | None = None) -> Axes:
    """The faithfulness of the top k edges against k under each ablation (each normalised by its
    own run with no edge kept: 0 there, 1 with every edge), with its 95% interval shaded."""
    curves = tables["circuit_ablations"]
    ax = _axes(ax)
    for i, (name, part) in enumerate(curves.groupby("ablation", sort=False)):
        ax.plot(part.edges, part.faithfulness, marker="o", markersize=2, color=f"C{i}",
                label=name)  # fmt: skip
        ax.fill_between(part.edges, part.low, part.high, color=f"C{i}", alpha=0.2, linewidth=0)
    run = tables.get("circuit_run")
    if run is not None and not run.empty:
        ax.axvline(int(run.chosen_edges.iloc[0]), color="0.5", linestyle=":", linewidth=0.8)
    ax.set_xlabel(f"top edges kept (of {int(curves.total_edges.iloc[0])})")
    ax.set_ylabel("faithfulness")
    ax.legend(loc="lower right", frameon=False, title="ablation")
    return ax


def circuit_pairs(tables: dict[str, pd.DataFrame], ax: Axes | None = None) -> Axes:
    """The distribution of each pair's faithfulness under the chosen ablation (the pairs set
    aside left out), with the 0.5 line."""
    import numpy as np

    pairs = tables["circuit_pairs"]
    kept = pairs[~pairs.set_aside.astype(bool)]
    ax = _axes(ax)
    # A strip of points, jittered by a fixed draw (seaborn's stripplot draws its jitter afresh,
    # so the same tables would not draw the same file)
    jitter = np.random.default_rng(0).uniform(-0.2, 0.2, len(kept))
    ax.scatter(kept.faithfulness, jitter, s=9, color="C0")
    ax.set_ylim(-0.5, 0.5)
    ax.set_yticks([])
    ax.axvline(0.5, color="C1", linestyle="--", linewidth=0.8)
    ax.set_xlabel("faithfulness per pair")
    return ax
