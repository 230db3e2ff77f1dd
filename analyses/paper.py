"""Figures for papers and notebooks, drawn with seaborn from a report's tables: the drawings
that each analysis's ``Plot``s name (``analyses.figures``), and those of ``probe compare``.

One theme for all (``theme``): seaborn's paper context, small fonts, colour-blind-safe palettes
(seaborn's ``colorblind`` for categories, viridis and magma for magnitudes, ColorBrewer's RdBu
for signed changes), text kept as text in vector files, and sizes for a paper's column (3.3 in)
and page (7 in). Heads are named as in the tables: 0-based, ``layer-head``.

Each drawing takes the tables and ``ax=None`` and returns the Axes it drew on (a new figure's
when none is given). seaborn and matplotlib are imported on first use.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from analyses.vocabulary import Role
from probe.lazy import lazy

if TYPE_CHECKING:
    from collections.abc import Iterator

    import pandas as pd
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from analyses.figures import Plot

np = lazy("numpy")
pd = lazy("pandas")

WIDTHS = {"column": 3.3, "page": 7.0}  # inches
HEIGHT = 2.4  # inches, per row of panels
DIVERGING = "RdBu_r"  # ColorBrewer: readable with every common colour-vision deficiency
RC = {
    "font.size": 7, "axes.titlesize": 7, "axes.labelsize": 7, "xtick.labelsize": 6,
    "ytick.labelsize": 6, "legend.fontsize": 6, "legend.title_fontsize": 6,
    "lines.linewidth": 1.0, "lines.markersize": 3, "axes.linewidth": 0.6,
    "pdf.fonttype": 42, "ps.fonttype": 42,  # TrueType: editable, accepted by publishers
    "svg.fonttype": "none", "svg.hashsalt": "probe",  # text as text; stable ids
    "savefig.dpi": 300, "figure.dpi": 100,
}  # fmt: skip


@contextmanager
def theme() -> Iterator[None]:
    """The figures' one theme, for the block only (the caller's settings are left alone)."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    style = sns.axes_style("ticks") | sns.plotting_context("paper") | RC
    with plt.rc_context(style), sns.color_palette("colorblind"):
        yield


def draw_figure(plot: Plot, tables: dict[str, pd.DataFrame]) -> Figure:
    """``plot``'s panels side by side on one figure of its width (column or page)."""
    import matplotlib.pyplot as plt

    with theme():
        n = len(plot.panels)
        figure, axes = plt.subplots(1, n, figsize=(WIDTHS[plot.width], HEIGHT),
                                    layout="constrained", squeeze=False)  # fmt: skip
        for ax, panel in zip(axes[0], plot.panels, strict=True):
            plot.draw(tables, ax=ax, **panel)
    return figure


def _axes(ax: Axes | None, width: str = "column") -> Axes:
    """``ax``, or the Axes of a new figure of the given width."""
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    return plt.figure(figsize=(WIDTHS[width], HEIGHT), layout="constrained").add_subplot()


def _heads_heatmap(grid: pd.DataFrame, ax: Axes, label: str, **colours: Any) -> Axes:
    """A layer x head heatmap (rows layers, columns heads, both 0-based) with its colour bar."""
    import seaborn as sns

    sns.heatmap(grid, ax=ax, cbar_kws={"label": label, "shrink": 0.8}, **colours)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.tick_params(length=0)
    return ax


def _by_layer_head(rows: pd.DataFrame, key: str, value: str, keys: list[str]) -> pd.DataFrame:
    """One row per ``key`` (in the order of ``keys``), one column per head, named
    ``layer-head`` in layer order."""
    grid = rows.pivot_table(index=key, columns=["layer", "head"], values=value, aggfunc="max")
    grid = grid.reindex(index=keys).sort_index(axis=1)
    grid.columns = [f"{layer}-{head}" for layer, head in grid.columns]
    return grid


