"""Head types researchers look for in today's models: previous-token, duplicate-token and
induction heads on repeated random sequences, each beside its null; copying from the weights;
attention sinks (Gu et al.'s α) on the treebank's sentences.

The scores are defined in ``probe.headtypes``; here they are streamed (per-sequence sums and sums
of squares, so that each mean has a 95% normal interval over sequences, exact under merging),
tabled, and turned into roles: a head is an induction (duplicate-token) head when the lower end
of its score's interval lies at least a threshold above the score's null. ``copying`` is
Σ Re λ / Σ |λ| over the eigenvalues of the head's full OV circuit W_E W_V W_O W_U (Elhage et al.
2021), from ``probe.copying``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

from analyses import Analysis, Context, Measure, Schema, svg
from analyses.figures import Figure, Plot
from analyses.vocabulary import Role, Thresholds
from probe.lazy import lazy
from probe.units.repeats import LENGTH, SEQUENCES

if TYPE_CHECKING:
    from probe.corpus import Batch
    from probe.runner import LayerCapture

np = lazy("numpy")
pd = lazy("pandas")
torch = lazy("torch")
headtypes = lazy("probe.headtypes")

SCORES = ("previous_token", "duplicate_token", "induction")  # as probe.headtypes.SCORES
Z95 = 1.959963984540054
MIN_SEQUENCES = 20  # fewer sequences give no interval, and no role
SINK_ALPHA = 0.3  # Gu et al.: a head is a sink head where α exceeds it
EXAMPLE_LENGTH = 10  # tokens per copy of the head cards' example sequence
EXAMPLE_MIN_WEIGHT = 0.01  # weights kept of the example (the rest are drawn as 0)


class Taxonomy(Analysis):
    """Per head: the three offset scores on repeats and nulls, copying, and sink α."""

    name = "taxonomy"
    title = "Head types"
    captures = ("hook_pattern",)
    unit = ("repeats", "sentence")
    options = (SEQUENCES, LENGTH)
    default = False  # a second corpus's worth of forward passes: asked for by name
    tables: ClassVar[dict[str, Schema]] = {
        "taxonomy": {
            "attention": "str", "layer": "int", "head": "int",
            **{f"{s}{part}": "float" for s in SCORES
               for part in ("", "_low", "_high", "_null", "_null_low", "_null_high")},
            "sequences": "int", "copying": "float", "unembedding": "str",
            "sink_alpha": "float", "sink_queries": "int",
        },
        "taxonomy_example": {
            "layer": "int", "head": "int", "query": "int", "key": "int", "weight": "float",
        },
    }  # fmt: skip
    head_columns: ClassVar[Schema] = {
        "previous_token_score": "float",
        "duplicate_token_score": "float",
        "induction_score": "float",
        "copying_score": "float",
        "sink_alpha": "float",
    }
    measures = (
        Measure("induction_score", "induction score", "num", "higher", role=Role.INDUCTION),
        Measure("duplicate_token_score", "duplicate-token score", "num", "higher"),
        Measure("previous_token_score", "previous-token score", "num", "higher"),
        Measure("copying_score", "copying (OV eigenvalues)", "num", "higher"),
        Measure("sink_alpha", "sink α (attention to the first token)", "num", "higher"),
    )

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        L, H = context.n_layers, context.n_heads
        self.n = int(context.options.get("repeat_length", LENGTH.default))
        # [repeat or null, score, layer, head]: Σ x and Σ x² over sequences of per-sequence x
        self.sums = torch.zeros(2, len(SCORES), L, H, dtype=torch.float64)
        self.squares = torch.zeros(2, len(SCORES), L, H, dtype=torch.float64)
        self.sequences = [0, 0]
        self.sink = torch.zeros(L, H, dtype=torch.float64)
        self.sink_queries = 0

    def update(self, batch: Batch, layer: int, capture: LayerCapture) -> None:
        p = capture.pattern  # [B, H, T, T]
        if batch.unit == "repeats":
            scores = headtypes.offset_scores(p, self.n).double().cpu()  # [B, 3, H]
            null = (batch.index % 2).bool().cpu()  # odd index: the null of its pair
            for kind, rows in enumerate((~null, null)):
                self.sums[kind, :, layer] += scores[rows].sum(0)
                self.squares[kind, :, layer] += (scores[rows] ** 2).sum(0)
        else:
            sums, queries = headtypes.sink_sums(p, batch.attention_mask.bool())
            self.sink[layer] += sums.double().cpu()
            if layer == 0:
                self.sink_queries += queries

    def end_batch(self, batch: Batch) -> None:
        if batch.unit == "repeats":
            null = int((batch.index % 2).sum())
            self.sequences[0] += len(batch) - null
            self.sequences[1] += null

    def merge(self, other: Taxonomy) -> None:
        self._check_mergeable(other)
        for name in ("sums", "squares", "sink"):
            getattr(self, name).add_(getattr(other, name))
        self.sequences = [a + b for a, b in zip(self.sequences, other.sequences, strict=True)]
        self.sink_queries += other.sink_queries

    def _tables(self) -> dict[str, pd.DataFrame]:
        """``taxonomy``: one row per head; ``taxonomy_example``: the heads' attention on one short
        repeated sequence, for the cards."""
        from probe.architectures import attentions

        L, H = self.context.n_layers, self.context.n_heads
        layer, head = np.divmod(np.arange(L * H), H)
        model = self.context.model
        first = str(next(iter(attentions(model)))) if model is not None else "blocks.attn"
        table = pd.DataFrame({"attention": first, "layer": layer, "head": head})
        for kind, suffix in enumerate(("", "_null")):
            mean, low, high = _intervals(self.sums[kind], self.squares[kind], self.sequences[kind])
            for k, score in enumerate(SCORES):
                table[f"{score}{suffix}"] = mean[k].ravel()
                table[f"{score}{suffix}_low"] = low[k].ravel()
                table[f"{score}{suffix}_high"] = high[k].ravel()
        table["sequences"] = self.sequences[0]
        table = table.merge(_copying(model, L, H), on=["layer", "head"], how="left")
        table["sink_alpha"] = (self.sink / max(self.sink_queries, 1)).flatten().numpy()
        if not self.sink_queries:
            table["sink_alpha"] = math.nan
        table["sink_queries"] = self.sink_queries
        example = _example(model, self.context.tokenizer, self.context.seed)
        return {"taxonomy": table, "taxonomy_example": example}

    @classmethod
    def heads(cls, tables: dict[str, pd.DataFrame], thresholds: Thresholds) -> pd.DataFrame:
        t = tables["taxonomy"]
        induction = t.induction_low >= t.induction_null + thresholds.induction
        duplicate = t.duplicate_token_low >= t.duplicate_token_null + thresholds.duplicate_token
        return pd.DataFrame({
            "layer": t.layer, "head": t["head"],
            "previous_token_score": t.previous_token, "duplicate_token_score": t.duplicate_token,
            "induction_score": t.induction, "copying_score": t.copying,
            "sink_alpha": t.sink_alpha,
            str(Role.INDUCTION): induction.fillna(False).astype(bool),
            str(Role.DUPLICATE_TOKEN): duplicate.fillna(False).astype(bool),
            str(Role.COPYING): (t.copying >= thresholds.copying).fillna(False).astype(bool),
        })  # fmt: skip

    @classmethod
    def summary(cls, tables: dict[str, pd.DataFrame]) -> list[str]:
        t = tables["taxonomy"]
        if t.empty:
            return []
        lines = []
        for score in SCORES:
            best = t.loc[t[score].idxmax()]
            low, high, null = (best[f"{score}{part}"] for part in ("_low", "_high", "_null"))
            lines.append(f"{score.replace('_', '-')}: best head {best.layer}-{best['head']} "
                         f"{best[score]:.2f} [{low:.2f}, {high:.2f}], null {null:.2f}")  # fmt: skip
        shares = sink_shares(t)
        if shares.notna().any():
            lines.append("heads with sink α > 0.3 per layer: "
                         + " ".join(f"{s:.0%}" for s in shares))  # fmt: skip
        return lines

    plots = (
        Plot("scores", "Scores on repeated sequences, and nulls", "analyses.paper:taxonomy_scores",
             page=lambda tables: scores(tables), needs=("taxonomy",), width="page"),
        Plot("weights", "Copying and sinks", "analyses.paper:taxonomy_weights",
             page=lambda tables: weights(tables), needs=("taxonomy",)),
    )  # fmt: skip

    @classmethod
    def section(cls, tables: dict[str, pd.DataFrame], run: dict) -> dict:
        t = tables["taxonomy"]
        thresholds = Thresholds(**run.get("thresholds", {}))
        best = [t.loc[t[s].idxmax()].to_dict() | {"score": s} for s in SCORES] if len(t) else []
        return {
            "best": best,
            "sink_shares": sink_shares(t).to_dict(),
            "rules": {
                r: thresholds.describe()[r]
                for r in (Role.INDUCTION, Role.DUPLICATE_TOKEN, Role.COPYING)
            },
            "unembedding": t.unembedding.iloc[0] if len(t) else "",
            "examples": {
                f"{layer}-{head}": _card_view(part, layer, head)
                for (layer, head), part in tables["taxonomy_example"].groupby(["layer", "head"])
            },
        }


def sink_shares(table: pd.DataFrame) -> pd.Series:
    """Per layer, the share of heads whose sink α exceeds ``SINK_ALPHA`` (Gu et al.)."""
    return table.groupby("layer").sink_alpha.apply(lambda a: (a > SINK_ALPHA).mean())


def _intervals(sums, squares, count: int):
    """Means and 95% normal intervals over ``count`` sequences, ``[score, layer, head]`` each;
    NaN bounds below ``MIN_SEQUENCES`` (too few for an interval)."""
    mean = (sums / max(count, 1)).numpy()
    if count < MIN_SEQUENCES:
        nan = np.full_like(mean, math.nan)
        return (mean if count else nan), nan, nan
    variance = np.maximum((squares.numpy() - count * mean**2) / (count - 1), 0)
    half = Z95 * np.sqrt(variance / count)
    return mean, mean - half, mean + half


def _copying(model, n_layers: int, n_heads: int) -> pd.DataFrame:
    """Each head's copying score of the model's first attention (NaN without the model)."""
    if model is None:
        return pd.DataFrame({"layer": [], "head": [], "copying": [], "unembedding": []})
    from probe.architectures import attentions
    from probe.copying import copying_scores

    scores = copying_scores(model)
    first = str(next(iter(attentions(model))))
    scores = scores[scores.attention.astype(str) == first]
    return scores[["layer", "head", "copying", "unembedding"]]


def _example(model, tokenizer, seed: int) -> pd.DataFrame:
    """Every head's attention on one short repeated sequence (BOS, ``EXAMPLE_LENGTH`` tokens
    twice), the weights of at least ``EXAMPLE_MIN_WEIGHT``, rounded to 1e-3."""
    columns = ["layer", "head", "query", "key", "weight"]
    if model is None or tokenizer is None:
        return pd.DataFrame(columns=columns)
    from probe.hookpoints import trace
    from probe.loading import main_device
    from probe.units import Source
    from probe.units.repeats import RepeatedSequences

    unit = RepeatedSequences(Source(seed=seed), tokenizer, 10**6,
                             options={"repeat_length": EXAMPLE_LENGTH})  # fmt: skip
    ids = torch.tensor([unit.pair(0)[0]], device=main_device(model))
    with torch.inference_mode(), trace(model, "hook_pattern") as cache:
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    p = cache.stack("hook_pattern")[:, 0].float().cpu()  # [layer, head, q, k]
    layer, head, query, key = (p >= EXAMPLE_MIN_WEIGHT).nonzero(as_tuple=True)
    weight = p[layer, head, query, key].double().numpy().round(3)
    return pd.DataFrame(dict(zip(columns, [layer, head, query, key, weight], strict=True)))


def _card_view(part: pd.DataFrame, layer: int, head: int) -> str:
    """A head's example as a query x key heatmap, the repeat's stripes visible."""
    query, key = part["query"].to_numpy(), part["key"].to_numpy()
    T = int(max(query.max(), key.max(), 2 * EXAMPLE_LENGTH)) + 1  # with an encoder's [SEP]
    grid = np.zeros((T, T))
    grid[query, key] = part["weight"].to_numpy()
    values = pd.DataFrame(grid, index=range(T), columns=range(T))
    alt = (
        f"Layer {layer}, head {head}: attention on BOS then {EXAMPLE_LENGTH} random tokens, "
        "repeated; an induction head shows a stripe one key right of the repeat's diagonal."
    )
    return svg.heatmaps([svg.Grid(f"{layer}-{head} on a repeated sequence", values, None,
                                  ("query", "key"))], vmin=0, vmax=1, anchors=svg.MAGMA,
                        label="attention", alt=alt, name=f"taxonomy-card-{layer}-{head}",
                        columns=1, size=(160, 160))  # fmt: skip


def scores(tables: dict[str, pd.DataFrame]) -> Figure:
    """Layer x head heatmaps of each score on repeated sequences and its null, as inline SVG."""
    t = tables["taxonomy"]
    grids = []
    for score in SCORES:
        for suffix, what in (("", "repeats"), ("_null", "null")):
            values = t.pivot(index="layer", columns="head", values=f"{score}{suffix}")
            grids.append(svg.Grid(f"{score.replace('_', '-')}: {what}", values))
    alt = ("Heatmaps of layer by head: each score on repeated sequences beside its null "
           "(the same positions on sequences without a repeat).")  # fmt: skip
    drawing = svg.heatmaps(grids, vmin=0, vmax=1, anchors=svg.VIRIDIS, label="mean attention",
                           alt=alt, name="taxonomy-scores", columns=2)  # fmt: skip
    title = "Scores on repeated sequences, and nulls"
    return Figure("taxonomy-scores", title, alt, drawing)


def weights(tables: dict[str, pd.DataFrame]) -> Figure | None:
    """Layer x head heatmaps of copying and sink α (None without either), as inline SVG."""
    t = tables["taxonomy"]
    other = [
        svg.Grid(title, t.pivot(index="layer", columns="head", values=column))
        for column, title in (("copying", "copying (OV eigenvalues)"), ("sink_alpha", "sink α"))
        if t[column].notna().any()
    ]
    if not other:
        return None
    alt = "Heatmaps of layer by head: copying score (−1 to 1) and sink α (0 to 1)."
    drawing = svg.heatmaps(other, vmin=-1, vmax=1, anchors=svg.BLUE_RED, label="score",
                           alt=alt, name="taxonomy-weights", columns=2)  # fmt: skip
    return Figure("taxonomy-weights", "Copying and sinks", alt, drawing)
