"""``probe compare A B``: what changed between two reports (base and fine-tuned, two checkpoints,
two models), as tidy tables and a self-contained page.

Reports of the same shape are compared head by head (layer l, head h of A against layer l,
head h of B). Otherwise layers are matched by relative depth (layer l of A against the layer of
B at the same fraction of the depth) and compared by their means, since heads of different
models have no correspondence. Where both reports kept their heads' attention on the same
treebank sentences (``attention.npz``, the head cards' sentences), every head of A is compared
with every head of B by the Jensen-Shannon divergence of their word-level attention, so that
even models with different tokenizers and shapes can be matched head to head.
"""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from statistics import NormalDist

import numpy as np
import pandas as pd

from analyses import svg
from analyses.figures import Figure, Plot, page_figures
from analyses.vocabulary import Role, Thresholds
from probe.app.changes import head_changes, roles_of
from probe.app.folder import disagreeing
from probe.app.output import check_free, locked, refuse_inputs, reserved, write_file
from probe.app.page import environment
from probe.app.report import embed, read_report
from probe.inference import FDR, benjamini_hochberg
from probe.numerics import pairwise_js


def compared_measures(run_a: dict, run_b: dict, heads_a, heads_b) -> list[str]:
    """The numeric per-head measures the analyses of both reports declare (``Measure``), in the
    order of A's analyses, where both ``heads.csv`` have them."""
    import analyses

    names = [n for n in run_a["analyses"] if n in run_b["analyses"]]
    declared = [m for n in names for m in analyses.get(n).measures if m.format != "text"]
    return [m.column for m in declared if m.column in heads_a and m.column in heads_b]


def matched_layers(n_a: int, n_b: int) -> np.ndarray:
    """For each layer of A, the layer of B at the same relative depth (0 and the last match)."""
    if n_a == 1:
        return np.zeros(1, dtype=int)
    return np.rint(np.arange(n_a) * (n_b - 1) / (n_a - 1)).astype(int)


def compare_tables(a: Path, b: Path) -> tuple[dict, dict, dict[str, pd.DataFrame]]:
    """The two run cards and the comparison's tables: ``compare_heads`` (one row per head, same
    shape) or ``compare_layers`` (one row per matched layer pair), ``compare_relations`` (one
    row per relation both reports scored) and ``compare_attention`` (one row per pair of heads,
    where both reports kept attention on common sentences)."""
    run_a, tables_a, examples_a = read_report(a)
    run_b, tables_b, examples_b = read_report(b)
    heads_a, heads_b = tables_a["heads"], tables_b["heads"]
    measures = compared_measures(run_a, run_b, heads_a, heads_b)
    same = (run_a["layers"], run_a["heads"]) == (run_b["layers"], run_b["heads"])
    out: dict[str, pd.DataFrame] = {}
    if same:
        table = head_changes(heads_a, heads_b, measures)  # the timeline's definition too
        if "syntax" in tables_a and "syntax" in tables_b:
            change = relation_change(heads_a, tables_a["syntax"], tables_b["syntax"])
            table = table.merge(change, on=["layer", "head"], how="left")
        out["compare_heads"] = table
    else:
        per_layer = []
        for layer_a, layer_b in enumerate(matched_layers(run_a["layers"], run_b["layers"])):
            part_a = heads_a[heads_a.layer == layer_a]
            part_b = heads_b[heads_b.layer == layer_b]
            row = {"layer_a": layer_a, "layer_b": int(layer_b)}
            for m in measures:
                row[f"{m}_a"], row[f"{m}_b"] = part_a[m].mean(), part_b[m].mean()
                row[f"{m}_change"] = row[f"{m}_b"] - row[f"{m}_a"]
            for role in map(str, Role):  # share of the layer's heads holding the role
                row[f"{role}_a"] = part_a.roles.map(lambda r, x=role: x in roles_of(r)).mean()
                row[f"{role}_b"] = part_b.roles.map(lambda r, x=role: x in roles_of(r)).mean()
            per_layer.append(row)
        out["compare_layers"] = pd.DataFrame(per_layer)
    if "syntax_best" in tables_a and "syntax_best" in tables_b:
        columns = ["relation", "total", "layer", "head", "direction", "accuracy", "ci_low",
                   "ci_high"]  # fmt: skip
        rel = tables_a["syntax_best"][columns].merge(
            tables_b["syntax_best"][columns], on="relation", suffixes=("_a", "_b")
        )
        rel["accuracy_change"] = rel.accuracy_b - rel.accuracy_a
        rel["intervals_overlap"] = overlap(rel, "ci_low", "ci_high")
        enough = Thresholds(**run_a.get("thresholds", {})).relation_min_words
        frequent = (rel.total_a >= enough) & (rel.total_b >= enough)
        rel["change_p"], rel["change_called"] = called_changes(rel, "accuracy", frequent)
        out["compare_relations"] = rel.sort_values("total_a", ascending=False, kind="stable")
    pairs = attention_divergence(examples_a, examples_b)
    if pairs is not None:
        out["compare_attention"] = pairs
        if same:
            own = pairs[(pairs.layer_a == pairs.layer_b) & (pairs.head_a == pairs.head_b)]
            own = own.rename(columns={"layer_a": "layer", "head_a": "head", "js": "attention_js"})
            heads = out["compare_heads"].merge(own[["layer", "head", "attention_js"]], how="left")
            out["compare_heads"] = heads
    return run_a, run_b, out