def _wide_heatmap(grid: pd.DataFrame, ax: Axes, label: str, **colours: Any) -> Axes:
    """Rows (relations, scores…) by every head, ``layer-head``, with a tick at each layer's first
    head and a line between layers."""
    import seaborn as sns

    sns.heatmap(grid, ax=ax, xticklabels=False, cbar_kws={"label": label, "shrink": 0.8},
                **colours)  # fmt: skip
    layers = [c.split("-")[0] for c in grid.columns]
    starts = [i for i, layer in enumerate(layers) if i == 0 or layer != layers[i - 1]]
    ax.set_xticks([s + 0.5 for s in starts], [grid.columns[s] for s in starts], rotation=90)
    for s in starts[1:]:
        ax.axvline(s, color="white", linewidth=0.6)
    ax.set_xlabel("head (layer-head, 0-based)")
    ax.set_ylabel("")
    ax.tick_params(length=0)
    return ax


# -- syntax ------------------------------------------------------------------------------------


def best_heads(tables: dict[str, pd.DataFrame], ax: Axes | None = None, top: int = 12) -> Axes:
    """The best head of the ``top`` most frequent relations: its accuracy with its 95% interval,
    beside the relation's best fixed offset; each relation labelled with its head."""
    best = tables["syntax_best"]
    best = best[best.relation != "all"].sort_values("total", ascending=False).head(top)
    ax = _axes(ax)
    y = np.arange(len(best))
    error = [best.accuracy - best.ci_low, best.ci_high - best.accuracy]
    ax.errorbar(best.accuracy, y, xerr=error, fmt="o", color="C0", label="best head", capsize=1.5)
    ax.scatter(best.baseline_accuracy, y, marker="|", s=30, color="C1", label="best offset",
               zorder=3)  # fmt: skip
    labels = [f"{r.relation} ({r.layer}-{r.head})" for r in best.itertuples()]
    ax.set_yticks(y, labels)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("accuracy")
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1), ncols=2, frameon=False)
    return ax


def relation_heads(tables: dict[str, pd.DataFrame], ax: Axes | None = None) -> Axes:
    """Relation x head: each head's accuracy (the better direction) minus the relation's best
    fixed offset, for the main relations present; a dot on each relation's best head."""
    from analyses.syntax import MAIN_RELATIONS

    syntax, best = tables["syntax"], tables["syntax_best"]
    relations = [r for r in (*MAIN_RELATIONS, "all") if r in set(best.relation)]
    baseline = tables["syntax_baselines"].groupby("relation").accuracy.max()
    rows = syntax[syntax.relation.isin(relations)]
    rows = rows.assign(margin=rows.accuracy - rows.relation.map(baseline))
    grid = _by_layer_head(rows, "relation", "margin", relations)
    limit = max(0.1, float(np.nanmax(np.abs(grid.to_numpy()))))
    ax = _axes(ax, "page")
    _wide_heatmap(grid, ax, "accuracy − best offset", cmap=DIVERGING, vmin=-limit, vmax=limit)
    top = best.set_index("relation").loc[relations]
    column = {c: i for i, c in enumerate(grid.columns)}
    x = [column[f"{r.layer}-{r.head}"] + 0.5 for r in top.itertuples()]
    ax.scatter(x, np.arange(len(relations)) + 0.5, s=6, color="black", marker="o")
    return ax


# -- roles -------------------------------------------------------------------------------------

WHERE = {"cls_like": "[CLS]-like", "sep_like": "[SEP]-like", "punct": "punctuation",
         "self": "itself", "previous": "previous token", "next": "next token"}  # fmt: skip


