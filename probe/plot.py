"""The figures of ``probe figures``, one panel at a time, for notebooks.

>>> from probe import plot                             # probe.plot is this module
>>> ax = plot.relation_heads("reports/minilm")        # a report folder…
>>> ax = plot.head_map(tables, ax=axes[0])            # …or its tables, on an Axes of yours

Each function takes a report folder (``probe analyze``'s, or ``probe compare``'s for the
comparison's figures, ``probe timeline``'s for its own) or its tables (a dict of DataFrames
named as the CSV files), and an optional matplotlib ``ax``; it returns the Axes it drew on.
The drawings are those the analyses declare (``Analysis.plots``), in the figures' theme
(``analyses.paper.theme``).

This module is part of the app, beside ``probe figures``: it reads report folders and knows
the analyses, which the library does not. It sits at the package's top level so that
``from probe import plot`` finds it as a module, while ``probe/__init__.py`` (the library's
front door) neither imports nor names it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes

Report = str | Path | Mapping[str, "pd.DataFrame"]


def tables(report: Report) -> dict[str, pd.DataFrame]:
    """The tables of a report or comparison folder (a dict given is returned as a dict)."""
    if isinstance(report, Mapping):
        return dict(report)
    from probe.app.figures import declared

    return declared(Path(report))[1]


def _draw(owner: str, plot_id: str, report: Report, ax: Axes | None, **panel: Any) -> Axes:
    """Draw the figure ``plot_id`` that ``owner`` (an analysis, or ``compare``) declares."""
    import analyses
    from analyses.paper import theme

    if owner == "compare":
        from probe.app import compare

        plots = compare.PLOTS
    else:
        plots = analyses.get(owner).plots
    (plot,) = [p for p in plots if p.id == plot_id]
    with theme():
        return plot.draw(tables(report), ax=ax, **panel)


def best_heads(report: Report, ax: Axes | None = None) -> Axes:
    """syntax: each frequent relation's best head, with its interval, beside its best offset."""
    return _draw("syntax", "best-heads", report, ax)


def relation_heads(report: Report, ax: Axes | None = None) -> Axes:
    """syntax: relation x head, accuracy above the relation's best offset."""
    return _draw("syntax", "heatmaps", report, ax)


def attention_per_layer(report: Report, ax: Axes | None = None) -> Axes:
    """roles: where attention goes, per layer."""
    return _draw("roles", "per-layer", report, ax)


def head_map(report: Report, ax: Axes | None = None) -> Axes:
    """roles: the heads by similarity of attention (MDS), by role."""
    return _draw("roles", "similarity", report, ax)


def effective_rank(report: Report, circuit: str = "QK", ax: Axes | None = None) -> Axes:
    """spectra: layer x head effective rank of the QK or OV circuit."""
    return _draw("spectra", "effective-rank", report, ax, circuit=circuit)


def singular_values(report: Report, circuit: str = "QK", ax: Axes | None = None) -> Axes:
    """spectra: each layer's normalised singular values of the QK or OV circuit."""
    return _draw("spectra", "singular-values", report, ax, circuit=circuit)


def coreference_heads(report: Report, ax: Axes | None = None) -> Axes:
    """coref: mention type x head, antecedent accuracy."""
    return _draw("coref", "heatmaps", report, ax)


def importance_heads(report: Report, ax: Axes | None = None) -> Axes:
    """importance: layer x head, the output change when the head is ablated."""
    return _draw("importance", "heads", report, ax)


def pruning_curve(report: Report, ax: Axes | None = None) -> Axes:
    """importance: the output change as heads are ablated together."""
    return _draw("importance", "pruning", report, ax)


def claims_effects(report: Report, ax: Axes | None = None) -> Axes:
    """claims: each claim's ablation effect beside its layer's unclaimed heads."""
    return _draw("claims", "effects", report, ax)


def taxonomy_scores(report: Report, ax: Axes | None = None) -> Axes:
    """taxonomy: score x head on repeated sequences, and nulls."""
    return _draw("taxonomy", "scores", report, ax)


def taxonomy_weights(report: Report, ax: Axes | None = None) -> Axes:
    """taxonomy: copying and sink α per head."""
    return _draw("taxonomy", "weights", report, ax)


def cross_heads(report: Report, column: str = "diagonal", ax: Axes | None = None) -> Axes:
    """cross: decoder layer x head, ``diagonal`` or ``entropy_normalised``."""
    return _draw("cross", "heads", report, ax, column=column)


def circuit_graph(report: Report, ax: Axes | None = None) -> Axes:
    """circuit: the circuit's strongest edges, layer by layer."""
    return _draw("circuit", "graph", report, ax)


def circuit_faithfulness(report: Report, ax: Axes | None = None) -> Axes:
    """circuit: faithfulness against the number of top edges kept."""
    return _draw("circuit", "faithfulness", report, ax)


def circuit_ablations(report: Report, ax: Axes | None = None) -> Axes:
    """circuit: faithfulness against the top edges kept, under each ablation."""
    return _draw("circuit", "ablations", report, ax)


def circuit_pairs(report: Report, ax: Axes | None = None) -> Axes:
    """circuit: each pair's faithfulness under the ablation that chose the circuit."""
    return _draw("circuit", "pairs", report, ax)


def rank_changes(report: Report, circuit: str = "qk", ax: Axes | None = None) -> Axes:
    """compare: layer x head, the change of effective rank from A to B."""
    return _draw("compare", "rank-changes", report, ax, circuit=circuit)


def relation_changes(report: Report, ax: Axes | None = None) -> Axes:
    """compare: each relation's best-head accuracy in A and B."""
    return _draw("compare", "relations", report, ax)


def layer_roles(report: Report, ax: Axes | None = None) -> Axes:
    """compare: roles per matched layer, A and B."""
    return _draw("compare", "layer-roles", report, ax)


def layer_correspondence(report: Report, ax: Axes | None = None) -> Axes:
    """compare: which layers of B attend like which layers of A."""
    return _draw("compare", "layer-correspondence", report, ax)


def timeline(report: Report, role: str = "induction", ax: Axes | None = None) -> Axes:
    """timeline: each head's score for ``role`` over the steps, holders filled, onsets marked."""
    from analyses.paper import theme
    from probe.app.timeline_paper import role_scores

    with theme():
        return role_scores(tables(report), ax=ax, role=role)


def timeline_loss(report: Report, ax: Axes | None = None) -> Axes:
    """timeline: the loss on each copy of the repeated sequences over the steps."""
    from analyses.paper import theme
    from probe.app.timeline_paper import loss

    with theme():
        return loss(tables(report), ax=ax)


def qk_sources(
    report: Report, head: str | None = None, shown: int = 0, ax: Axes | None = None
) -> Axes:
    """qk: a head's score split into query source x key source (``head`` as ``"1-1"``, or the
    ``shown``-th of the section)."""
    return _draw("qk", "sources", report, ax, shown=shown, head=head)
