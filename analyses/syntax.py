"""Syntax analysis (Clark et al. 2019): how often each head's attention points from a word to
its syntactic head, or from the head to its dependent, per UD relation.

Streaming: per batch, word-level attention for every layer and head at once, then counts per
relation. The 95% intervals use the Poisson bootstrap over sentences: each sentence gets a
Poisson(1) weight in each of ``n_boot`` replicates, so the replicates are sums too and memory
does not grow with the corpus.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from matplotlib.figure import Figure as MplFigure

from analyses import Figure, heatmap
from probe.alignment import Attention
from probe.corpus import Batch
from probe.treebank import RELATIONS

name = "syntax"
DIRECTIONS = ("dependent_to_head", "head_to_dependent")
OFFSETS = tuple(range(-5, 6))
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


class SyntaxAnalysis:
    """Accumulates, per relation, correct predictions of every (direction, layer, head) and of
    every fixed offset baseline, with Poisson-bootstrap replicates of both."""

    name = name

    def __init__(self, n_layers: int, n_heads: int, *, seed: int = 0, n_boot: int = 1000):
        self.n_layers, self.n_heads, self.n_boot = n_layers, n_heads, n_boot
        R, LH, O = len(RELATIONS), n_layers * n_heads, len(OFFSETS)
        self.correct = torch.zeros(R, 2, LH, dtype=torch.float64)
        self.total = torch.zeros(R, dtype=torch.float64)
        self.baseline = torch.zeros(R, O, dtype=torch.float64)
        self.boot_correct = torch.zeros(n_boot, R, 2, LH)
        self.boot_total = torch.zeros(n_boot, R)
        self.boot_baseline = torch.zeros(n_boot, R, O)
        self.generator = torch.Generator().manual_seed(seed)
        self.sentences = 0

    def update(self, batch: Batch, attention: Attention) -> None:
        B = len(batch.n_words)
        n = int(batch.n_words.max())
        predicted = attention.predictions  # [B, 2, LH, n]
        gold = batch.heads[:, :n]
        scored = gold >= 0  # the root and padding have no head to predict
        relation = F.one_hot(batch.relations[:, :n].clamp(min=0), len(RELATIONS)).float()
        relation = relation * scored[..., None]  # [B, n, R]

        hits = (predicted == gold[:, None, None, :]).float()
        correct = torch.einsum("bdhn,bnr->brdh", hits, relation)  # per sentence
        totals = relation.sum(1)
        position = torch.arange(n, device=gold.device)
        offsets = torch.tensor(OFFSETS, device=gold.device)
        offset_hits = (gold[:, :, None] == position[None, :, None] + offsets).float()
        baseline = torch.einsum("bno,bnr->bro", offset_hits, relation)

        correct, totals, baseline = correct.cpu(), totals.cpu(), baseline.cpu()
        self.correct += correct.sum(0).double()
        self.total += totals.sum(0).double()
        self.baseline += baseline.sum(0).double()
        weights = torch.poisson(torch.ones(self.n_boot, B), generator=self.generator)
        self.boot_correct.view(self.n_boot, -1).addmm_(weights, correct.reshape(B, -1))
        self.boot_total.addmm_(weights, totals)
        self.boot_baseline.view(self.n_boot, -1).addmm_(weights, baseline.reshape(B, -1))
        self.sentences += B

    def _with_all(self):
        """Counts with an extra relation 'all' (every word but the root) appended."""
        cat = lambda x, dim: torch.cat([x, x.sum(dim, keepdim=True)], dim)  # noqa: E731
        return (
            [*RELATIONS, "all"],
            cat(self.correct, 0),
            cat(self.total, 0),
            cat(self.baseline, 0),
            cat(self.boot_correct, 1),
            cat(self.boot_total, 1),
            cat(self.boot_baseline, 1),
        )

    def tables(self) -> dict[str, pd.DataFrame]:
        """``syntax``, ``syntax_baselines`` and ``syntax_best`` (0-based layer and head)."""
        names, correct, total, baseline, b_correct, b_total, b_baseline = self._with_all()
        present = [r for r in range(len(names)) if total[r] > 0 and names[r] != "root"]
        L, H = self.n_layers, self.n_heads
        layer, head = np.divmod(np.arange(L * H), H)
        rows, base_rows, best_rows = [], [], []
        for r in present:
            for d, direction in enumerate(DIRECTIONS):
                c = correct[r, d].numpy()
                rows.append(
                    pd.DataFrame(
                        {
                            "relation": names[r],
                            "direction": direction,
                            "layer": layer,
                            "head": head,
                            "correct": c.astype(int),
                            "total": int(total[r]),
                            "accuracy": c / float(total[r]),
                        }
                    )
                )
            base = baseline[r].numpy()
            base_rows.append(
                pd.DataFrame(
                    {
                        "relation": names[r],
                        "offset": OFFSETS,
                        "correct": base.astype(int),
                        "total": int(total[r]),
                        "accuracy": base / float(total[r]),
                    }
                )
            )
            d, h = np.unravel_index(int(correct[r].argmax()), correct[r].shape)
            o = int(baseline[r].argmax())
            drawn = b_total[:, r] > 0  # replicates that drew at least one word of r
            denominator = b_total[drawn, r]
            head_boot = (b_correct[drawn, r, d, h] / denominator).numpy()
            difference = head_boot - (b_baseline[drawn, r, o] / denominator).numpy()
            best_rows.append(
                {
                    "relation": names[r],
                    "total": int(total[r]),
                    "direction": DIRECTIONS[d],
                    "layer": int(h // H),
                    "head": int(h % H),
                    "accuracy": float(correct[r, d, h] / total[r]),
                    "ci_low": float(np.percentile(head_boot, 2.5)),
                    "ci_high": float(np.percentile(head_boot, 97.5)),
                    "baseline_offset": OFFSETS[o],
                    "baseline_accuracy": float(baseline[r, o] / total[r]),
                    "beats_baseline": bool(np.percentile(difference, 2.5) > 0),
                }
            )
        best = pd.DataFrame(best_rows).sort_values("total", ascending=False, kind="stable")
        return {
            "syntax": pd.concat(rows, ignore_index=True),
            "syntax_baselines": pd.concat(base_rows, ignore_index=True),
            "syntax_best": best.reset_index(drop=True),
        }


def figures(tables: dict[str, pd.DataFrame]) -> list[Figure]:
    """A layer x head heatmap of accuracy (best direction) for each main relation present."""
    syntax, best = tables["syntax"], tables["syntax_best"]
    relations = [r for r in (*MAIN_RELATIONS, "all") if r in set(best.relation)]
    if not relations:
        return []
    columns = 4
    rows = -(-len(relations) // columns)
    fig = MplFigure(figsize=(3.2 * columns, 2.7 * rows))
    spacing = {"left": 0.05, "right": 0.9, "bottom": 0.4 / rows, "top": 1 - 0.3 / rows}
    axes = np.atleast_1d(
        fig.subplots(rows, columns, gridspec_kw=spacing | {"wspace": 0.35, "hspace": 0.55})
    ).ravel()
    best_direction = (
        syntax[syntax.relation.isin(relations)]
        .groupby(["relation", "layer", "head"])
        .accuracy.max()
    )
    for k, (ax, relation) in enumerate(zip(axes, relations, strict=False)):
        grid = best_direction.loc[relation].unstack("head")
        bottom, left = k + columns >= len(relations), k % columns == 0
        image = heatmap(ax, grid, vmin=0, vmax=1, cmap="magma", x_axis=bottom, y_axis=left)
        row = best[best.relation == relation].iloc[0]
        ax.set_title(f"{relation} (n={row.total}): best {row.accuracy:.0%}", fontsize="medium")
    for ax in axes[len(relations) :]:
        ax.set_visible(False)
    fig.colorbar(image, cax=fig.add_axes((0.92, 0.25, 0.012, 0.5)), label="accuracy")
    return [
        Figure(
            "syntax-heatmaps",
            "Accuracy of every head per relation (better of the two directions)",
            "Heatmaps of layer by head, one per dependency relation, brighter where the head's "
            "most-attended word is the syntactic head or dependent more often.",
            fig,
        )
    ]
