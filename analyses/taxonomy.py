"""Head types researchers look for in today's models: previous-token, duplicate-token and
induction heads on repeated random sequences, each beside its null; copying from the weights;
attention sinks (Gu et al.'s α) on the treebank's sentences, or a ``--corpus``'s windows.

The scores are defined in ``probe.patterns.headtypes``; here they are streamed (per-sequence sums
and sums of squares, so that each mean has a 95% normal interval over sequences, exact under
merging), tabled, and turned into roles: a head is an induction (duplicate-token,
previous-token) head when the lower end of its score's interval lies at least a threshold above
the score's null. The previous-token score's null is a head attending uniformly over the keys it
sees (``headtypes.uniform_previous``), not the null sequences': the previous token is the
previous token there too, so a previous-token head would score its null exactly. ``copying`` is Σ
Re λ / Σ |λ| over the eigenvalues of the head's full OV circuit W_E W_V W_O W_U (Elhage et al.
2021), from ``probe.weights.copying``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

from analyses import Analysis, Context, Measure, Schema, svg
from analyses.figures import Figure, Plot
from analyses.vocabulary import Role, Thresholds
from probe.capture.names import Attention
from probe.inputs.units import Either
from probe.inputs.units.repeats import LENGTH, SEQUENCES
from probe.lazy import lazy

if TYPE_CHECKING:
    from probe.capture.rows import RowBlock
    from probe.inputs.corpus import Batch

np = lazy("numpy")
pd = lazy("pandas")
torch = lazy("torch")
headtypes = lazy("probe.patterns.headtypes")

SCORES = ("previous_token", "duplicate_token", "induction")  # as probe.patterns.headtypes.SCORES
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
    rows = True
    unit = ("repeats", Either("text", "sentence"))  # sink α: a corpus when one is given
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
        self.n = int(context.options.get("repeat_length", LENGTH.default))
        # Every self-attention (an encoder-decoder model's encoder and decoder), by its shape.
        self.shapes = _self_attentions(context)
        self.attention = tuple(self.shapes)
        # [repeat or null, score, layer, head]: Σ x and Σ x² over sequences of per-sequence x
        self.sums = {a: torch.zeros(2, len(SCORES), L, H, dtype=torch.float64)
                     for a, (L, H) in self.shapes.items()}  # fmt: skip
        self.squares = {a: torch.zeros_like(t) for a, t in self.sums.items()}
        self.sequences = [0, 0]
        self.sink = {a: torch.zeros(L, H, dtype=torch.float64) for a, (L, H) in self.shapes.items()}
        self.sink_queries = 0
        # per attention: the previous-token score of a uniform head (its null), once a batch
        # of repeats has shown the sequences' length
        self.uniform = dict.fromkeys(self.shapes, math.nan)

    def begin_batch(self, batch: Batch) -> None:
        # per attention [layer, sequence, score, head]: Σ over the sequence's rows seen so far
        self._offsets = {a: torch.zeros(L, len(batch), len(SCORES), H, dtype=torch.float64)
                         for a, (L, H) in self.shapes.items()}  # fmt: skip

    def update_rows(self, batch: Batch, layer: int, block: RowBlock) -> None:
        a = block.attention
        decoder = a == Attention.DECODER  # reads the sequence one position right
        if batch.unit == "repeats":  # a sequence's scores are complete once all its rows are in
            sums = headtypes.offset_sums(block, self.n, int(decoder))
            self._offsets[a][layer] += sums.double().cpu()
        else:
            # the decoder's real positions are the sentence's too: its start token, then the
            # sentence without its last token (``probe.pipeline.runner.decoder_inputs``)
            if block.rows.start >= headtypes.SINK_TOKENS:  # past the queries α is read on
                return
            real = batch.attention_mask.bool()
            sums, queries = headtypes.sink_block_sums(block, real)
            self.sink[a][layer] += sums.double().cpu()
            if layer == 0 and a == self.attention[0]:
                self.sink_queries += queries

    def end_batch(self, batch: Batch) -> None:
        if batch.unit != "repeats":
            return
        null = (batch.index % 2).bool().cpu()  # odd index: the null of its pair
        for a, offsets in self._offsets.items():
            scores = offsets / headtypes.offset_queries(self.n).double()[:, None]  # [L, B, 3, H]
            for kind, rows in enumerate((~null, null)):
                self.sums[a][kind] += scores[:, rows].sum(1).transpose(0, 1)
                self.squares[a][kind] += (scores[:, rows] ** 2).sum(1).transpose(0, 1)
        self.sequences[0] += len(batch) - int(null.sum())
        self.sequences[1] += int(null.sum())
        for a in self.uniform:
            decoder = a == Attention.DECODER
            causal = decoder or (a == Attention.BLOCKS and self.context.causal)
            self.uniform[a] = headtypes.uniform_previous(self.n, int(decoder), causal=causal,
                                                         keys=batch.input_ids.shape[1])  # fmt: skip

    def merge(self, other: Taxonomy) -> None:
        self._check_mergeable(other)
        for name in ("sums", "squares", "sink"):
            for a, t in getattr(self, name).items():
                t.add_(getattr(other, name)[a])
        self.sequences = [a + b for a, b in zip(self.sequences, other.sequences, strict=True)]
        self.sink_queries += other.sink_queries
        for a, value in other.uniform.items():  # the same wherever both saw a batch
            if not math.isnan(value):
                self.uniform[a] = value

    def _tables(self) -> dict[str, pd.DataFrame]:
        """``taxonomy``: one row per head of every self-attention; ``taxonomy_example``: the
        heads' attention on one short repeated sequence, for the cards."""
        model = self.context.model
        table = pd.concat([self._table(a) for a in self.shapes], ignore_index=True)
        table = table.merge(_copying(model), on=["attention", "layer", "head"], how="left")
        table["sink_queries"] = self.sink_queries
        table = table[list(self.tables["taxonomy"])]
        example = _example(model, self.context.tokenizer, self.context.seed)
        return {"taxonomy": table, "taxonomy_example": example}

    def _table(self, attention: str) -> pd.DataFrame:
        """One attention's rows: the scores, their intervals and nulls, and sink α."""
        L, H = self.shapes[attention]
        layer, head = np.divmod(np.arange(L * H), H)
        table = pd.DataFrame({"attention": attention, "layer": layer, "head": head})
        for kind, suffix in enumerate(("", "_null")):
            sums, squares = self.sums[attention][kind], self.squares[attention][kind]
            mean, low, high = _intervals(sums, squares, self.sequences[kind])
            for k, score in enumerate(SCORES):
                table[f"{score}{suffix}"] = mean[k].ravel()
                table[f"{score}{suffix}_low"] = low[k].ravel()
                table[f"{score}{suffix}_high"] = high[k].ravel()
        for part in ("", "_low", "_high"):  # a fixed number: its interval is the point
            table[f"previous_token_null{part}"] = self.uniform[attention]
        table["sequences"] = self.sequences[0]
        alpha = (self.sink[attention] / max(self.sink_queries, 1)).flatten().numpy()
        table["sink_alpha"] = alpha if self.sink_queries else math.nan
        return table

    @classmethod
    def heads(cls, tables: dict[str, pd.DataFrame], thresholds: Thresholds) -> pd.DataFrame:
        t = _first(tables["taxonomy"])  # heads.csv: the first attention's heads
        induction = t.induction_low >= t.induction_null + thresholds.induction
        duplicate = t.duplicate_token_low >= t.duplicate_token_null + thresholds.duplicate_token
        previous = t.previous_token_low >= t.previous_token_null + thresholds.previous_token_repeats
        return pd.DataFrame({
            "layer": t.layer, "head": t["head"],
            "previous_token_score": t.previous_token, "duplicate_token_score": t.duplicate_token,
            "induction_score": t.induction, "copying_score": t.copying,
            "sink_alpha": t.sink_alpha,
            str(Role.INDUCTION): induction.fillna(False).astype(bool),
            str(Role.DUPLICATE_TOKEN): duplicate.fillna(False).astype(bool),
            str(Role.PREVIOUS_TOKEN): previous.fillna(False).astype(bool),
            # W_Eᵀ in place of an unembedding gives a copying head no particular sign
            str(Role.COPYING): ((t.copying >= thresholds.copying) & ~stand_in(t))
                               .fillna(False).astype(bool),
        })  # fmt: skip

    @classmethod
    def summary(cls, tables: dict[str, pd.DataFrame]) -> list[str]:
        lines = []
        for prefix, t in _by_attention(tables["taxonomy"]):
            for score in SCORES:
                best = t.loc[t[score].idxmax()]
                low, high, null = (best[f"{score}{part}"] for part in ("_low", "_high", "_null"))
                lines.append(f"{prefix}{score.replace('_', '-')}: best head "
                             f"{best.layer}-{best['head']} {best[score]:.2f} "
                             f"[{low:.2f}, {high:.2f}], null {null:.2f}")  # fmt: skip
            if stand_in(t).any():
                lines.append(f"{prefix}copying: the checkpoint has no unembedding, so W_Eᵀ "
                             "stood in for W_U; no head is given the copying role")  # fmt: skip
            shares = sink_shares(t)
            if shares.notna().any():
                lines.append(f"{prefix}heads with sink α > 0.3 per layer: "
                             + " ".join(f"{s:.0%}" for s in shares))  # fmt: skip
        return lines

    @classmethod
    def finish_reads(cls, tables: dict[str, pd.DataFrame], run: dict) -> str | None:
        return "the weights (copying)"

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
        names = list(dict.fromkeys(t.attention))
        best = [
            part.loc[part[s].idxmax()].to_dict() | {"score": s, "card": k == 0}  # cards: 1st
            for k, (_, part) in enumerate(_by_attention(t))
            for s in SCORES
        ]
        return {
            "best": best,
            "attentions": names,
            "sink_shares": {a: sink_shares(t[t.attention == a]).to_dict() for a in names},
            "rules": {
                r: thresholds.describe()[r]
                for r in (Role.INDUCTION, Role.DUPLICATE_TOKEN, Role.PREVIOUS_TOKEN, Role.COPYING)
            },
            "unembedding": t.unembedding.iloc[0] if len(t) else "",
            "stand_in": bool(stand_in(_first(t)).any()),
            "examples": {
                f"{layer}-{head}": _card_view(part, layer, head)
                for (layer, head), part in tables["taxonomy_example"].groupby(["layer", "head"])
            },
        }