def attention_per_layer(tables: dict[str, pd.DataFrame], ax: Axes | None = None) -> Axes:
    """Where attention goes, per layer, mean over the layer's heads."""
    import seaborn as sns

    means = tables["heads"].groupby("layer")[list(WHERE)].mean().rename(columns=WHERE)
    long = means.reset_index().melt("layer", var_name="to", value_name="attention")
    ax = _axes(ax)
    sns.lineplot(long, x="layer", y="attention", hue="to", style="to", markers=True,
                 dashes=False, ax=ax)  # fmt: skip
    ax.set_xticks(means.index)
    ax.set_xlabel("layer (0-based)")
    ax.set_ylabel("mean attention")
    ax.set_ylim(0, None)
    sns.move_legend(ax, "upper left", bbox_to_anchor=(1, 1), frameon=False, title=None)
    return ax


def head_map(tables: dict[str, pd.DataFrame], ax: Axes | None = None) -> Axes:
    """The heads placed by MDS of the Jensen-Shannon distance between their attention (closer
    heads attend alike), by their first role."""
    import seaborn as sns

    heads = tables["heads"]
    first = heads.roles.fillna("").str.split(";").str[0].replace("", "no role")
    order = [str(r) for r in Role if (first == str(r)).any()] + ["no role"]
    palette = dict(zip(order, sns.color_palette("colorblind", len(order)), strict=True))
    palette["no role"] = (0.75, 0.75, 0.75)
    ax = _axes(ax)
    sns.scatterplot(x=heads.mds_x, y=heads.mds_y, hue=first, hue_order=order, palette=palette,
                    style=first, style_order=order, s=14, ax=ax, linewidth=0.3)  # fmt: skip
    ax.set_aspect("equal", adjustable="datalim")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_xlabel("MDS 1")
    ax.set_ylabel("MDS 2")
    sns.move_legend(ax, "upper left", bbox_to_anchor=(1, 1), frameon=False, title=None)
    return ax


# -- weights -----------------------------------------------------------------------------------


def effective_rank(
    tables: dict[str, pd.DataFrame], ax: Axes | None = None, circuit: str = "QK"
) -> Axes:
    """Layer x head: the effective rank of each head's ``circuit`` (QK or OV)."""
    table = tables["spectra"]
    part = table[table.circuit == circuit]
    grid = part.pivot(index="layer", columns="head", values="effective_rank")
    ax = _heads_heatmap(grid, _axes(ax), "effective rank", cmap="viridis", vmin=0,
                        vmax=float(table.d_head.max()))  # fmt: skip
    ax.set_title(f"{circuit} (d_head = {int(table.d_head.max())})")
    return ax


def singular_values(
    tables: dict[str, pd.DataFrame], ax: Axes | None = None, circuit: str = "QK"
) -> Axes:
    """Each layer's singular values of ``circuit``, σ_k / σ_1, mean over its heads."""
    import seaborn as sns

    part = tables["spectra"][lambda t: t.circuit == circuit]
    rows = []
    for row in part.itertuples():
        s = np.array(row.singular_values.split(), dtype=float)
        if s.size and s[0] > 0:
            rows += [{"layer": row.layer, "k": k, "value": v} for k, v in enumerate(s / s[0])]
    ax = _axes(ax)
    layers = sorted(part.layer.unique())
    sns.lineplot(pd.DataFrame(rows), x="k", y="value", hue="layer", errorbar=None, ax=ax,
                 palette=sns.color_palette("viridis", len(layers)))  # fmt: skip
    ax.set_yscale("log")
    ax.set_xlabel("index k")
    ax.set_ylabel("σ_k / σ_1")
    ax.set_title(circuit)
    sns.move_legend(ax, "lower left", frameon=False, title="layer", ncols=2)
    return ax


# -- coreference, importance, head types, cross-attention --------------------------------------


def coreference_heads(tables: dict[str, pd.DataFrame], ax: Axes | None = None) -> Axes:
    """Mention type x head: how often the word a head attends to most from a mention is one of
    its antecedents."""
    coref = tables["coref"]
    kinds = list(dict.fromkeys(coref.mention_type))
    grid = _by_layer_head(coref, "mention_type", "accuracy", kinds)
    return _wide_heatmap(grid, _axes(ax, "page"), "antecedent accuracy", cmap="magma",
                         vmin=0, vmax=1)  # fmt: skip


