"""Coreference heads (Clark et al. 2019, §4.3): how often the word a head attends to most, from
the head word of a coreferent mention, is the head word of one of the mention's antecedents.

The model reads windows of whole sentences of one document (``probe.inputs.coreference``), not
single sentences. Per layer, only the rows of word-level attention that are scored are computed (one
per scored mention, every head at once), not a window's whole word map. The 95% intervals use the
Poisson bootstrap over documents, with weights keyed to the document: they depend on the data and
the seed only, not on batches or processes. They are widened to at least Wilson's interval and not
drawn on fewer than ``probe.inference.MIN_CLUSTERS`` documents; a head "beats" the baselines only
where its margin over the best of them holds after the Benjamini–Hochberg correction over every head
and mention type (``probe.inference``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from markupsafe import Markup, escape

from analyses import Analysis, Context, Measure, Schema, svg
from analyses.figures import Figure, Plot
from analyses.vocabulary import Role, Thresholds
from probe.inference import FDR, MIN_CLUSTERS, benjamini_hochberg, honest, p_above
from probe.inputs.coreference import BASELINES, MENTION_TYPES, Window, baselines, nearest, scored
from probe.keys import poisson
from probe.lazy import lazy

if TYPE_CHECKING:
    from probe.inputs.corpus import Batch
    from probe.pipeline.runner import LayerCapture

np = lazy("numpy")
pd = lazy("pandas")
torch = lazy("torch")

N_BOOT = 1000  # bootstrap replicates
EXAMPLE_WORDS = 60  # the example window is the first with at most this many words …
EXAMPLE_MENTIONS = 3  # … and at least this many scored mentions (else the first with any)
CHAR_WIDTH, WORD_GAP = 7.3, 9  # pixels, for 12 px monospace text in the example's drawing
ARC_UP, ARC_DOWN = 90, 40  # the highest arc above the words and the deepest below, in pixels


class Coreference(Analysis):
    """Counts, per mention type, the scored mentions each head resolves and the baselines
    resolve, with bootstrap replicates over documents; keeps one example window."""

    name = "coref"
    title = "Coreference"
    captures = ("hook_pattern",)
    unit = "window"
    tables: ClassVar[dict[str, Schema]] = {
        "coref": {
            "mention_type": "str",
            "layer": "int",
            "head": "int",
            "correct": "int",
            "total": "int",
            "accuracy": "float",
            "ci_low": "float",
            "ci_high": "float",
            "documents": "int",
            "margin": "float",
            "margin_p": "float",
            "margin_called": "bool",
        },
        "coref_baselines": {
            "baseline": "str",
            "mention_type": "str",
            "correct": "int",
            "total": "int",
            "accuracy": "float",
        },
        "coref_example": {
            "document": "str",
            "position": "int",
            "word": "str",
            "mention_type": "str",
            "antecedent": "Int64",
            "layer": "int",
            "head": "int",
            "predicted": "Int64",
            "correct": "bool",
        },
    }
    head_columns: ClassVar[Schema] = {"coref_accuracy": "float", "coref_margin": "float"}
    measures = (Measure("coref_accuracy", "antecedent accuracy", "pct", "higher"),)

    def __init__(self, context: Context, *, n_boot: int = N_BOOT) -> None:
        super().__init__(context)
        L, H, K = context.n_layers, context.n_heads, len(MENTION_TYPES)
        self.n_boot = n_boot
        self.correct = torch.zeros(L, K, H, dtype=torch.float64)
        self.total = torch.zeros(K, dtype=torch.float64)
        self.baseline = torch.zeros(len(BASELINES), K, dtype=torch.float64)
        self.boot_correct = torch.zeros(L, n_boot, K * H, dtype=torch.float64)
        self.boot_total = torch.zeros(n_boot, K, dtype=torch.float64)
        self.boot_baseline = torch.zeros(n_boot, len(BASELINES), K, dtype=torch.float64)
        self.documents: list[set[int]] = [set() for _ in range(K)]  # holding scored mentions
        self.example: dict | None = None  # the example window and every head's predictions

    def begin_batch(self, batch: Batch) -> None:
        """The batch's scored mentions: their window, head word, type and gold antecedents,
        what the baselines choose, and the bootstrap weights of their documents."""
        windows: list[Window] = batch.sentences
        window, query, kinds, gold, hits = [], [], [], [], []
        for b, w in enumerate(windows):
            found = scored(w.mentions)
            for mention, antecedents in found:
                heads = {a.head for a in antecedents}
                chosen = baselines(mention, w.mentions)
                window.append(b)
                query.append(mention.head)
                kinds.append(MENTION_TYPES.index(mention.kind))
                gold.append(sorted(heads))
                hits.append([chosen[name].head in heads for name in BASELINES])
            self._consider_example(w, b, found)
        self._mentions = len(window)
        if not self._mentions:
            return
        device = batch.input_ids.device
        M, n = len(window), int(batch.n_words.max())
        self._window = torch.tensor(window, device=device)
        self._query = torch.tensor(query, device=device)
        self._gold = torch.zeros(M, n, dtype=torch.bool, device=device)
        for m, heads in enumerate(gold):
            self._gold[m, heads] = True
        types = torch.zeros(M, len(MENTION_TYPES), dtype=torch.float64)
        types[:, 0] = 1  # "all"
        types[torch.arange(M), torch.tensor(kinds)] = 1
        self._types = types
        self.total += types.sum(0)
        hits = torch.tensor(hits, dtype=torch.float64)  # [M, baseline]
        self.baseline += hits.T @ types
        documents = np.array([w.document_index for w in windows])[window]
        for k in range(len(MENTION_TYPES)):
            self.documents[k].update(documents[types[:, k].numpy() > 0].tolist())
        weights = poisson(
            self.context.seed, "coref-bootstrap", documents[None], np.arange(self.n_boot)[:, None]
        )
        self._weights = torch.from_numpy(weights.astype(np.float64))  # [n_boot, M]
        self.boot_total += self._weights @ types
        self.boot_baseline += torch.einsum("bm,mn,mk->bnk", self._weights, hits, types)
        self._to_words = None  # with what every layer reuses, gathered at the first (``_gather``)

    def _consider_example(self, w: Window, b: int, found: list) -> None:
        if not found:
            return
        small = len(w.words) <= EXAMPLE_WORDS and len(found) >= EXAMPLE_MENTIONS
        key = (not small, w.document_index, w.first_sentence)  # the first small one
        if self.example is None or key < self.example["key"]:
            self.example = {
                "key": key,
                "batch_row": b,
                "document": w.document,
                "words": list(w.words),
                "mentions": [
                    (
                        m.head,
                        m.kind,
                        nearest(antecedents).head,
                        sorted({a.head for a in antecedents}),
                    )
                    for m, antecedents in found
                ],
                "predicted": torch.zeros(self.context.n_layers, self.context.n_heads, len(found)),
            }

    def update(self, batch: Batch, layer: int, capture: LayerCapture) -> None:
        if not self._mentions:
            return
        p = capture.pattern  # [B, H, T, T]
        if self._to_words is None:
            self._gather(capture.alignment)
        # The rows of the mentions' head words only (their tokens averaged), every head at once,
        # then summed over each key word's tokens.
        mention, window, token, weight = self._tokens
        rows = torch.zeros(self._mentions, p.shape[1], p.shape[-1], device=p.device)
        rows.index_add_(0, mention, p[window, :, token, :] * weight[:, None, None])
        attention = torch.bmm(rows, self._to_words)  # [M, H, n]
        predicted = attention.masked_fill(self._invalid[:, None], -torch.inf).max(-1).indices
        hits = self._gold.gather(1, predicted).to(torch.float64).cpu()  # [M, H]
        self.correct[layer] += self._types.T @ hits
        per_type = (self._types[:, :, None] * hits[:, None, :]).flatten(1)  # [M, types·H]
        self.boot_correct[layer] += self._weights @ per_type
        if self.example is not None and self.example.get("batch_row") is not None:
            mine = (self._window == self.example["batch_row"]).cpu()
            self.example["predicted"][layer] = predicted.cpu()[mine].T.float()

    def _gather(self, alignment) -> None:
        """What every layer of the batch reuses: the tokens of each mention's head word with
        their averaging weights, each mention's window's token-to-word sums, and the words no
        prediction may name (itself, padding)."""
        member = alignment.from_words[self._window, self._query]  # [M, T]
        mention, token = member.nonzero(as_tuple=True)
        self._tokens = mention, self._window[mention], token, member[mention, token]
        self._to_words = alignment.to_words[self._window]  # [M, T, n]
        self._invalid = alignment.invalid[self._window, 0, self._query]  # [M, n]

    def end_batch(self, batch: Batch) -> None:
        if self.example is not None:
            self.example["batch_row"] = None  # predictions complete; later batches leave it

    def merge(self, other: Coreference) -> None:
        self._check_mergeable(other)
        for name in ("correct", "total", "baseline", "boot_correct", "boot_total", "boot_baseline"):
            getattr(self, name).add_(getattr(other, name))
        for mine, theirs in zip(self.documents, other.documents, strict=True):
            mine.update(theirs)
        if other.example is not None and (
            self.example is None or other.example["key"] < self.example["key"]
        ):
            self.example = other.example

    def _tables(self) -> dict[str, pd.DataFrame]:
        """``coref`` (one row per mention type and head), ``coref_baselines`` and
        ``coref_example`` (the example window, one row per word, read by the best head)."""
        if not self.total[0]:
            return {name: pd.DataFrame(columns=list(s)) for name, s in self.tables.items()}
        L, H, K = self.context.n_layers, self.context.n_heads, len(MENTION_TYPES)
        correct = self.correct.permute(1, 0, 2).reshape(K, L * H).numpy()  # [type, layer·head]
        boot = self.boot_correct.view(L, self.n_boot, K, H).permute(1, 2, 0, 3)
        boot = boot.reshape(self.n_boot, K, L * H).numpy()
        boot_total = self.boot_total.numpy()
        layer, head = np.divmod(np.arange(L * H), H)
        rows, base_rows = [], []
        for k, kind in enumerate(MENTION_TYPES):
            total = float(self.total[k])
            if not total:
                continue
            drawn = boot_total[:, k] > 0
            accuracy = boot[drawn, k] / boot_total[drawn, k, None]  # [replicates, heads]
            best = int(self.baseline[:, k].argmax())  # the margin is over the best baseline
            baseline = self.boot_baseline[drawn, best, k].numpy() / boot_total[drawn, k]
            low, high = np.percentile(accuracy, [2.5, 97.5], axis=0)
            documents = len(self.documents[k])
            low, high = honest(low, high, correct[k], total, documents)
            rows.append(
                pd.DataFrame(
                    {
                        "mention_type": kind,
                        "layer": layer,
                        "head": head,
                        "correct": correct[k].round().astype(int),
                        "total": int(total),
                        "accuracy": correct[k] / total,
                        "ci_low": low,
                        "ci_high": high,
                        "documents": documents,
                        "margin": (correct[k] - float(self.baseline[best, k])) / total,
                        "margin_p": p_above(accuracy - baseline[:, None]),
                    }
                )
            )
            base_rows += [
                {"baseline": name, "mention_type": kind, "correct": round(float(c)),
                 "total": int(total), "accuracy": float(c) / total}
                for name, c in zip(BASELINES, self.baseline[:, k], strict=True)
            ]  # fmt: skip
        coref = pd.concat(rows, ignore_index=True)
        # every head and mention type with an interval is one family of tests
        tested = coref.margin_p.where(coref.documents >= MIN_CLUSTERS).to_numpy()
        coref["margin_called"] = benjamini_hochberg(tested, FDR)
        return {
            "coref": coref,
            "coref_baselines": pd.DataFrame(base_rows),
            "coref_example": self._example_table(coref),
        }

    def _example_table(self, coref: pd.DataFrame) -> pd.DataFrame:
        best = coref[coref.mention_type == "all"].sort_values("accuracy", ascending=False).iloc[0]
        e = self.example
        predicted = e["predicted"][int(best.layer), int(best["head"])].long().tolist()
        table = pd.DataFrame(
            {
                "document": e["document"],
                "position": range(len(e["words"])),
                "word": e["words"],
                "mention_type": "",
                "antecedent": pd.array([pd.NA] * len(e["words"]), dtype="Int64"),
                "layer": int(best.layer),
                "head": int(best["head"]),
                "predicted": pd.array([pd.NA] * len(e["words"]), dtype="Int64"),
                "correct": False,
            }
        )
        for (query, kind, antecedent, gold), guess in zip(e["mentions"], predicted, strict=True):
            if table.at[query, "mention_type"]:
                continue  # two mentions share a head word: the first is drawn
            table.loc[query, ["mention_type", "antecedent", "predicted"]] = kind, antecedent, guess
            table.at[query, "correct"] = guess in gold
        return table

    @classmethod
    def heads(cls, tables: dict[str, pd.DataFrame], thresholds: Thresholds) -> pd.DataFrame:
        """Each head's accuracy over all scored mentions, its margin over the best baseline, and
        the coreference role where that margin is called (``probe.inference``)."""
        coref = tables["coref"]
        if coref.empty:
            return pd.DataFrame(columns=["layer", "head", *cls.head_columns])
        every = coref[coref.mention_type == "all"]
        base = tables["coref_baselines"]
        best = base[base.mention_type == "all"].accuracy.max()
        return pd.DataFrame(
            {
                "layer": every.layer.to_numpy(),
                "head": every["head"].to_numpy(),
                "coref_accuracy": every.accuracy.to_numpy(),
                "coref_margin": (every.accuracy - best).to_numpy(),
                str(Role.COREFERENCE): (every.margin_called & (every.margin > 0)).to_numpy(),
            }
        )

    plots = (
        Plot("heatmaps", "Antecedent accuracy of every head, per mention type",
             "analyses.paper:coreference_heads", page=lambda tables: heatmaps(tables),
             needs=("coref",), width="page"),
    )  # fmt: skip

    @classmethod
    def section(cls, tables: dict[str, pd.DataFrame], run: dict) -> dict:
        coref, base = tables["coref"], tables["coref_baselines"]
        if coref.empty:
            return {"best": [], "windows": run.get("coref", {})}
        accuracy = base.pivot(index="mention_type", columns="baseline", values="accuracy")
        best = []
        for kind in MENTION_TYPES:
            rows = coref[coref.mention_type == kind]
            if rows.empty:
                continue
            top = rows.loc[rows.accuracy.idxmax()]
            baseline = accuracy.loc[kind]
            best.append(
                {
                    **top.to_dict(),
                    "baselines": {name: baseline[name] for name in BASELINES},
                    "beats": bool(top.margin_called and top.margin > 0),
                }
            )
        return {
            "best": best,
            "baselines": BASELINES,
            "example": arcs(tables["coref_example"]),
            "windows": run.get("coref", {}),
            "fdr": FDR,
            "min_clusters": MIN_CLUSTERS,
        }


def heatmaps(tables: dict[str, pd.DataFrame]) -> Figure | None:
    """Layer x head heatmaps of antecedent accuracy, one per mention type, as inline SVG."""
    coref = tables["coref"]
    kinds = [k for k in MENTION_TYPES if k in set(coref.mention_type)]
    if not kinds:
        return None
    grids = []
    for kind in kinds:
        rows = coref[coref.mention_type == kind]
        top = rows.loc[rows.accuracy.idxmax()]
        grid = rows.pivot(index="layer", columns="head", values="accuracy")
        grids.append(svg.Grid(f"{kind} (n={top.total}): best {top.accuracy:.0%}", grid))
    alt = (
        "Heatmaps of layer by head, one per mention type, brighter where the word the "
        "head attends to most from a mention is more often one of its antecedents."
    )
    drawing = svg.heatmaps(grids, vmin=0, vmax=1, anchors=svg.MAGMA, label="accuracy",
                           alt=alt, name="coref-heatmaps", columns=len(kinds))  # fmt: skip
    title = "Antecedent accuracy of every head, per mention type"
    return Figure("coref-heatmaps", title, alt, drawing)


def arcs(example: pd.DataFrame) -> Markup | None:
    """The example window as one line of words, with an arc above from each scored mention to
    the word the head attends to most (green when it is an antecedent, red when not) and a
    dashed arc below to its nearest gold antecedent."""
    if example.empty:
        return None
    x, centres = 8, []
    for word in example.word:
        width = CHAR_WIDTH * len(word)
        centres.append(x + width / 2)
        x += width + WORD_GAP
    width, base, height = int(x + 8), ARC_UP + 20, ARC_UP + ARC_DOWN + 36
    parts = [
        f'<svg class="coref" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        'style="max-width:none" font-family="ui-monospace, monospace" font-size="12" '
        'role="img" aria-label="a window of text with an arc from each mention to the word the '
        'head attends to most, and to its nearest antecedent">'
    ]

    def arc(a: int, b: int, up: bool, style: str) -> str:
        """A quadratic curve whose peak rises with the distance it spans, up to the margin."""
        x1, x2 = centres[a], centres[b]
        y = base - 14 if up else base + 6
        lift = min(ARC_UP if up else ARC_DOWN, 10 + 0.15 * abs(x2 - x1))
        control = y - 2 * lift if up else y + 2 * lift  # a quadratic peaks halfway to it
        return (
            f'<path d="M{x1:.1f},{y} Q{(x1 + x2) / 2:.1f},{control:.1f} {x2:.1f},{y}" '
            f'fill="none" {style}/>'
        )

    for row in example.itertuples():
        if row.mention_type:
            colour = "#2e8b57" if row.correct else "#c0392b"
            guess = f'stroke="{colour}" stroke-width="1.8"'
            parts.append(arc(row.position, int(row.predicted), True, guess))
            parts.append(arc(row.position, int(row.antecedent), False,
                             'stroke="#888" stroke-dasharray="3 2"'))  # fmt: skip
            # the arc's start: a dot on the mention, so that the direction can be read
            parts.append(f'<circle cx="{centres[row.position]:.1f}" cy="{base - 14}" r="2.5" '
                         f'fill="{colour}"/>')  # fmt: skip
    for row, centre in zip(example.itertuples(), centres, strict=True):
        weight = ' font-weight="bold"' if row.mention_type else ""
        parts.append(
            f'<text x="{centre:.1f}" y="{base}" text-anchor="middle"{weight}>'
            f"{escape(row.word)}</text>"
        )
    parts.append("</svg>")
    return Markup("".join(parts))