def _by_attention(table: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """The table's rows by attention, in order, each with the prefix its lines and titles take:
    none where the model has one self-attention, ``"decoder.attn: "`` and so on where not."""
    names = list(dict.fromkeys(table.attention))
    return [(f"{a}: " if len(names) > 1 else "", table[table.attention == a]) for a in names]


def stand_in(table: pd.DataFrame) -> pd.Series:
    """Per row, whether W_Eᵀ stood in for an unembedding the checkpoint lacks (copying scores
    measured so say nothing of copying)."""
    return table.unembedding == "input_embedding_transposed"


def sink_shares(table: pd.DataFrame) -> pd.Series:
    """Per layer, the share of heads whose sink α exceeds ``SINK_ALPHA`` (Gu et al.); give it
    one attention's rows; NaN where α was not measured (no text was read for it)."""
    return table.groupby("layer").sink_alpha.apply(
        lambda a: (a > SINK_ALPHA).mean() if a.notna().any() else math.nan
    )


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


def _self_attentions(context: Context) -> dict[str, tuple[int, int]]:
    """Layers and heads of each self-attention the model has: its only one, or an
    encoder-decoder model's encoder and decoder (cross-attention has no repeat to find)."""
    if context.model is None:
        return {str(Attention.BLOCKS): (context.n_layers, context.n_heads)}
    from probe.capture.spec import describe

    return {
        a.name: (a.n_layers, a.n_heads)
        for a in describe(context.model).attentions
        if a.name != Attention.CROSS
    }


def _first(table: pd.DataFrame) -> pd.DataFrame:
    """The rows of the table's first attention."""
    return table[table.attention == table.attention.iloc[0]] if len(table) else table


def _copying(model) -> pd.DataFrame:
    """Every self-attention head's copying score (none without the model: NaN once merged)."""
    columns = ["attention", "layer", "head", "copying", "unembedding"]
    if model is None:
        return pd.DataFrame({c: pd.Series(dtype=object if c in ("attention", "unembedding")
                                          else float) for c in columns})  # fmt: skip
    from probe.weights.copying import copying_scores

    scores = copying_scores(model)
    scores["attention"] = scores.attention.astype(str)
    return scores[columns]


def _example(model, tokenizer, seed: int) -> pd.DataFrame:
    """Every head's attention on one short repeated sequence (BOS, ``EXAMPLE_LENGTH`` tokens
    twice), the weights of at least ``EXAMPLE_MIN_WEIGHT``, rounded to 1e-3."""
    columns = ["layer", "head", "query", "key", "weight"]
    if model is None or tokenizer is None:
        return pd.DataFrame(columns=columns)
    from probe.capture.hookpoints import trace
    from probe.capture.spec import describe
    from probe.inputs.units import Source
    from probe.inputs.units.repeats import RepeatedSequences
    from probe.pipeline.loading import main_device
    from probe.pipeline.runner import decoder_inputs

    unit = RepeatedSequences(Source(seed=seed), tokenizer, 10**6,
                             options={"repeat_length": EXAMPLE_LENGTH})  # fmt: skip
    ids = torch.tensor([unit.pair(0)[0]], device=main_device(model))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    first = None  # the cards are the first attention's heads: an encoder-decoder's encoder
    if describe(model).encoder_decoder:
        inputs, first = decoder_inputs(model, inputs), Attention.ENCODER
    with torch.inference_mode(), trace(model, "hook_pattern") as cache:
        model(**inputs)
    p = cache.stack("hook_pattern", attention=first)[:, 0].float().cpu()  # [layer, head, q, k]
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
    """Layer x head heatmaps of each score on repeated sequences and its null, as inline SVG;
    every self-attention's, each grid titled with its attention where there are several."""
    grids = []
    for prefix, t in _by_attention(tables["taxonomy"]):
        for score in SCORES:
            for suffix, what in (("", "repeats"), ("_null", "null")):
                values = t.pivot(index="layer", columns="head", values=f"{score}{suffix}")
                grids.append(svg.Grid(f"{prefix}{score.replace('_', '-')}: {what}", values))
    alt = ("Heatmaps of layer by head: each score on repeated sequences beside its null "
           "(the same positions on sequences without a repeat).")  # fmt: skip
    drawing = svg.heatmaps(grids, vmin=0, vmax=1, anchors=svg.VIRIDIS, label="mean attention",
                           alt=alt, name="taxonomy-scores", columns=2)  # fmt: skip
    title = "Scores on repeated sequences, and nulls"
    return Figure("taxonomy-scores", title, alt, drawing)


def weights(tables: dict[str, pd.DataFrame]) -> Figure | None:
    """Layer x head heatmaps of copying and sink α (None without either), as inline SVG."""
    other = [
        svg.Grid(f"{prefix}{title}", t.pivot(index="layer", columns="head", values=column))
        for prefix, t in _by_attention(tables["taxonomy"])
        for column, title in (("copying", "copying (OV eigenvalues)"), ("sink_alpha", "sink α"))
        if t[column].notna().any()
    ]
    if not other:
        return None
    alt = "Heatmaps of layer by head: copying score (−1 to 1) and sink α (0 to 1)."
    drawing = svg.heatmaps(other, vmin=-1, vmax=1, anchors=svg.BLUE_RED, label="score",
                           alt=alt, name="taxonomy-weights", columns=2)  # fmt: skip
    return Figure("taxonomy-weights", "Copying and sinks", alt, drawing)