def importance_heads(
    tables: dict[str, pd.DataFrame], ax: Axes | None = None, measure: str = "ablation_effect"
) -> Axes:
    """Layer x head: the output change when the head is ablated (or another ``measure``)."""
    grid = tables["importance"].pivot(index="layer", columns="head", values=measure)
    return _heads_heatmap(grid, _axes(ax), measure.replace("_", " "), cmap="magma", vmin=0)


def pruning_curve(tables: dict[str, pd.DataFrame], ax: Axes | None = None) -> Axes:
    """The output change as heads are ablated together, least important first."""
    curve = tables["importance_curve"]
    ax = _axes(ax)
    ax.plot(100 * curve.share_removed, curve.output_change, marker="o", color="C0")
    ax.set_xlabel("heads removed, least important first (%)")
    ax.set_ylabel("output change")
    return ax


SCORES = ("previous_token", "duplicate_token", "induction")


def taxonomy_scores(tables: dict[str, pd.DataFrame], ax: Axes | None = None) -> Axes:
    """Score x head: each head-type score on repeated sequences, and below it its null (the same
    positions on sequences without a repeat)."""
    t = tables["taxonomy"]
    t = t[t.attention == t.attention.iloc[0]]  # the first attention: an encoder's
    names = {f"{s}{n}": s.replace("_", "-") + (" (null)" if n else "")
             for s in SCORES for n in ("", "_null")}  # fmt: skip
    long = t.melt(["layer", "head"], list(names), var_name="score").replace({"score": names})
    grid = _by_layer_head(long, "score", "value", list(names.values()))
    return _wide_heatmap(grid, _axes(ax, "page"), "mean attention", cmap="viridis", vmin=0,
                         vmax=1)  # fmt: skip


def taxonomy_weights(tables: dict[str, pd.DataFrame], ax: Axes | None = None) -> Axes:
    """Score x head: the copying score of the OV circuit (−1 to 1) and sink α (0 to 1)."""
    t = tables["taxonomy"]
    t = t[t.attention == t.attention.iloc[0]]  # the first attention: an encoder's
    names = {"copying": "copying", "sink_alpha": "sink α"}
    long = t.melt(["layer", "head"], list(names), var_name="score").replace({"score": names})
    grid = _by_layer_head(long, "score", "value", list(names.values()))
    return _wide_heatmap(grid, _axes(ax), "score", cmap=DIVERGING, vmin=-1, vmax=1)


def cross_heads(
    tables: dict[str, pd.DataFrame], ax: Axes | None = None, column: str = "diagonal"
) -> Axes:
    """Decoder layer x head: a cross-attention statistic (``diagonal``: the weight within one
    position of the diagonal; ``entropy_normalised``)."""
    grid = tables["cross_attention"].pivot(index="layer", columns="head", values=column)
    ax = _heads_heatmap(grid, _axes(ax), column.replace("_", " "), cmap="magma", vmin=0, vmax=1)
    ax.set_ylabel("decoder layer")
    return ax


# -- circuits ----------------------------------------------------------------------------------

INPUTS = {"q": "query", "k": "key", "v": "value", "": "MLP, logits"}


