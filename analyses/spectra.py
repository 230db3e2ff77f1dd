"""Weight-circuit analysis: effective rank of every head's QK and OV circuits, and spectra."""

from __future__ import annotations

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure as MplFigure

from analyses import Figure
from probe.circuits import spectra

name = "spectra"


def tables(model) -> dict[str, pd.DataFrame]:
    """``spectra.csv``: one row per (layer, head, circuit); singular values space-separated."""
    table = spectra(model)
    table["singular_values"] = [" ".join(f"{x:.6g}" for x in s) for s in table.singular_values]
    return {"spectra": table}


def singular_values(table: pd.DataFrame) -> list[np.ndarray]:
    return [np.array(s.split(), dtype=float) for s in table.singular_values]


def figures(tables: dict[str, pd.DataFrame]) -> list[Figure]:
    table = tables["spectra"]
    out = []
    fig = MplFigure(figsize=(10, 3.8))
    axes = fig.subplots(
        1, 2, gridspec_kw={"left": 0.05, "right": 0.99, "bottom": 0.13, "top": 0.9, "wspace": 0.12}
    )
    top = float(table.d_head.iloc[0])
    for ax, circuit in zip(axes, ("QK", "OV"), strict=True):
        grid = table[table.circuit == circuit].pivot(
            index="layer", columns="head", values="effective_rank"
        )
        sns.heatmap(
            grid, ax=ax, vmin=0, vmax=top, cmap="viridis", cbar_kws={"label": "effective rank"}
        )
        ax.set_title(f"{circuit}: effective rank (of at most d_head = {int(top)})")
    out.append(
        Figure(
            "effective-rank",
            "Effective rank of each head's QK and OV circuit",
            "Two layer-by-head heatmaps of the effective rank of W_Q W_Kᵀ and W_V W_O.",
            fig,
        )
    )
    fig = MplFigure(figsize=(10, 3.6))
    axes = fig.subplots(
        1,
        2,
        sharey=True,
        gridspec_kw={"left": 0.08, "right": 0.99, "bottom": 0.14, "top": 0.9, "wspace": 0.05},
    )
    layers = sorted(table.layer.unique())
    colors = sns.color_palette("viridis", len(layers))
    for ax, circuit in zip(axes, ("QK", "OV"), strict=True):
        part = table[table.circuit == circuit]
        for layer, color in zip(layers, colors, strict=True):
            rows = part[part.layer == layer]
            curves = [s / s[0] for s in singular_values(rows) if s.size and s[0] > 0]
            if curves:
                width = min(len(c) for c in curves)
                ax.plot(
                    np.mean([c[:width] for c in curves], axis=0),
                    color=color,
                    label=f"layer {layer}",
                )
        ax.set_yscale("log")
        ax.set_xlabel("index k")
        ax.set_title(f"{circuit}: σ_k / σ_1, mean over heads")
    axes[0].set_ylabel("normalised singular value")
    axes[1].legend(fontsize="small", ncols=2)
    out.append(
        Figure(
            "spectra",
            "Singular-value spectra per layer",
            "Line charts of the normalised singular values of QK and OV, one line per layer.",
            fig,
            "svg",
        )
    )
    return out
