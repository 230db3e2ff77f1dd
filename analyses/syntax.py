"""Syntax analysis (Clark et al. 2019): how often each head's attention points from a word to
its syntactic head, or from the head to its dependent, per UD relation.

Streaming: per batch and layer, word-level attention for every head at once, then counts per
relation. The 95% intervals use the Poisson bootstrap over sentences: each sentence gets a
Poisson(1) weight in each of ``n_boot`` replicates, so the replicates are sums too and memory
does not grow with the corpus. They are widened to at least Wilson's interval, and not drawn on
fewer than ``probe.inference.MIN_CLUSTERS`` sentences (``probe.inference.honest``).

A head's margin over a relation's best offset baseline is tested on the same replicates (paired),
and the margins of every head, direction and relation scored are screened together with the
Benjamini–Hochberg procedure (``probe.inference``): a best relation is named only where its
margin is called and at least ``probe.inference.MIN_EFFECT``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar, NamedTuple

from analyses import Analysis, Context, Measure, Schema, svg
from analyses.figures import Figure, Plot
from analyses.vocabulary import Direction, Role, Thresholds
from probe.inference import FDR, MIN_CLUSTERS, MIN_EFFECT, benjamini_hochberg, honest, p_above
from probe.inputs.treebank import RELATIONS
from probe.keys import poisson
from probe.lazy import lazy

if TYPE_CHECKING:
    from probe.inputs.corpus import Batch
    from probe.pipeline.runner import LayerCapture

np = lazy("numpy")
pd = lazy("pandas")
torch = lazy("torch")
F = lazy("torch.nn.functional")

OFFSETS = tuple(range(-5, 6))
N_BOOT = 1000  # bootstrap replicates
MAIN_RELATIONS = (
    "nsubj",
    "obj",
    "det",
    "amod",
    "case",
    "advmod",
    "aux",
    "mark",
    "nmod",
    "obl",
    "compound",
    "conj",
)
BEST_RELATION = {
    "best_relation": "str",
    "best_relation_direction": "str",
    "best_relation_accuracy": "float",
    "best_relation_margin": "float",
}


class Syntax(Analysis):
    """Accumulates, per relation, correct predictions of every (direction, layer, head) and of
    every fixed offset baseline, with Poisson-bootstrap replicates of both."""

    name = "syntax"
    title = "Syntax"
    captures = ("hook_pattern",)
    tables: ClassVar[dict[str, Schema]] = {
        "syntax": {
            "relation": "str", "direction": "str", "layer": "int", "head": "int",
            "correct": "int", "total": "int", "sentences": "int", "accuracy": "float",
            "ci_low": "float", "ci_high": "float", "margin": "float", "margin_p": "float",
            "margin_called": "bool",
        },
        "syntax_baselines": {
            "relation": "str", "offset": "int", "correct": "int", "total": "int",
            "accuracy": "float",
        },
        "syntax_best": {
            "relation": "str", "total": "int", "sentences": "int", "direction": "str",
            "layer": "int", "head": "int", "accuracy": "float", "ci_low": "float",
            "ci_high": "float",
            "baseline_offset": "int", "baseline_accuracy": "float", "beats_baseline": "bool",
        },
    }  # fmt: skip
    head_columns: ClassVar[Schema] = BEST_RELATION
    measures = (
        Measure("best_relation", "best relation", "text", role=Role.SYNTACTIC),
        Measure("best_relation_accuracy", "best relation's accuracy", "pct", "higher",
                role=Role.SYNTACTIC),
    )  # fmt: skip

    def __init__(self, context: Context, *, n_boot: int = N_BOOT) -> None:
        super().__init__(context)
        self.n_boot = n_boot
        L, H, R, O = context.n_layers, context.n_heads, len(RELATIONS), len(OFFSETS)
        # Per layer first, so that each layer's update adds to one contiguous block.
        self.correct = torch.zeros(L, R, 2, H, dtype=torch.float64)
        self.total = torch.zeros(R, dtype=torch.float64)
        self.baseline = torch.zeros(R, O, dtype=torch.float64)
        self.boot_correct = torch.zeros(L, n_boot, R * 2 * H)
        self.boot_total = torch.zeros(n_boot, R)
        self.boot_baseline = torch.zeros(n_boot, R * O)
        # sentences holding a word of each relation, and (last) any scored word: the clusters
        self.sentences_with = torch.zeros(R + 1, dtype=torch.float64)
        self.sentences = 0

    def begin_batch(self, batch: Batch) -> None:
        B = len(batch)
        n = int(batch.n_words.max())
        gold = batch.heads[:, :n]
        scored = gold >= 0  # the root and padding have no head to predict
        relation = F.one_hot(batch.relations[:, :n].clamp(min=0), len(RELATIONS)).float()
        self._relation = relation * scored[..., None]  # [B, n, R]
        position = torch.arange(n, device=gold.device)
        offsets = torch.tensor(OFFSETS, device=gold.device)
        offset_hits = (gold[:, :, None] == position[None, :, None] + offsets).float()
        baseline = torch.einsum("bno,bnr->bro", offset_hits, self._relation).cpu()
        totals = self._relation.sum(1).cpu()
        # Each sentence's weight in each replicate is drawn by its index in the treebank: the
        # same replicates whatever the batches or the number of processes.
        index, replicate = batch.index.cpu().numpy()[None], np.arange(self.n_boot)[:, None]
        weights = poisson(self.context.seed, "syntax-bootstrap", index, replicate)
        self._weights = torch.from_numpy(weights).float()  # [n_boot, B]
        self.total += totals.sum(0).double()
        held = torch.cat([totals > 0, (totals.sum(1, keepdim=True) > 0)], 1)
        self.sentences_with += held.sum(0).double()
        self.baseline += baseline.sum(0).double()
        self.boot_total.addmm_(self._weights, totals)
        self.boot_baseline.addmm_(self._weights, baseline.reshape(B, -1))
        self.sentences += B

    def update(self, batch: Batch, layer: int, capture: LayerCapture) -> None:
        n = self._relation.shape[1]
        hits = (capture.predictions == batch.heads[:, None, None, :n]).float()  # [B, 2, H, n]
        correct = torch.einsum("bdhn,bnr->brdh", hits, self._relation).cpu()  # per sentence
        self.correct[layer] += correct.sum(0).double()
        self.boot_correct[layer].addmm_(self._weights, correct.reshape(len(batch), -1))

    def merge(self, other: Syntax) -> None:
        self._check_mergeable(other)
        for name in ("correct", "total", "baseline", "boot_correct", "boot_total", "boot_baseline",
                     "sentences_with"):  # fmt: skip
            getattr(self, name).add_(getattr(other, name))
        self.sentences += other.sentences

    def _counts(self):
        """Counts with heads flat (``[..., layer·head]``) and an extra relation 'all' (every
        word but the root) appended; the replicates' correct counts are read one relation at a
        time (``_boot_correct``)."""
        L, H, R, B = self.context.n_layers, self.context.n_heads, len(RELATIONS), self.n_boot
        correct = self.correct.permute(1, 2, 0, 3).reshape(R, 2, L * H)
        boot_baseline = self.boot_baseline.view(B, R, len(OFFSETS))
        cat = lambda x, dim: torch.cat([x, x.sum(dim, keepdim=True)], dim)  # noqa: E731
        return (
            [*RELATIONS, "all"],
            cat(correct, 0),
            cat(self.total, 0),
            cat(self.baseline, 0),
            cat(self.boot_total, 1),
            cat(boot_baseline, 1),
            self.sentences_with,
        )

    def _boot_correct(self, r: int) -> torch.Tensor:
        """Relation ``r``'s correct counts per replicate, ``[replicate, direction, layer·head]``
        (``r = len(RELATIONS)``: every relation's sum), from the per-layer store. One relation at
        a time: the whole store laid out by relation would be two more copies of n_boot ×
        relations × 2 × layers × heads floats, and make the run's peak grow with depth."""
        L, H, R, B = self.context.n_layers, self.context.n_heads, len(RELATIONS), self.n_boot
        per_layer = self.boot_correct.view(L, B, R, 2, H)
        # Sums of whole replicate weights times 0/1: integers, exact in any order.
        part = per_layer.sum(2) if r == R else per_layer[:, :, r]
        return part.permute(1, 2, 0, 3).reshape(B, 2, L * H)

    def _tables(self) -> dict[str, pd.DataFrame]:
        """``syntax``, ``syntax_baselines`` and ``syntax_best`` (0-based layer and head)."""
        names, correct, total, baseline, b_total, b_baseline, held = self._counts()
        present = [r for r in range(len(names)) if total[r] > 0 and names[r] != "root"]
        if not present:  # no word with a head: a corpus of one-word sentences
            return {
                name: pd.DataFrame(columns=list(schema)) for name, schema in self.tables.items()
            }
        H = self.context.n_heads
        rows, base_rows, best = [], [], []
        for r in present:
            # A replicate that drew no word of r has no accuracy for it: it is left out.
            drawn = b_total[:, r] > 0
            counts = _RelationCounts(
                names[r], correct[r], total[r], baseline[r], self._boot_correct(r)[drawn],
                b_baseline[drawn, r], b_total[drawn, r], int(held[r]),
            )  # fmt: skip
            rows.append(counts.head_rows(H))
            base_rows.append(counts.baseline_rows())
            best.append(counts.best_head(H))
        # One frame of every relation's columns: a frame per relation and direction, then
        # concatenated, took a third of the run's time in this function.
        syntax = call_margins(_frame(rows), self.context.thresholds)
        keys = ["relation", "direction", "layer", "head"]
        best = pd.DataFrame(best).merge(syntax[[*keys, "ci_low", "ci_high", "margin_called"]],
                                        on=keys)  # fmt: skip
        beats = best.pop("margin_called") & (best.accuracy > best.baseline_accuracy)
        best["beats_baseline"] = beats
        best = best.sort_values("total", ascending=False, kind="stable")
        return {
            "syntax": syntax,
            "syntax_baselines": _frame(base_rows),
            "syntax_best": best.reset_index(drop=True),
        }

    @classmethod
    def heads(cls, tables: dict[str, pd.DataFrame], thresholds: Thresholds) -> pd.DataFrame:
        """Each head's best relation (either direction) where one holds after the correction
        for the margins tried, its margin over that relation's best offset baseline, and the
        syntactic role where the margin is large enough."""
        best = best_relation_per_head(tables["syntax"]).reset_index(drop=True)
        best[str(Role.SYNTACTIC)] = best.best_relation_margin >= thresholds.syntactic
        return best

    plots = (
        Plot("best-heads", "The best head of each relation against its best fixed offset",
             "analyses.paper:best_heads", needs=("syntax_best",)),
        Plot("heatmaps", "Every head's accuracy per relation above the relation's baseline",
             "analyses.paper:relation_heads", page=lambda tables: heatmaps(tables),
             needs=("syntax", "syntax_best", "syntax_baselines"), width="page"),
    )  # fmt: skip

    @classmethod
    def summary(cls, tables: dict[str, pd.DataFrame]) -> list[str]:
        """The best head of the most frequent relations, with its interval and baseline."""
        best = tables["syntax_best"]
        shown = ["nsubj", "obj", "det", "amod", "case", "advmod", "aux", "mark", "all"]
        return [
            f"{row.relation} ({row.total} words): head {row.layer}-{row.head} "
            f"{Direction(row.direction).label} {row.accuracy:.1%} "
            + (
                f"[{row.ci_low:.1%}, {row.ci_high:.1%}]"
                if row.ci_low == row.ci_low
                else "(too few sentences for an interval)"
            )
            + ", offset baseline "
            f"{row.baseline_accuracy:.1%} ({row.baseline_offset:+d})"
            for row in best[best.relation.isin(shown)].itertuples()
        ]

    @classmethod
    def section(cls, tables: dict[str, pd.DataFrame], run: dict) -> dict:
        """The best head per relation: relations scored first, the others apart ("too few":
        too few words or sentences to compare, never ranked)."""
        best = tables["syntax_best"]
        thresholds = Thresholds(**run.get("thresholds", {}))
        scored = best.relation.isin(scored_relations(tables["syntax"], thresholds))
        scored &= best.sentences >= MIN_CLUSTERS
        rare = best[~scored & (best.relation != "all")].copy()
        few_words = ~rare.relation.isin(scored_relations(tables["syntax"], thresholds))
        rare["reason"] = np.where(few_words, "words", "sentences")  # the rule each one misses
        return {"best": best[scored | (best.relation == "all")], "rare": rare,
                "min_words": min_words(tables["syntax"], thresholds),
                "words": int(_all_words(tables["syntax"])),
                "fdr": FDR, "min_effect": MIN_EFFECT, "min_clusters": MIN_CLUSTERS}  # fmt: skip


class _RelationCounts(NamedTuple):
    """One relation's counts (``Syntax._counts``), with only the bootstrap replicates that drew
    at least one of its words; heads are flat (``layer·head``)."""

    name: str
    correct: torch.Tensor  # [direction, layer·head] float64: each head's correct predictions
    total: torch.Tensor  # [] float64: the relation's words
    baseline: torch.Tensor  # [offset] float64: each fixed offset's correct predictions
    boot_correct: torch.Tensor  # [drawn, direction, layer·head]: ``correct`` per replicate
    boot_baseline: torch.Tensor  # [drawn, offset]: ``baseline`` per replicate
    boot_total: torch.Tensor  # [drawn]: ``total`` per replicate
    sentences: int  # sentences holding a word of the relation

    def head_rows(self, n_heads: int) -> dict[str, np.ndarray]:
        """The ``syntax`` rows' columns: one row per direction and head, each with its
        accuracy's 95% interval (the replicates' percentiles, made honest at small n) and its
        margin over the best offset with the one-sided p-value of that margin (paired
        replicates: the two are measured on the same words).

        Parameters
        ----------
        n_heads : heads per layer, to unflatten ``layer·head``
        """
        layer, head = np.divmod(np.arange(self.correct.shape[-1]), n_heads)
        o, total = int(self.baseline.argmax()), float(self.total)
        accuracy = (self.boot_correct / self.boot_total[:, None, None]).numpy()  # [drawn, 2, h]
        offset = (self.boot_baseline[:, o] / self.boot_total).numpy()
        directions = []
        for direction in Direction:
            c = self.correct[direction.index].numpy()
            replicates = accuracy[:, direction.index]
            low, high = np.percentile(replicates, [2.5, 97.5], axis=0) if len(replicates) else (
                np.full(len(c), np.nan), np.full(len(c), np.nan))  # fmt: skip
            low, high = honest(low, high, c, total, self.sentences)
            p = p_above(replicates - offset[:, None]) if len(replicates) > 1 else np.ones(len(c))
            directions.append(
                {
                    "relation": np.full(len(c), self.name, dtype=object),
                    "direction": np.full(len(c), str(direction), dtype=object),
                    "layer": layer,
                    "head": head,
                    "correct": c.astype(int),
                    "total": np.full(len(c), int(total)),
                    "sentences": np.full(len(c), self.sentences),
                    "accuracy": c / total,
                    "ci_low": low,
                    "ci_high": high,
                    "margin": (c - float(self.baseline[o])) / total,
                    "margin_p": p,
                }
            )
        return _columns(directions)

    def baseline_rows(self) -> dict[str, np.ndarray]:
        """The ``syntax_baselines`` rows' columns: one row per fixed offset."""
        base = self.baseline.numpy()
        return {
            "relation": np.full(len(OFFSETS), self.name, dtype=object),
            "offset": np.array(OFFSETS),
            "correct": base.astype(int),
            "total": np.full(len(OFFSETS), int(self.total)),
            "accuracy": base / float(self.total),
        }

    def best_head(self, n_heads: int) -> dict:
        """The ``syntax_best`` row, less its interval and call (from the ``syntax`` rows): the
        best head (either direction) against the best offset.

        Parameters
        ----------
        n_heads : heads per layer, to unflatten ``layer·head``
        """
        d, h = np.unravel_index(int(self.correct.argmax()), self.correct.shape)
        o = int(self.baseline.argmax())
        return {
            "relation": self.name,
            "total": int(self.total),
            "sentences": self.sentences,
            "direction": str(list(Direction)[d]),
            "layer": int(h // n_heads),
            "head": int(h % n_heads),
            "accuracy": float(self.correct[d, h] / self.total),
            "baseline_offset": OFFSETS[o],
            "baseline_accuracy": float(self.baseline[o] / self.total),
        }


def _columns(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The columns of ``parts`` (tables as columns, all with the same names), one after another."""
    return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}


def _frame(parts: list[dict[str, np.ndarray]]) -> pd.DataFrame:
    """One frame of the rows of ``parts``, in order."""
    return pd.DataFrame(_columns(parts))


def call_margins(syntax: pd.DataFrame, thresholds: Thresholds) -> pd.DataFrame:
    """``syntax`` with ``margin_called``: the margins that hold after the Benjamini–Hochberg
    procedure at ``probe.inference.FDR``, over every head, direction and relation scored, the
    relations being those with enough words (``scored_relations``) and sentences for an
    interval."""
    scored = syntax.relation.isin(scored_relations(syntax, thresholds)) & (
        syntax.sentences >= MIN_CLUSTERS
    )
    p = syntax.margin_p.where(scored)
    return syntax.assign(margin_called=benjamini_hochberg(p.to_numpy(), FDR))


def scored_relations(syntax: pd.DataFrame, thresholds: Thresholds) -> set[str]:
    """Relations frequent enough for a margin to mean something: ``thresholds.
    relation_min_words`` words, and ``relation_min_share`` of all scored words."""
    frequent = syntax[(syntax.relation != "all") & (syntax.total >= min_words(syntax, thresholds))]
    return set(frequent.relation)


def min_words(syntax: pd.DataFrame, thresholds: Thresholds) -> int:
    """The fewest words a relation is scored on: ``relation_min_words``, or
    ``relation_min_share`` of all scored words where that is more."""
    share = math.ceil(thresholds.relation_min_share * _all_words(syntax))
    return max(thresholds.relation_min_words, share)


def _all_words(syntax: pd.DataFrame) -> float:
    """The words scored over every relation (0 for an empty table)."""
    words = syntax.loc[syntax.relation == "all", "total"].max()
    return 0.0 if pd.isna(words) else float(words)


def best_relation_per_head(syntax: pd.DataFrame) -> pd.DataFrame:
    """Each head's best relation (either direction): of the margins over a relation's best
    offset baseline that are called (``call_margins``) and at least ``MIN_EFFECT``, the largest.
    A head with none has no best relation (it is left out)."""
    rows = syntax[syntax.margin_called & (syntax.margin >= MIN_EFFECT)]
    if rows.empty:
        return pd.DataFrame(columns=["layer", "head", *BEST_RELATION])
    best = rows.loc[rows.groupby(["layer", "head"]).margin.idxmax()]
    return pd.DataFrame(
        {
            "layer": best.layer.to_numpy(),
            "head": best["head"].to_numpy(),
            "best_relation": best.relation.to_numpy(),
            "best_relation_direction": best.direction.to_numpy(),
            "best_relation_accuracy": best.accuracy.to_numpy(),
            "best_relation_margin": best.margin.to_numpy(),
        }
    )


def heatmaps(tables: dict[str, pd.DataFrame]) -> Figure | None:
    """For each main relation present, a layer x head heatmap of each head's accuracy (better
    direction) minus the relation's best offset baseline, with the best head marked."""
    syntax, best = tables["syntax"], tables["syntax_best"]
    relations = [r for r in (*MAIN_RELATIONS, "all") if r in set(best.relation)]
    if not relations:
        return None
    best_direction = (
        syntax[syntax.relation.isin(relations)]
        .groupby(["relation", "layer", "head"])
        .accuracy.max()
    )
    baseline = tables["syntax_baselines"].groupby("relation").accuracy.max()
    margins = {r: best_direction.loc[r].unstack("head") - baseline[r] for r in relations}
    limit = max(0.1, max(float(np.abs(m.to_numpy()).max()) for m in margins.values()))
    grids = []
    for relation in relations:
        row = best[best.relation == relation].iloc[0]
        title = (f"{relation} (n={row.total}): best {row.accuracy:.0%}, "
                 f"offset {row.baseline_accuracy:.0%}")  # fmt: skip
        grids.append(svg.Grid(title, margins[relation], star=(row.layer, row["head"])))
    alt = ("Heatmaps of layer by head, one per dependency relation, red where the head finds "
           "dependents' syntactic heads (read either way) more often than the best fixed "
           "offset, blue where less often; a star marks the best head.")  # fmt: skip
    drawing = svg.heatmaps(grids, vmin=-limit, vmax=limit, anchors=svg.BLUE_RED,
                           label="accuracy − best offset baseline", alt=alt,
                           name="syntax-heatmaps")  # fmt: skip
    return Figure(
        "syntax-heatmaps",
        "Accuracy of every head per relation (better of the two directions) above the "
        "relation's best fixed-offset baseline; ★ the best head",
        alt,
        drawing,
    )