def circuit_graph(tables: dict[str, pd.DataFrame], ax: Axes | None = None) -> Axes:
    """The circuit's strongest edges (the page's graph): the embeddings below, a row of heads
    per layer (each layer's MLP to the right), the logits on top; each edge coloured by the
    input it enters, wider for a larger |score|, dashed where it is not stable (in fewer than 90%
    of the bootstrap's circuits)."""
    import seaborn as sns

    from analyses.circuit.figures import drawn_edges, place

    heads = tables["circuit_heads"]
    n_layers, n_heads = int(heads.layer.max()) + 1, int(heads["head"].max()) + 1
    kept = drawn_edges(tables)
    ax = _axes(ax, "page")
    colours = dict(zip(INPUTS, [*sns.color_palette("colorblind", 3), (0.55, 0.55, 0.55)],
                       strict=True))  # fmt: skip
    biggest = float(kept.score.abs().max()) if len(kept) else 1.0
    shown = set()
    for row in kept.itertuples():
        into = row.input if row.input in INPUTS else ""
        (x1, y1), (x2, y2) = (place(node, n_layers, n_heads) for node in (row.sender, row.receiver))
        shown.add(into)
        ax.plot([x1, x2], [y1, y2], color=colours[into], alpha=0.75, zorder=1,
                linewidth=0.4 + 2 * abs(row.score) / (biggest or 1.0),
                linestyle="-" if row.stable else "--")  # fmt: skip
    for node in dict.fromkeys([*kept.sender, *kept.receiver]):
        x, y = place(node, n_layers, n_heads)
        ax.scatter([x], [y], s=180, color="#f7f7f7", edgecolors="black", linewidths=0.5, zorder=2)
        ax.annotate(node, (x, y), ha="center", va="center", fontsize=4, zorder=3)
    if not len(kept):
        ax.text(0.5, 0.5, "no edge is in the circuit", transform=ax.transAxes, ha="center")
    ax.set_xlim(-0.6, n_heads + 0.6)
    ax.set_ylim(-0.5, n_layers + 1.5)
    ax.set_yticks(range(n_layers + 2), ["embed", *map(str, range(n_layers)), "logits"])
    ax.set_xticks(range(n_heads), map(str, range(n_heads)))
    ax.set_xlabel("head (each layer's MLP on the right)")
    ax.set_ylabel("layer")
    sns.despine(ax=ax, left=True, bottom=True)
    ax.tick_params(length=0)
    if shown:
        from matplotlib.lines import Line2D

        handles = [Line2D([], [], color=colours[k], label=v)
                   for k, v in INPUTS.items() if k in shown]  # fmt: skip
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1, 1), frameon=False,
                  title="into")  # fmt: skip
    return ax


def circuit_faithfulness(tables: dict[str, pd.DataFrame], ax: Axes | None = None) -> Axes:
    """The faithfulness of the top k edges against k (0: every edge corrupted, 1: the full
    model); the target and the circuit's k dashed, where the run's table gives them."""
    curve = tables["circuit_faithfulness"]
    ax = _axes(ax)
    ax.plot(curve.edges, curve.faithfulness, marker="o", color="C0")
    run = tables.get("circuit_run")
    if run is not None and not run.empty:
        ax.axhline(float(run.target.iloc[0]), color="C1", linestyle="--", linewidth=0.8,
                   label="target")  # fmt: skip
        ax.axvline(int(run.chosen_edges.iloc[0]), color="0.5", linestyle=":", linewidth=0.8,
                   label="circuit")  # fmt: skip
        ax.legend(loc="lower right", frameon=False)
    ax.set_xlabel(f"top edges kept (of {int(curve.total_edges.iloc[0])})")
    ax.set_ylabel("faithfulness")
    return ax


# -- probe compare -----------------------------------------------------------------------------


def rank_changes(
    tables: dict[str, pd.DataFrame], ax: Axes | None = None, circuit: str = "qk"
) -> Axes:
    """Layer x head: the change of each head's effective rank from A to B (``qk`` or ``ov``)."""
    grid = tables["compare_heads"].pivot(
        index="layer", columns="head", values=f"{circuit}_effective_rank_change"
    )
    limit = max(float(np.nanmax(np.abs(grid.to_numpy()))), 1e-9)
    ax = _heads_heatmap(grid, _axes(ax), "B − A", cmap=DIVERGING, vmin=-limit, vmax=limit)
    ax.set_title(f"{circuit.upper()} effective rank")
    return ax


