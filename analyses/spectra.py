"""Weight-circuit analysis: effective rank of every head's QK and OV circuits, and spectra.

It reads the weights only: no treebank, no forward pass.
"""

from __future__ import annotations

from typing import ClassVar

from analyses import Analysis, Measure, Schema, svg
from analyses.figures import Figure, Plot
from analyses.vocabulary import Thresholds
from probe.lazy import lazy

np = lazy("numpy")
pd = lazy("pandas")


class Spectra(Analysis):
    """The spectra of W_i^Q W_i^Kᵀ and W_i^V W_i^O of every head (see ``probe.spectra``)."""

    name = "spectra"
    title = "Weight circuits"
    unit = None  # the weights alone: no treebank, no forward pass
    tables: ClassVar[dict[str, Schema]] = {
        "spectra": {
            "layer": "int", "head": "int", "circuit": "str", "d_model": "int", "d_head": "int",
            "singular_values": "str", "numerical_rank": "int", "effective_rank": "float",
            "stable_rank": "float", "symmetry": "float", "params_factored": "int",
            "params_full": "int",
        }
    }  # fmt: skip
    head_columns: ClassVar[Schema] = {"qk_effective_rank": "float", "ov_effective_rank": "float"}
    measures = (
        Measure("qk_effective_rank", "effective rank of W_QK"),
        Measure("ov_effective_rank", "effective rank of W_OV"),
    )

    def merge(self, other: Spectra) -> None:
        self._check_mergeable(other)  # the weights are the same everywhere: nothing to add

    def _tables(self) -> dict[str, pd.DataFrame]:
        """``spectra``: one row per (layer, head, circuit); singular values space-separated."""
        # The heads of the run's grid: an encoder-decoder model's encoder (cross-attention's
        # circuits are in the cross analysis).
        from probe.capture.head_weights import iter_head_weights
        from probe.weights.spectra import spectra

        table = spectra(iter_head_weights(self.context.model))
        table["singular_values"] = [" ".join(f"{x:.6g}" for x in s) for s in table.singular_values]
        return {"spectra": table}

    @classmethod
    def heads(cls, tables: dict[str, pd.DataFrame], thresholds: Thresholds) -> pd.DataFrame:
        ranks = (
            tables["spectra"]
            .pivot_table(index=["layer", "head"], columns="circuit", values="effective_rank")
            .reindex(columns=["QK", "OV"])
        )  # both columns, even from an empty table
        ranks = ranks.rename(columns={"QK": "qk_effective_rank", "OV": "ov_effective_rank"})
        return ranks.reset_index().rename_axis(columns=None)

    plots = (
        Plot("effective-rank", "Effective rank of each head's QK and OV circuit",
             "analyses.paper:effective_rank", page=lambda tables: rank_maps(tables["spectra"]),
             needs=("spectra",), panels=({"circuit": "QK"}, {"circuit": "OV"}), width="page"),
        Plot("singular-values", "Singular-value spectra per layer",
             "analyses.paper:singular_values",
             page=lambda tables: spectrum_lines(tables["spectra"]),
             needs=("spectra",), panels=({"circuit": "QK"}, {"circuit": "OV"}), width="page"),
    )  # fmt: skip

    @classmethod
    def section(cls, tables: dict[str, pd.DataFrame], run: dict) -> dict:
        summary = tables["spectra"].groupby(["layer", "circuit"]).effective_rank.mean()
        summary = summary.unstack("circuit")
        return {
            "layers": [
                {"layer": layer, "QK": row.get("QK"), "OV": row.get("OV")}
                for layer, row in summary.iterrows()
            ]
        }


def singular_values(table: pd.DataFrame) -> list[np.ndarray]:
    return [np.array(s.split(), dtype=float) for s in table.singular_values]


def rank_maps(table: pd.DataFrame) -> Figure:
    """Effective-rank heatmaps of QK and OV, as inline SVG."""
    top = float(table.d_head.iloc[0])
    grids = [
        svg.Grid(
            f"{circuit}: effective rank (of at most d_head = {int(top)})",
            table[table.circuit == circuit].pivot(
                index="layer", columns="head", values="effective_rank"
            ),
        )
        for circuit in ("QK", "OV")
    ]
    alt = "Two layer-by-head heatmaps of the effective rank of W_Q W_Kᵀ and W_V W_O."
    ranks = svg.heatmaps(grids, vmin=0, vmax=top, anchors=svg.VIRIDIS, label="effective rank",
                         alt=alt, name="effective-rank", columns=2, size=(300, 170))  # fmt: skip
    return Figure("effective-rank", "Effective rank of each head's QK and OV circuit", alt, ranks)


def spectrum_lines(table: pd.DataFrame) -> Figure:
    """The mean normalised spectrum of each layer, QK and OV, as inline SVG."""
    layers = sorted(table.layer.unique())
    colours = svg.spread(svg.VIRIDIS, len(layers))
    panels = []
    for circuit in ("QK", "OV"):
        part = table[table.circuit == circuit]
        series = []
        for layer, colour in zip(layers, colours, strict=True):
            curves = [s / s[0] for s in singular_values(part[part.layer == layer])
                      if s.size and s[0] > 0]  # fmt: skip
            if curves:
                width = min(len(c) for c in curves)
                mean = np.mean([c[:width] for c in curves], axis=0)
                series.append(svg.Series(f"layer {layer}", np.arange(width), mean, colour,
                                         markers=False))  # fmt: skip
        panels.append(svg.Chart(f"{circuit}: σ_k / σ_1, mean over heads", series, "index k",
                                "normalised singular value", log_y=True))  # fmt: skip
    alt_lines = "Line charts of the normalised singular values of QK and OV, one line per layer."
    return Figure("spectra", "Singular-value spectra per layer", alt_lines,
                  svg.charts(panels, alt=alt_lines))  # fmt: skip