def called_changes(
    table: pd.DataFrame, measure: str, eligible: pd.Series | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Which changes from A to B to call: a two-sided test of each difference, its standard
    error read off the two 95% intervals (columns ``ci_low_a``… or ``{measure}``'s prefix), the
    p-values screened together with Benjamini–Hochberg at ``probe.inference.FDR``. A row whose
    interval is missing or degenerate (a bootstrap on a handful of sentences collapses to a
    point) is no test, and neither is one not ``eligible``.

    Returns
    -------
    p : two-sided p-values, NaN where no test
    called : booleans
    """
    prefix = measure[: -len("accuracy")] if measure.endswith("accuracy") else ""
    z95 = NormalDist().inv_cdf(0.975)
    low_a, high_a = table[f"{prefix}ci_low_a"], table[f"{prefix}ci_high_a"]
    low_b, high_b = table[f"{prefix}ci_low_b"], table[f"{prefix}ci_high_b"]
    usable = (high_a > low_a) & (high_b > low_b)  # False where NaN, too
    if eligible is not None:
        usable &= eligible
    se = np.sqrt(((high_a - low_a) / (2 * z95)) ** 2 + ((high_b - low_b) / (2 * z95)) ** 2)
    z = ((table[f"{measure}_b"] - table[f"{measure}_a"]) / se.where(usable)).to_numpy(float)
    p = np.array([2 * (1 - NormalDist().cdf(abs(v))) if v == v else np.nan for v in z])
    return p, benjamini_hochberg(p, FDR)


def overlap(table: pd.DataFrame, low: str, high: str) -> pd.Series:
    """Whether A's and B's intervals (columns ``{low}_a``, ``{high}_a``, ``{low}_b``…) overlap."""
    return (table[f"{low}_b"] <= table[f"{high}_a"]) & (table[f"{low}_a"] <= table[f"{high}_b"])


def relation_change(
    heads_a: pd.DataFrame, syntax_a: pd.DataFrame, syntax_b: pd.DataFrame
) -> pd.DataFrame:
    """Per head of A with a best relation: its accuracy on that relation (read the same way) in
    A and in B, with their 95% intervals; a change is called as ``called_changes`` calls it."""
    keys = ["relation", "direction", "layer", "head"]
    chosen = heads_a[heads_a.best_relation.fillna("") != ""]
    chosen = chosen.rename(columns={"best_relation": "relation",
                                    "best_relation_direction": "direction"})[keys]  # fmt: skip
    columns = [*keys, "accuracy", "ci_low", "ci_high"]
    joined = chosen.merge(syntax_a[columns], on=keys).merge(
        syntax_b[columns], on=keys, suffixes=("_a", "_b")
    )
    p, called = called_changes(joined, "accuracy")
    return pd.DataFrame(
        {
            "layer": joined.layer,
            "head": joined["head"],
            "relation": joined.relation,
            "relation_direction": joined.direction,
            "relation_accuracy_a": joined.accuracy_a,
            "relation_ci_low_a": joined.ci_low_a,
            "relation_ci_high_a": joined.ci_high_a,
            "relation_accuracy_b": joined.accuracy_b,
            "relation_ci_low_b": joined.ci_low_b,
            "relation_ci_high_b": joined.ci_high_b,
            "relation_accuracy_change": joined.accuracy_b - joined.accuracy_a,
            "relation_change_p": p,
            "relation_change_called": called,
        }
    )


def common_sentences(examples_a: dict, examples_b: dict) -> list[tuple[dict, dict]]:
    """The example sentences both reports kept: the same treebank position and the same words
    (the tokens may differ)."""
    key = lambda s: (s.get("index"), tuple(s["words"]))  # noqa: E731
    in_b = {key(s): s for s in examples_b["sentences"]}
    return [(s, in_b[key(s)]) for s in examples_a["sentences"] if key(s) in in_b]


def attention_divergence(examples_a: dict, examples_b: dict) -> pd.DataFrame | None:
    """Every head of A against every head of B: the Jensen-Shannon divergence (nats) between
    their word-level attention, averaged over the query words of the sentences both reports
    kept. Attention on tokens of no word (special tokens) is one more outcome, so each query's
    distribution sums to 1 whatever the tokenizer. None where no sentence is common.

    Returns
    -------
    pandas.DataFrame
        One row per pair: ``layer_a, head_a, layer_b, head_b, js, sentences, words``.
    """
    common = common_sentences(examples_a, examples_b)
    if not common:
        return None
    total, words = None, 0
    for sentence_a, sentence_b in common:
        p, q = _word_distributions(sentence_a), _word_distributions(sentence_b)
        part = pairwise_js(p, q)  # [heads of A, heads of B], summed over query words
        total = part if total is None else total + part
        words += p.shape[1]
    js = (total / words).clamp(min=0).numpy()  # JS ≥ 0, rounding aside (as roles' table)
    shape_a = common[0][0]["pattern"].shape[:2]
    shape_b = common[0][1]["pattern"].shape[:2]
    layer_a, head_a = np.unravel_index(np.arange(js.shape[0]), shape_a)
    layer_b, head_b = np.unravel_index(np.arange(js.shape[1]), shape_b)
    return pd.DataFrame(
        {
            "layer_a": np.repeat(layer_a, js.shape[1]),
            "head_a": np.repeat(head_a, js.shape[1]),
            "layer_b": np.tile(layer_b, js.shape[0]),
            "head_b": np.tile(head_b, js.shape[0]),
            "js": js.ravel(),
            "sentences": len(common),
            "words": words,
        }
    )


def _word_distributions(sentence: dict):
    """``[layer·head, word, word + 1]``: each word's attention to every word, then to the tokens
    of no word."""
    import torch

    from probe.inputs.alignment import word_attention

    pattern = torch.from_numpy(sentence["pattern"]).double()
    L, H = pattern.shape[:2]
    n = len(sentence["words"])
    word_of_token = torch.tensor(sentence["word_of_token"])[None]
    words = word_attention(pattern[None], word_of_token, n)[0].reshape(L * H, n, n)
    rest = (1 - words.sum(-1, keepdim=True)).clamp_min(0)
    return torch.cat([words, rest], -1)


def compare(a: Path, b: Path, out: Path, overwrite: bool = False) -> Path:
    """Write the comparison of report folders ``a`` and ``b`` into ``out``; returns it."""
    refuse_inputs(out, [a, b])
    check_free(out, overwrite, kind="comparison")  # before the tables are read
    with locked(a, b, reading=True), disagreeing(a, b):  # not while analyze replaces one
        run_a, run_b, tables = compare_tables(Path(a), Path(b))  # errors before any write
        card = {
            "a": str(a), "b": str(b), "model_a": run_a["model"], "model_b": run_b["model"],
            "shape_a": [run_a["layers"], run_a["heads"]],
            "shape_b": [run_b["layers"], run_b["heads"]],
            "command": " ".join(["probe", *sys.argv[1:]]) if sys.argv else "probe compare",
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
        }  # fmt: skip
        page = render(card, run_a, run_b, tables)
    with reserved(out, overwrite, kind="comparison") as folder:
        for name, table in tables.items():
            write_file(
                folder / f"{name}.csv",
                lambda tmp, t=table: t.to_csv(tmp, index=False, float_format="%.6g"),
            )
        write_file(folder / "compare.json", json.dumps(card, indent=2))
        write_file(folder / "index.html", page)
    return out


def render(card: dict, run_a: dict, run_b: dict, tables: dict[str, pd.DataFrame]) -> str:
    env = environment()
    figures = page_figures(PLOTS, tables)
    changed = moved = None
    if "compare_heads" in tables:
        heads = tables["compare_heads"]
        changed = heads[(heads.roles_gained != "") | (heads.roles_lost != "")]
        if "relation_accuracy_change" in heads:
            scored = heads[heads.relation.fillna("") != ""]
            moved = scored.reindex(
                scored.relation_accuracy_change.abs().sort_values(ascending=False).index
            ).head(12)
    return env.get_template("compare.html.j2").render(
        card=card, a=run_a, b=run_b, figures=[{"figure": f, "html": embed(f)} for f in figures],
        relations=tables.get("compare_relations"), changed=changed,
        layers=tables.get("compare_layers"), attention=_attention_summary(tables), moved=moved,
    )  # fmt: skip


# The comparison's figures, for its page and for `probe figures` (``analyses.figures``).
PLOTS = (
    Plot("rank-changes", "Change of each head's effective rank", "analyses.paper:rank_changes",
         page=lambda tables: _rank_changes(tables),
         needs=("compare_heads:qk_effective_rank_change",),
         panels=({"circuit": "qk"}, {"circuit": "ov"}), width="page"),
    Plot("relations", "The best head's accuracy per relation, A and B",
         "analyses.paper:relation_changes", needs=("compare_relations",)),
    Plot("layer-roles", "Roles per layer, matched by relative depth",
         "analyses.paper:layer_roles", page=lambda tables: _layer_roles(tables),
         needs=("compare_layers",)),
    Plot("layer-correspondence", "Which layers of B attend like which layers of A",
         "analyses.paper:layer_correspondence", page=lambda tables: _layer_correspondence(tables),
         needs=("compare_attention",)),
)  # fmt: skip


def nearest_heads(pairs: pd.DataFrame) -> pd.DataFrame:
    """For each head of A, the head of B whose attention is nearest (least JS divergence)."""
    best = pairs.loc[pairs.groupby(["layer_a", "head_a"]).js.idxmin()]
    return best.reset_index(drop=True)


def _attention_summary(tables: dict[str, pd.DataFrame]) -> dict | None:
    """What the page says of the attention comparison: its size, and the heads of A whose
    attention moved most (same shape) or each of A's heads' nearest in B."""
    pairs = tables.get("compare_attention")
    if pairs is None:
        return None
    nearest = nearest_heads(pairs).rename(columns={"js": "nearest_js"})
    heads = tables.get("compare_heads")
    if heads is not None:
        moved = heads.merge(nearest, left_on=["layer", "head"], right_on=["layer_a", "head_a"])
        rows = moved.sort_values("attention_js", ascending=False, kind="stable").head(12)
    else:
        rows = nearest.sort_values("nearest_js", kind="stable").head(12)
    return {"sentences": int(pairs.sentences.iloc[0]), "words": int(pairs.words.iloc[0]),
            "rows": rows.to_dict("records"), "same": heads is not None}  # fmt: skip


def _rank_changes(tables: dict[str, pd.DataFrame]) -> Figure | None:
    heads = tables.get("compare_heads")
    if heads is None or "qk_effective_rank_change" not in heads:
        return None
    alt = "Two layer-by-head heatmaps of the change in QK and OV effective rank from A to B."
    drawings = []
    for circuit in ("qk", "ov"):
        grid = heads.pivot(index="layer", columns="head", values=f"{circuit}_effective_rank_change")
        limit = max(float(np.nanmax(np.abs(grid.to_numpy()))), 1e-9)
        drawings.append(svg.heatmaps(
            [svg.Grid(f"{circuit.upper()} effective rank: B − A", grid)], vmin=-limit,
            vmax=limit, anchors=svg.BLUE_RED, label="B − A", alt=alt, name=f"rank-{circuit}",
            size=(300, 170),
        ))  # fmt: skip
    title = "Change of each head's effective rank"
    return Figure("rank-changes", title, alt, "".join(drawings))


def _layer_roles(tables: dict[str, pd.DataFrame]) -> Figure | None:
    layers = tables.get("compare_layers")
    if layers is None:
        return None
    series = []
    for role in Role:
        if layers[f"{role}_a"].any() or layers[f"{role}_b"].any():
            series.append(svg.Series(f"{role} (A)", layers.layer_a, layers[f"{role}_a"],
                                     role.colour))  # fmt: skip
            series.append(svg.Series(f"{role} (B)", layers.layer_a, layers[f"{role}_b"],
                                     role.colour, dashed=True))  # fmt: skip
    chart = svg.Chart("Roles per layer: A solid, B dashed", series,
                      "layer of A (B's layer at the same relative depth)",
                      "share of the layer's heads")  # fmt: skip
    alt = "Line chart of the share of heads holding each role, per matched layer, for A and B."
    drawing = svg.charts([chart], alt=alt, size=(560, 220))
    return Figure("layer-roles", "Roles per layer, matched by relative depth", alt, drawing)


def _layer_correspondence(tables: dict[str, pd.DataFrame]) -> Figure | None:
    pairs = tables.get("compare_attention")
    if pairs is None:
        return None
    # each head of A's nearest head within each layer of B, averaged over A's layer
    nearest = pairs.groupby(["layer_a", "head_a", "layer_b"]).js.min().reset_index()
    grid = nearest.groupby(["layer_a", "layer_b"]).js.mean().unstack()
    alt = (
        "Heatmap, layers of A by layers of B: for each head of A, the least Jensen-Shannon "
        "divergence to a head of B's layer, averaged over A's layer; darker is closer."
    )
    values = grid.to_numpy(dtype=float)
    low, high = float(np.nanmin(values)), float(np.nanmax(values))
    drawing = svg.heatmaps(
        [svg.Grid("Nearest head's attention divergence", grid, axes=("layer of A", "layer of B"))],
        vmin=low, vmax=max(high, low + 1e-9), anchors=svg.VIRIDIS, label="mean JS (nats)",
        alt=alt, name="layer-correspondence", size=(260, 200),
    )  # fmt: skip
    title = "Which layers of B attend like which layers of A"
    return Figure("layer-correspondence", title, alt, drawing)
