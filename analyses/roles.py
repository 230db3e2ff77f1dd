"""Head roles and attention statistics (Clark et al. 2019; Voita et al. 2019).

Streams token-level sums per head: attention to special tokens, punctuation, itself, the previous
and next token; entropy; confidence (mean maximum weight); where each query's maximum lies; and
the Jensen-Shannon divergence between every pair of heads on the same queries. Roles follow from
the means with thresholds that are stated in the report and can be overridden.
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
import pandas as pd
import torch
from matplotlib.figure import Figure as MplFigure

from analyses import Analysis, Context, Schema
from analyses.figures import Figure
from analyses.vocabulary import Role, Thresholds
from probe.corpus import Batch
from probe.runner import LayerCapture

MAX_OFFSETS = (-2, -1, 0, 1, 2)
METRICS = (
    "special",
    "punct",
    "self",
    "previous",
    "next",
    "entropy",
    "entropy_normalised",
    "confidence",
    *(f"max_at_{o:+d}" for o in MAX_OFFSETS),
)
JS_QUERIES_PER_BATCH = 16


class Roles(Analysis):
    """Per-head sums of attention statistics and pairwise Jensen-Shannon divergences."""

    name = "roles"
    title = "Head roles"
    captures = ("hook_pattern",)
    tables: ClassVar[dict[str, Schema]] = {
        "head_stats": {
            "layer": "int", "head": "int", **dict.fromkeys(METRICS, "float"),
            "cls_entropy": "float",
        },
        "head_similarity": {
            "layer_a": "int", "head_a": "int", "layer_b": "int", "head_b": "int",
            "js_divergence": "float",
        },
    }  # fmt: skip
    head_columns: ClassVar[Schema] = {
        **dict.fromkeys(METRICS, "float"),
        "cls_entropy": "float",
        "sink_share": "float",
        "mds_x": "float",
        "mds_y": "float",
    }

    def __init__(self, context: Context, *, js_queries_per_batch: int = JS_QUERIES_PER_BATCH):
        super().__init__(context)
        L, H = context.n_layers, context.n_heads
        self.generator = torch.Generator().manual_seed(context.seed)
        self.js_queries_per_batch = js_queries_per_batch
        self.sums = torch.zeros(len(METRICS), L, H, dtype=torch.float64)
        self.queries = 0  # real query tokens
        self.normalisable = 0  # queries that see more than one key
        self.cls_entropy = torch.zeros(L, H, dtype=torch.float64)
        self.cls_rows = 0
        self.js = torch.zeros(L * H, L * H, dtype=torch.float64)
        self.js_queries = 0

    def begin_batch(self, batch: Batch) -> None:
        """What every layer of the batch shares: which tokens are real, special or punctuation,
        how many keys each query sees, and the queries sampled for head similarity."""
        real = batch.attention_mask.bool()  # [B, T]
        B, T = real.shape
        word = batch.word_of_token.clamp(min=0)
        punct = torch.gather(batch.punct, 1, word) & (batch.word_of_token >= 0)
        pos = torch.arange(T, device=real.device)
        keys = real.sum(1, keepdim=True).expand(B, T)
        if self.context.causal:
            keys = torch.minimum((pos + 1)[None].expand(B, T), keys)
        self._real, self._keys = real, keys
        # [B, T, 2]: the key weights of special tokens and of punctuation
        self._key_kinds = torch.stack([batch.special, punct], -1).float()
        self._log_keys = torch.log(keys.float().clamp(min=2))
        self._has_cls = batch.special[:, 0] & (not self.context.causal)
        self.queries += int(real.sum())
        self.normalisable += int((real & (keys > 1)).sum())
        self.cls_rows += int(self._has_cls.sum())
        # Head similarity: every pair of heads costs O(keys) per query, so the mean is estimated
        # on a seeded uniform sample of real queries from each batch rather than on all of them.
        b, t = real.nonzero(as_tuple=True)
        chosen = torch.randperm(len(b), generator=self.generator)[: self.js_queries_per_batch]
        self._sample = b[chosen.to(b.device)], t[chosen.to(b.device)]
        L, H = self.context.n_layers, self.context.n_heads
        self._rows = torch.zeros(len(chosen), L, H, T, device=real.device)

    def update(self, batch: Batch, layer: int, capture: LayerCapture) -> None:
        p = capture.pattern  # [B, H, T, T]
        T = p.shape[-1]
        real = self._real
        entropy = -torch.special.xlogy(p, p).sum(-1)  # [B, H, T]
        shifted = lambda k: torch.diagonal(p, offset=k, dim1=-2, dim2=-1)  # noqa: E731
        previous = torch.nn.functional.pad(shifted(-1), (1, 0))  # query q -> key q-1
        following = torch.nn.functional.pad(shifted(1), (0, 1))  # query q -> key q+1
        following = following * real.roll(-1, 1)[:, None]  # the next key must be real
        confidence, argmax = p.max(-1)
        offset = argmax - torch.arange(T, device=p.device)  # where each query's maximum lies
        kinds = p @ self._key_kinds[:, None]  # [B, H, T, 2]: special, punctuation
        per_query = [
            kinds,
            torch.diagonal(p, dim1=-2, dim2=-1)[..., None],
            previous[..., None],
            following[..., None],
            entropy[..., None],
            (entropy / self._log_keys[:, None])[..., None] * (self._keys > 1)[:, None, :, None],
            confidence[..., None],
            *((offset == o).to(p.dtype)[..., None] for o in MAX_OFFSETS),
        ]
        stats = torch.cat(per_query, -1)  # [B, H, T, metric]
        mask = real[:, None, :, None].to(p.dtype)
        self.sums[:, layer] += (stats * mask).sum((0, 2)).T.double().cpu()
        self.cls_entropy[layer] += entropy[self._has_cls, :, 0].sum(0).double().cpu()
        b, t = self._sample
        self._rows[:, layer] = p[b, :, t, :]

    def end_batch(self, batch: Batch) -> None:
        self._add_js(self._rows.flatten(1, 2))

    def _add_js(self, q: torch.Tensor) -> None:
        """Add Σ over sampled queries of JS(head a, head b) = H(m) - (H(a) + H(b)) / 2, from
        each sampled query's attention ``[queries, layer·head, keys]``."""
        LH, T = q.shape[1], q.shape[2]
        entropy = lambda x: -torch.special.xlogy(x, x).sum(-1)  # noqa: E731
        own = entropy(q)  # [queries, LH]
        first, second = torch.triu_indices(LH, LH, offset=1, device=q.device)  # JS is symmetric
        chunk = max(1, int(2e7 // (max(len(first), 1) * T)))
        for start in range(0, len(q), chunk):
            part, o = q[start : start + chunk], own[start : start + chunk]
            mixed = entropy((part[:, first] + part[:, second]) / 2)  # [queries, pairs]
            pairs = (mixed - (o[:, first] + o[:, second]) / 2).sum(0).double().cpu()
            self.js[first.cpu(), second.cpu()] += pairs
            self.js[second.cpu(), first.cpu()] += pairs
        self.js_queries += len(q)

    def merge(self, other: Roles) -> None:
        self._check_mergeable(other)
        for name in ("sums", "cls_entropy", "js"):
            getattr(self, name).add_(getattr(other, name))
        for name in ("queries", "normalisable", "cls_rows", "js_queries"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def _tables(self) -> dict[str, pd.DataFrame]:
        """``head_stats`` (one row per head) and ``head_similarity`` (one row per pair)."""
        L, H = self.context.n_layers, self.context.n_heads
        means = (self.sums.flatten(1) / max(self.queries, 1)).numpy()
        means[METRICS.index("entropy_normalised")] *= self.queries / max(self.normalisable, 1)
        layer, head = np.divmod(np.arange(L * H), H)
        stats = pd.DataFrame(
            {"layer": layer, "head": head, **dict(zip(METRICS, means, strict=True))}
        )
        stats["cls_entropy"] = (
            (self.cls_entropy.flatten() / self.cls_rows).numpy() if self.cls_rows else math.nan
        )
        js = (self.js / max(self.js_queries, 1)).numpy()
        a, b = np.divmod(np.arange((L * H) ** 2), L * H)
        similarity = pd.DataFrame(
            {
                "layer_a": layer[a],
                "head_a": head[a],
                "layer_b": layer[b],
                "head_b": head[b],
                "js_divergence": js.ravel().clip(min=0),
            }
        )
        return {"head_stats": stats, "head_similarity": similarity}

    @classmethod
    def heads(cls, tables: dict[str, pd.DataFrame], thresholds: Thresholds) -> pd.DataFrame:
        """Each head's statistics, its place on the similarity map, and the roles they give."""
        heads = tables["head_stats"].copy()
        heads["sink_share"] = heads["special"] + heads["punct"]
        tests = {
            Role.PREVIOUS_TOKEN: ("max_at_-1", thresholds.previous_token),
            Role.NEXT_TOKEN: ("max_at_+1", thresholds.next_token),
            Role.SINK: ("sink_share", thresholds.sink),
            Role.BROAD: ("entropy_normalised", thresholds.broad),
        }
        for role, (column, threshold) in tests.items():
            heads[str(role)] = heads[column] >= threshold
        xy = embed(tables["head_similarity"], len(heads))
        heads["mds_x"], heads["mds_y"] = xy[:, 0], xy[:, 1]
        return heads

    @classmethod
    def figures(cls, tables: dict[str, pd.DataFrame]) -> list[Figure]:
        return charts(tables)

    @classmethod
    def section(cls, tables: dict[str, pd.DataFrame], run: dict) -> dict:
        thresholds = Thresholds(**run.get("thresholds", {}))
        return {"rules": thresholds.describe(), "heads": tables["heads"].to_dict("records")}


def embed(similarity: pd.DataFrame, n: int) -> np.ndarray:
    """A 2-D MDS embedding of the heads from √JS (a metric), as in Clark et al. (2019).

    SMACOF from the classical (eigenvector) solution: deterministic, no seed needed."""
    from sklearn.manifold import MDS

    js = similarity.js_divergence.to_numpy().reshape(n, n)
    distance = np.sqrt(np.maximum((js + js.T) / 2, 0))
    np.fill_diagonal(distance, 0)
    if n < 3:
        return np.zeros((n, 2))
    mds = MDS(n_components=2, metric="precomputed", init="classical_mds", random_state=0)
    return mds.fit_transform(distance)


def charts(tables: dict[str, pd.DataFrame]) -> list[Figure]:
    """Attention per layer, and the map of heads by similarity."""
    heads = tables["heads"]
    out = []
    per_layer = heads.groupby("layer")[["special", "punct", "self", "previous", "next"]].mean()
    fig = MplFigure(figsize=(10, 3.4))
    ax1, ax2 = fig.subplots(
        1, 2, gridspec_kw={"left": 0.07, "right": 0.98, "bottom": 0.15, "top": 0.9, "wspace": 0.25}
    )
    labels = {
        "special": "special tokens",
        "punct": "punctuation",
        "self": "itself",
        "previous": "previous token",
        "next": "next token",
    }
    for column, label in labels.items():
        ax1.plot(per_layer.index, per_layer[column], marker="o", label=label)
    ax1.set_xlabel("layer (0-based)")
    ax1.set_ylabel("mean attention")
    ax1.set_title("Where attention goes, mean over heads")
    ax1.legend(fontsize="small")
    entropy = heads.groupby("layer")[["entropy", "cls_entropy"]].mean()
    ax2.plot(entropy.index, entropy.entropy, marker="o", label="mean over tokens")
    if entropy.cls_entropy.notna().any():
        ax2.plot(entropy.index, entropy.cls_entropy, marker="s", label="[CLS] row")
    ax2.set_xlabel("layer (0-based)")
    ax2.set_ylabel("entropy (nats)")
    ax2.set_title("Attention entropy per layer")
    ax2.legend(fontsize="small")
    alt = (
        "Line charts per layer of mean attention to special tokens, punctuation, self, "
        "previous and next token, and of entropy."
    )
    out.append(Figure("per-layer", "Attention per layer", alt, fig, "svg"))

    fig = MplFigure(figsize=(10, 4.2))
    ax1, ax2 = fig.subplots(
        1, 2, gridspec_kw={"left": 0.04, "right": 0.98, "bottom": 0.06, "top": 0.92, "wspace": 0.12}
    )
    points = ax1.scatter(heads.mds_x, heads.mds_y, c=heads.layer, cmap="viridis", s=30)
    fig.colorbar(points, ax=ax1, label="layer", shrink=0.8)
    ax1.set_title("Heads by similarity of attention (MDS of √JS), by layer")
    primary = heads.roles.fillna("").map(lambda r: r.split(";")[0] if r else "none")
    for role in [*Role, "none"]:
        chosen = primary == role
        if chosen.any():
            colour = role.colour if isinstance(role, Role) else "#b0b4bb"
            ax2.scatter(heads.mds_x[chosen], heads.mds_y[chosen], color=colour, s=30, label=role)
    ax2.set_title("… by role")
    ax2.legend(fontsize="x-small")
    for ax in (ax1, ax2):
        ax.set_xticks([])
        ax.set_yticks([])
    alt = (
        "Two scatter plots of all heads placed by multidimensional scaling of the "
        "Jensen-Shannon distance between their attention, coloured by layer and by role."
    )
    out.append(Figure("similarity", "Head similarity map", alt, fig))
    return out
