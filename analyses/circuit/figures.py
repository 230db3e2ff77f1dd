"""The circuit analysis's page figures, as inline SVG: the graph of the circuit's strongest
edges (the stable ones solid, the rest dashed), the faithfulness curve, the curves under each
ablation and each pair's faithfulness.
"""

from __future__ import annotations

from html import escape
from typing import TYPE_CHECKING

from analyses import svg
from analyses.figures import Figure

if TYPE_CHECKING:
    import pandas as pd

DRAWN_EDGES = 40  # at most this many of the circuit's edges drawn in its graph
RADIUS = 13  # a node's circle, in px
EM_WIDTH = 0.66  # a character's width, of the font size, at most for labels' characters

INPUT_COLOURS = {"q": svg.CATEGORIES[0], "k": svg.CATEGORIES[1], "v": svg.CATEGORIES[2],
                 "": svg.CATEGORIES[7]}  # fmt: skip


def label_size(label: str) -> float:
    """The font size at which ``label`` fits inside a node's circle: 10 px, smaller for a long
    label (``mlp1``, ``embed``, ``logits``), its width taken as ``EM_WIDTH`` of the size a
    character (a sans-serif's widest digits and lower case; wider than most)."""
    return min(10.0, (2 * RADIUS - 4) / (EM_WIDTH * max(len(label), 1)))


def drawn_edges(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """The circuit's edges that its graph draws: the ``DRAWN_EDGES`` of largest |score|, each
    with ``stable`` (held in ≥ 90% of the bootstrap's circuits; True where the run has no
    ``circuit_stability``)."""
    edges = tables["circuit_edges"]
    kept = edges[edges.in_circuit]
    kept = kept.reindex(kept.score.abs().sort_values(ascending=False).index).head(DRAWN_EDGES)
    stability = tables.get("circuit_stability")
    stable = [True] * len(kept)
    if stability is not None and len(stability):
        key = ["sender", "receiver", "input"]
        found = {tuple(k): bool(v) for k, v in zip(stability[key].fillna("").to_numpy(),
                                                    stability.stable, strict=True)}  # fmt: skip
        stable = [found.get(tuple(k), True) for k in kept[key].fillna("").to_numpy()]
    return kept.assign(stable=stable)


def place(node: str, n_layers: int, n_heads: int) -> tuple[float, float]:
    """A node's place in the graph, ``(column, row)``: heads in their layer's row (a head's
    index its column), each layer's MLP right of its heads, a third of a row higher; the
    embeddings in row 0, below, and the logits in the top row, both centred."""
    if node == "embed":
        return (n_heads - 1) / 2, 0.0
    if node == "logits":
        return (n_heads - 1) / 2, n_layers + 1.0
    if node.startswith("mlp"):
        return float(n_heads), int(node[3:]) + 1 + 1 / 3
    layer, head = map(int, node.split("-"))
    return float(head), layer + 1.0


def graph_figure(tables: dict[str, pd.DataFrame]) -> Figure | None:
    """The circuit's strongest edges as a graph: one row of nodes per layer (the embeddings
    below, the logits on top), edges coloured by the input they enter, as inline SVG."""
    edges = tables.get("circuit_edges")
    if edges is None or edges.empty or not edges.in_circuit.any():
        return None
    kept = drawn_edges(tables)
    heads = tables["circuit_heads"]
    n_layers, n_heads = int(heads.layer.max()) + 1, int(heads["head"].max()) + 1
    step_x, step_y, left, top = 56, 70, 70, 30
    width = left + step_x * (n_heads + 1) + 40
    height = top + step_y * (n_layers + 1) + 40

    def at(node: str) -> tuple[float, float]:
        """A node's centre on the page: rows from the bottom."""
        column, row = place(node, n_layers, n_heads)
        return left + step_x * column, top + step_y * (n_layers + 1 - row)

    biggest = float(kept.score.abs().max()) or 1.0
    alt = ("A graph of the circuit's strongest edges: the embeddings at the bottom, one row of "
           "heads per layer above, the logits on top; lines coloured by the input they enter "
           "(query, key, value, or an MLP's or the logits'), thicker for larger scores, solid "
           "where the edge is in at least 90% of the bootstrap's circuits, dashed "
           "otherwise.")  # fmt: skip
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" role="img" viewBox="0 0 {width} {height}" '
             f'width="{width}" height="{height}"><title>{escape(alt)}</title>']  # fmt: skip
    for row in kept.itertuples():
        (x1, y1), (x2, y2) = at(row.sender), at(row.receiver)
        into = f" ({row.input})" if row.input else ""
        label = f"{row.sender} → {row.receiver}{into}: {row.score:.3g}"
        label += "" if row.stable else " (not stable)"
        dash = "" if row.stable else ' stroke-dasharray="5 3"'
        parts.append(
            f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" '
            f'stroke="{INPUT_COLOURS.get(row.input, svg.CATEGORIES[7])}" stroke-opacity="0.75" '
            f'stroke-width="{0.8 + 4 * abs(row.score) / biggest:.2f}"{dash}>'
            f"<title>{escape(label)}</title></line>"
        )
    nodes = dict.fromkeys([*kept.sender, *kept.receiver])
    for node in nodes:
        x, y = at(node)
        size = label_size(node)
        parts.append(
            f'<g><title>{escape(node)}</title><circle cx="{x:.1f}" cy="{y:.1f}" r="{RADIUS}" '
            f'fill="#f7f7f7" stroke="currentColor"/><text x="{x:.1f}" y="{y + size * 0.35:.1f}" '
            f'text-anchor="middle" font-size="{size:.1f}" '
            f"{svg.FONT.replace('currentColor', '#222')}>{escape(node)}</text></g>"
        )
    for k, (name, colour) in enumerate(
        (("query", INPUT_COLOURS["q"]), ("key", INPUT_COLOURS["k"]), ("value", INPUT_COLOURS["v"]),
         ("MLP, logits", INPUT_COLOURS[""]))
    ):  # fmt: skip
        y = 12 + 14 * k
        parts.append(f'<line x1="{width - 130}" y1="{y}" x2="{width - 110}" y2="{y}" '
                     f'stroke="{colour}" stroke-width="3"/><text x="{width - 104}" y="{y + 4}" '
                     f'font-size="10" {svg.FONT}>{escape(name)}</text>')  # fmt: skip
    parts.append("</svg>")
    title = f"The circuit's {len(kept)} strongest edges"
    return Figure("circuit-graph", title, alt, "".join(parts))