def relation_changes(tables: dict[str, pd.DataFrame], ax: Axes | None = None) -> Axes:
    """Each relation's best-head accuracy in A and in B, with their 95% intervals."""
    rel = tables["compare_relations"]
    rel = rel[rel.relation != "all"].head(12)
    ax = _axes(ax)
    y = np.arange(len(rel))
    for side, shift, colour in (("a", -0.15, "C0"), ("b", 0.15, "C1")):
        accuracy = rel[f"accuracy_{side}"]
        error = [accuracy - rel[f"ci_low_{side}"], rel[f"ci_high_{side}"] - accuracy]
        ax.errorbar(accuracy, y + shift, xerr=error, fmt="o", color=colour, capsize=1.5,
                    label=side.upper())  # fmt: skip
    ax.set_yticks(y, rel.relation)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("accuracy of the best head")
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1), ncols=2, frameon=False)
    return ax


def layer_roles(tables: dict[str, pd.DataFrame], ax: Axes | None = None) -> Axes:
    """The share of each matched layer's heads holding each role: A solid, B dashed."""
    layers = tables["compare_layers"]
    ax = _axes(ax)
    held = [r for r in map(str, Role) if layers[f"{r}_a"].any() or layers[f"{r}_b"].any()]
    for k, role in enumerate(held):
        colour = f"C{k % 10}"
        ax.plot(layers.layer_a, layers[f"{role}_a"], color=colour, label=role)
        ax.plot(layers.layer_a, layers[f"{role}_b"], color=colour, linestyle="--")
    ax.set_xlabel("layer of A (B's at the same relative depth)")
    ax.set_ylabel("share of heads (A solid, B dashed)")
    ax.legend(loc="upper left", bbox_to_anchor=(1, 1), frameon=False)
    return ax


def layer_correspondence(tables: dict[str, pd.DataFrame], ax: Axes | None = None) -> Axes:
    """Layer of A x layer of B: each head of A's least Jensen-Shannon divergence to a head of
    B's layer, mean over A's layer (lower: B's layer attends more alike)."""
    pairs = tables["compare_attention"]
    nearest = pairs.groupby(["layer_a", "head_a", "layer_b"]).js.min().reset_index()
    grid = nearest.groupby(["layer_a", "layer_b"]).js.mean().unstack()
    ax = _heads_heatmap(grid, _axes(ax), "mean JS (nats)", cmap="viridis_r")
    ax.set_xlabel("layer of B")
    ax.set_ylabel("layer of A")
    return ax


def claims_effects(tables: dict[str, pd.DataFrame], ax: Axes | None = None) -> Axes:
    """Each claim tested by ablation: the head's effect with its 95% interval (filled where
    confirmed) beside its baseline, the mean effect of its layer's unclaimed heads."""
    claims = tables["claims"]
    claims = claims[claims.tested.astype(bool)].reset_index(drop=True)
    ax = _axes(ax, "page")
    x = range(len(claims))
    low = claims.effect - claims.effect_low
    high = claims.effect_high - claims.effect
    confirmed = claims.confirmed.astype(bool)
    for held, face, label in (
        (True, "C0", "confirmed by ablation"),
        (False, "white", "pattern only"),
    ):
        part = claims[confirmed == held]
        ax.errorbar(part.index, part.effect, yerr=[low[part.index], high[part.index]], fmt="o",
                    color="C0", mfc=face, label=label)  # fmt: skip
    ax.scatter(x, claims.baseline, marker="_", s=200, color="C3", label="layer's unclaimed heads")
    names = [f"{r.layer}-{r.head} {r.claim}" + (f" ({r.relation})" if r.relation else "")
             for r in claims.itertuples()]  # fmt: skip
    ax.set_xticks(list(x), names, rotation=90, fontsize="small")
    ax.set_ylabel("ablation effect")
    ax.legend(fontsize="small")
    return ax
