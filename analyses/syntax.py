"""Syntax analysis (Clark et al. 2019): how often each head's attention points from a word to
its syntactic head, or from the head to its dependent, per UD relation.

Streaming: per batch and layer, word-level attention for every head at once, then counts per
relation. The 95% intervals use the Poisson bootstrap over sentences: each sentence gets a
Poisson(1) weight in each of ``n_boot`` replicates, so the replicates are sums too and memory
does not grow with the corpus.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, NamedTuple

from analyses import Analysis, Context, Measure, Schema, svg
from analyses.figures import Figure, Plot
from analyses.vocabulary import Direction, Role, Thresholds
from probe.keys import poisson
from probe.lazy import lazy
from probe.treebank import RELATIONS

if TYPE_CHECKING:
    from probe.corpus import Batch
    from probe.runner import LayerCapture

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
            "correct": "int", "total": "int", "accuracy": "float", "ci_low": "float",
            "ci_high": "float",
        },
        "syntax_baselines": {
            "relation": "str", "offset": "int", "correct": "int", "total": "int",
            "accuracy": "float",
        },
        "syntax_best": {
            "relation": "str", "total": "int", "direction": "str", "layer": "int", "head": "int",
            "accuracy": "float", "ci_low": "float", "ci_high": "float",
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
        for name in ("correct", "total", "baseline", "boot_correct", "boot_total", "boot_baseline"):
            getattr(self, name).add_(getattr(other, name))
        self.sentences += other.sentences

    def _counts(self):
        """Counts with heads flat (``[..., layer·head]``) and an extra relation 'all' (every
        word but the root) appended."""
        L, H, R, B = self.context.n_layers, self.context.n_heads, len(RELATIONS), self.n_boot
        correct = self.correct.permute(1, 2, 0, 3).reshape(R, 2, L * H)
        boot_correct = self.boot_correct.view(L, B, R, 2, H).permute(1, 2, 3, 0, 4)
        boot_correct = boot_correct.reshape(B, R, 2, L * H)
        boot_baseline = self.boot_baseline.view(B, R, len(OFFSETS))
        cat = lambda x, dim: torch.cat([x, x.sum(dim, keepdim=True)], dim)  # noqa: E731
        return (
            [*RELATIONS, "all"],
            cat(correct, 0),
            cat(self.total, 0),
            cat(self.baseline, 0),
            cat(boot_correct, 1),
            cat(self.boot_total, 1),
            cat(boot_baseline, 1),
        )

    def _tables(self) -> dict[str, pd.DataFrame]:
        """``syntax``, ``syntax_baselines`` and ``syntax_best`` (0-based layer and head)."""
        names, correct, total, baseline, b_correct, b_total, b_baseline = self._counts()
        present = [r for r in range(len(names)) if total[r] > 0 and names[r] != "root"]
        if not present:  # no word with a head: a corpus of one-word sentences
            return {
                name: pd.DataFrame(columns=list(schema)) for name, schema in self.tables.items()
            }
        H = self.context.n_heads
        rows, base_rows, best_rows = [], [], []
        for r in present:
            # A replicate that drew no word of r has no accuracy for it: it is left out.
            drawn = b_total[:, r] > 0
            counts = _RelationCounts(
                names[r], correct[r], total[r], baseline[r],
                b_correct[drawn, r], b_baseline[drawn, r], b_total[drawn, r],
            )  # fmt: skip
            intervals = counts.head_intervals()
            rows += counts.head_rows(intervals, H)
            base_rows.append(counts.baseline_rows())
            best_rows.append(counts.best_head(intervals, H))
        best = pd.DataFrame(best_rows).sort_values("total", ascending=False, kind="stable")
        return {
            "syntax": pd.concat(rows, ignore_index=True),
            "syntax_baselines": pd.concat(base_rows, ignore_index=True),
            "syntax_best": best.reset_index(drop=True),
        }

    @classmethod
    def heads(cls, tables: dict[str, pd.DataFrame], thresholds: Thresholds) -> pd.DataFrame:
        """Each head's best relation (either direction), its margin over that relation's best
        offset baseline, and the syntactic role where the margin is large enough."""
        best = best_relation_per_head(tables["syntax"], tables["syntax_baselines"], thresholds)
        # A head has a best relation only where it beats that relation's offset baseline.
        best = best[best.best_relation_margin > 0].reset_index(drop=True)
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
            f"[{row.ci_low:.1%}, {row.ci_high:.1%}], offset baseline "
            f"{row.baseline_accuracy:.1%} ({row.baseline_offset:+d})"
            for row in best[best.relation.isin(shown)].itertuples()
        ]

    @classmethod
    def section(cls, tables: dict[str, pd.DataFrame], run: dict) -> dict:
        """The best head per relation: frequent relations first, rare ones apart (their
        accuracies rest on too few words to compare)."""
        best = tables["syntax_best"]
        frequent = best.total >= Thresholds(**run.get("thresholds", {})).relation_min_words
        return {"best": best[frequent], "rare": best[~frequent]}


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

    def head_intervals(self) -> np.ndarray:
        """95% percentile intervals of every head's accuracy over the replicates.

        Returns
        -------
        ``[direction, 2 (low, high), layer·head]``, in ``Direction.index`` order
        """
        return np.stack(
            [
                np.percentile(
                    (self.boot_correct[:, direction.index] / self.boot_total[:, None]).numpy(),
                    [2.5, 97.5],
                    axis=0,
                )
                for direction in Direction
            ]
        )

    def head_rows(self, intervals: np.ndarray, n_heads: int) -> list[pd.DataFrame]:
        """The ``syntax`` rows: one frame per direction, one row per head.

        Parameters
        ----------
        intervals : ``[direction, 2 (low, high), layer·head]``, from ``head_intervals``
        n_heads : heads per layer, to unflatten ``layer·head``
        """
        layer, head = np.divmod(np.arange(self.correct.shape[-1]), n_heads)
        frames = []
        for direction in Direction:
            c = self.correct[direction.index].numpy()
            low, high = intervals[direction.index]
            frames.append(
                pd.DataFrame(
                    {
                        "relation": self.name,
                        "direction": str(direction),
                        "layer": layer,
                        "head": head,
                        "correct": c.astype(int),
                        "total": int(self.total),
                        "accuracy": c / float(self.total),
                        "ci_low": low,
                        "ci_high": high,
                    }
                )
            )
        return frames

    def baseline_rows(self) -> pd.DataFrame:
        """The ``syntax_baselines`` rows: one per fixed offset."""
        base = self.baseline.numpy()
        return pd.DataFrame(
            {
                "relation": self.name,
                "offset": OFFSETS,
                "correct": base.astype(int),
                "total": int(self.total),
                "accuracy": base / float(self.total),
            }
        )

    def best_head(self, intervals: np.ndarray, n_heads: int) -> dict:
        """The ``syntax_best`` row: the best head (either direction) against the best offset.

        The head beats the baseline when the 2.5th percentile of their difference, taken
        replicate by replicate (the two are measured on the same words), is above 0.

        Parameters
        ----------
        intervals : ``[direction, 2 (low, high), layer·head]``, from ``head_intervals``
        n_heads : heads per layer, to unflatten ``layer·head``
        """
        d, h = np.unravel_index(int(self.correct.argmax()), self.correct.shape)
        o = int(self.baseline.argmax())
        head_boot = (self.boot_correct[:, d, h] / self.boot_total).numpy()
        difference = head_boot - (self.boot_baseline[:, o] / self.boot_total).numpy()
        return {
            "relation": self.name,
            "total": int(self.total),
            "direction": str(list(Direction)[d]),
            "layer": int(h // n_heads),
            "head": int(h % n_heads),
            "accuracy": float(self.correct[d, h] / self.total),
            "ci_low": float(intervals[d][0, h]),
            "ci_high": float(intervals[d][1, h]),
            "baseline_offset": OFFSETS[o],
            "baseline_accuracy": float(self.baseline[o] / self.total),
            "beats_baseline": bool(np.percentile(difference, 2.5) > 0),
        }


def best_relation_per_head(
    syntax: pd.DataFrame, baselines: pd.DataFrame, thresholds: Thresholds = Thresholds()
) -> pd.DataFrame:
    """Each head's best relation (either direction) and its margin over that relation's best
    offset baseline, among relations frequent enough for the margin to mean something
    (``thresholds.relation_min_words`` and ``relation_min_share`` of all scored words)."""
    words = syntax.loc[syntax.relation == "all", "total"].max()
    min_total = max(thresholds.relation_min_words, thresholds.relation_min_share * words)
    rows = syntax[(syntax.relation != "all") & (syntax.total >= min_total)]
    if rows.empty:
        return pd.DataFrame(columns=["layer", "head", *BEST_RELATION])
    baseline = baselines.groupby("relation").accuracy.max().rename("baseline")
    rows = rows.join(baseline, on="relation")
    rows = rows.assign(margin=rows.accuracy - rows.baseline)
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
    alt = ("Heatmaps of layer by head, one per dependency relation, red where the head's "
           "most-attended word is the syntactic head or dependent more often than the best "
           "fixed offset finds it, blue where less often; a star marks the best head.")  # fmt: skip
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