def faithfulness_figure(tables: dict[str, pd.DataFrame]) -> Figure | None:
    """The faithfulness of the top k edges against k, as inline SVG."""
    curve = tables.get("circuit_faithfulness")
    if curve is None or curve.empty:
        return None
    alt = ("A line chart of the circuit's faithfulness (its metric over the full model's, "
           "0 with every edge corrupted) against the number of top edges kept, of all the "
           "edges, the target dashed.")  # fmt: skip
    total = int(curve.total_edges.iloc[0])
    series = [svg.Series("faithfulness", curve.edges, curve.faithfulness)]
    run = tables.get("circuit_run")
    if run is not None and not run.empty:  # the target, dashed across the whole axis
        target = float(run.target.iloc[0])
        series.append(svg.Series(f"target {target:.2f}", [0, total], [target, target],
                                 svg.CATEGORIES[1], markers=False, dashed=True))  # fmt: skip
    chart = svg.Chart("Faithfulness", series, f"top edges kept (of {total})", "faithfulness",
                      legend=False, x_max=total)  # fmt: skip
    return Figure("circuit-faithfulness", "Faithfulness curve", alt, svg.charts([chart], alt=alt))


def ablations_figure(tables: dict[str, pd.DataFrame]) -> Figure | None:
    """The faithfulness of the top k edges against k under each ablation, as inline SVG."""
    curves = tables.get("circuit_ablations")
    if curves is None or curves.empty:
        return None
    alt = ("A line chart of the circuit's faithfulness against the number of top edges kept, "
           "one line per ablation of the edges left out (corrupted patching, mean, zero, "
           "resample), each normalised by its own run with no edge kept.")  # fmt: skip
    series = [svg.Series(name, part.edges, part.faithfulness, colour=svg.CATEGORIES[i])
              for i, (name, part) in enumerate(curves.groupby("ablation", sort=False))]  # fmt: skip
    chart = svg.Chart("Faithfulness under each ablation", series,
                      f"top edges kept (of {int(curves.total_edges.iloc[0])})",
                      "faithfulness")  # fmt: skip
    return Figure("circuit-ablations", "Faithfulness under each ablation", alt,
                  svg.charts([chart], alt=alt))  # fmt: skip


def pairs_figure(tables: dict[str, pd.DataFrame]) -> Figure | None:
    """Each pair's faithfulness, lowest first, with the 0.5 line, as inline SVG."""
    pairs = tables.get("circuit_pairs")
    if pairs is None or pairs.empty:
        return None
    kept = pairs[~pairs.set_aside.astype(bool)].sort_values("faithfulness", kind="stable")
    if kept.empty:
        return None
    rank = list(range(len(kept)))
    alt = ("A dot plot of each prompt pair's faithfulness under the chosen ablation, lowest "
           "first, with a dashed line at 0.5; pairs whose clean and ablated metrics are too "
           "close to divide by are left out.")  # fmt: skip
    chart = svg.Chart("Each pair's faithfulness", [
        svg.Series("pair", rank, kept.faithfulness, line=False),
        svg.Series("0.5", [0, len(kept) - 1], [0.5, 0.5], markers=False, dashed=True,
                   colour=svg.CATEGORIES[7]),
    ], "pairs, lowest first", "faithfulness", legend=False)  # fmt: skip
    return Figure("circuit-pairs", "Each pair's faithfulness", alt, svg.charts([chart], alt=alt))
