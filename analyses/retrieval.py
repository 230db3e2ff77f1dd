"""Retrieval heads (Wu et al. 2024): which heads copy an answer out of a needle in a haystack.

The haystack is the treebank's text (the sentence unit's sentences, joined; any iterable of
strings would do, ``probe.patterns.retrieval.haystack``); the trials, their scores and their nulls
are ``probe.patterns.retrieval``'s. Each head's score is its mean over lengths and depths, with a
95% t-interval over the trials; the null is the same mean with the needle left out. A head whose
score exceeds the ``retrieval`` threshold holds the ``retrieval`` role.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

from analyses import Analysis, Context, Measure, Schema, svg
from analyses.figures import Figure
from analyses.vocabulary import Role, Thresholds
from probe.errors import ProbeError
from probe.lazy import lazy
from probe.options import Option

if TYPE_CHECKING:
    from probe.inputs.corpus import Batch

np = lazy("numpy")
pd = lazy("pandas")

MAX_LENGTH = 1 << 24  # tokens: longer than any model's context
OVERHEAD = 64  # tokens kept free for the special tokens, the needle, the question and the answer
SHOWN = 4  # heads whose length × depth map the report draws


def parse_lengths(text: str) -> list[int]:
    """``"1024,2048"`` -> ``[1024, 2048]``; a ``ProbeError`` naming the option otherwise."""
    try:
        lengths = sorted({int(part) for part in str(text).split(",") if part.strip()})
    except ValueError:
        lengths = []
    if not lengths or lengths[0] < 1:
        raise ProbeError(f"--retrieval-lengths takes positive token counts such as 1024,2048, "
                         f"not {text!r}")  # fmt: skip
    if lengths[-1] > MAX_LENGTH:  # the sentences read for it would be counted past any index
        raise ProbeError(f"--retrieval-lengths {lengths[-1]} is longer than any model's context "
                         f"(probe reads haystacks of up to {MAX_LENGTH:,} tokens); give lengths "
                         "such as 1024,2048")  # fmt: skip
    return lengths


LENGTHS = Option(
    "retrieval_lengths",
    "1024,2048,4096,8192",
    "Haystack lengths in tokens, comma-separated (capped by the model's context).",
    validate=parse_lengths,  # when the run is planned, before the model loads
)


class Retrieval(Analysis):
    """The treebank's text, kept as it streams; the needle trials run once, at the end."""

    name = "retrieval"
    title = "Retrieval heads"
    options = (LENGTHS,)
    default = False  # a forward pass per trial over up to 8k tokens: asked for by name
    tables: ClassVar[dict[str, Schema]] = {
        "retrieval": {
            "layer": "int", "head": "int", "length": "int", "depth": "float", "needle": "bool",
            "score": "float", "answer_tokens": "int",
        },
    }  # fmt: skip
    head_columns: ClassVar[Schema] = {
        "retrieval_score": "float", "retrieval_low": "float", "retrieval_high": "float",
        "retrieval_null": "float",
    }  # fmt: skip
    measures = (
        Measure("retrieval_score", "retrieval score (needle copied)", "num", "higher",
                role=Role.RETRIEVAL),
    )  # fmt: skip

    @classmethod
    def unsupported(cls, model) -> str | None:
        from probe.capture.spec import describe

        if not describe(model).causal:
            return "retrieval heads are read on decoders, which generate the answer"
        return describe(model).rows_unsupported

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        self.lengths = parse_lengths(context.options.get("retrieval_lengths", LENGTHS.default))
        self.texts: dict[int, str] = {}  # sentence index -> its text

    @property
    def reads(self) -> int:
        return max(self.lengths) // 8 + 100  # sentences: EWT has about 15 tokens in each

    def begin_batch(self, batch: Batch) -> None:
        for index, sentence in zip(batch.index.tolist(), batch.sentences, strict=False):
            self.texts[index] = " ".join(sentence.words)

    def merge(self, other: Retrieval) -> None:
        self._check_mergeable(other)
        self.texts.update(other.texts)

    def _tables(self) -> dict[str, pd.DataFrame]:
        from probe.inputs.corpus import max_tokens
        from probe.patterns.retrieval import haystack, needle_trials, scores

        model, tokenizer = self.context.model, self.context.tokenizer
        room = max_tokens(model.config, tokenizer) - OVERHEAD
        texts = (self.texts[i] for i in sorted(self.texts))
        hay = haystack(tokenizer, texts, min(max(self.lengths), room))
        lengths = sorted({min(length, len(hay)) for length in self.lengths})
        trials = needle_trials(tokenizer, hay, lengths, seed=self.context.seed)
        L, H = self.context.n_layers, self.context.n_heads
        layer, head = np.divmod(np.arange(L * H), H)
        parts = [
            pd.DataFrame({"layer": layer, "head": head, "length": t.length, "depth": t.depth,
                          "needle": t.needle, "score": found.ravel(),
                          "answer_tokens": len(t.answer)})
            for t, found in zip(trials, scores(model, trials), strict=True)
        ]  # fmt: skip
        table = pd.concat(parts, ignore_index=True) if parts else None
        return {self.name: table if table is not None else _empty(self.tables[self.name])}

    @classmethod
    def heads(cls, tables: dict[str, pd.DataFrame], thresholds: Thresholds) -> pd.DataFrame:
        """Per head: the mean score over the needle's trials, its 95% t-interval over them, the
        mean over the nulls, and the role."""
        from scipy import stats

        table = tables[cls.name]
        needle = table.needle.astype(bool)
        real = table[needle].groupby(["layer", "head"]).score.agg(["mean", "std", "count"])
        null = table[~needle].groupby(["layer", "head"]).score.mean().rename("retrieval_null")
        heads = real.join(null, how="outer").reset_index()
        t = stats.t.ppf(0.975, np.maximum(heads["count"].to_numpy(float) - 1, 1))
        half = np.where(heads["count"] > 1, t * heads["std"] / np.sqrt(heads["count"]), math.nan)
        heads = pd.DataFrame({
            "layer": heads.layer.astype("int64"), "head": heads["head"].astype("int64"),
            "retrieval_score": heads["mean"], "retrieval_low": heads["mean"] - half,
            "retrieval_high": heads["mean"] + half, "retrieval_null": heads.retrieval_null,
        })  # fmt: skip
        heads[str(Role.RETRIEVAL)] = heads.retrieval_score > thresholds.retrieval
        return heads

    @classmethod
    def figures(cls, tables: dict[str, pd.DataFrame]) -> list[Figure]:
        """A length × depth map of the score for the best heads."""
        table = tables[cls.name]
        real = table[table.needle]
        if real.empty:
            return []
        best = real.groupby(["layer", "head"]).score.mean().nlargest(SHOWN)
        grids = []
        for layer, head in best.index:
            one = real[(real.layer == layer) & (real["head"] == head)]
            values = one.pivot_table(index="length", columns="depth", values="score")
            values.columns = [f"{d:.0%}" for d in values.columns]
            grids.append(svg.Grid(f"head {layer}-{head}", values, axes=("length", "depth")))
        alt = ("Heatmaps of the retrieval score of the best heads, haystack length (tokens) by "
               "needle depth (0% at the start).")  # fmt: skip
        drawn = svg.heatmaps(grids, vmin=0, vmax=1, anchors=svg.VIRIDIS, label="retrieval score",
                             alt=alt, name="retrieval")  # fmt: skip
        return [Figure("retrieval-map", "Retrieval score by length and depth", alt, drawn)]


def _empty(schema: Schema):
    from analyses import DTYPES

    return pd.DataFrame({c: pd.Series(dtype=DTYPES[t]) for c, t in schema.items()})
