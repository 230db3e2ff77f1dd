"""Head roles and attention statistics (Clark et al. 2019; Voita et al. 2019).

Streams token-level sums per head: attention to special tokens, punctuation, itself, the previous
and next token; entropy; confidence (mean maximum weight); where each query's maximum lies; and
the Jensen-Shannon divergence between every pair of heads on the same queries. Roles follow from
the means with thresholds that are stated in the report and can be overridden.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import seaborn as sns
import torch
from matplotlib.figure import Figure as MplFigure
from sklearn.manifold import MDS

from analyses import Figure
from probe.alignment import Attention
from probe.corpus import Batch

name = "roles"
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


BEST_RELATION_COLUMNS = (
    "best_relation",
    "best_relation_direction",
    "best_relation_accuracy",
    "best_relation_margin",
)


@dataclass(frozen=True)
class Thresholds:
    """When a head gets a role; a head may hold several roles, or none."""

    previous_token: float = 0.9  # share of queries whose maximum is on the previous token
    next_token: float = 0.9  # share of queries whose maximum is on the next token
    sink: float = 0.6  # mean attention on special tokens and punctuation
    broad: float = 0.9  # mean entropy / log(number of keys)
    syntactic: float = 0.10  # best relation accuracy above its best offset baseline
    relation_min_words: int = 20  # relations scored for roles have at least this many words
    relation_min_share: float = 0.01  # … and at least this share of all scored words

    def describe(self) -> dict[str, str]:
        return {
            "previous-token": f"maximum on the previous token for ≥ {self.previous_token:.0%} "
            "of queries",
            "next-token": f"maximum on the next token for ≥ {self.next_token:.0%} of queries",
            "sink": f"≥ {self.sink:.0%} of attention on special tokens and punctuation",
            "broad": f"normalised entropy ≥ {self.broad:.2f}",
            "syntactic": f"best relation accuracy ≥ {self.syntactic * 100:.0f} points above "
            f"its best offset baseline, among relations with ≥ {self.relation_min_words} words "
            f"and ≥ {self.relation_min_share:.0%} of all words",
        }


class RolesAnalysis:
    """Per-head sums of attention statistics and pairwise Jensen-Shannon divergences."""

    name = name

    def __init__(
        self,
        n_layers: int,
        n_heads: int,
        *,
        causal: bool = False,
        seed: int = 0,
        js_queries_per_batch: int = 16,
    ):
        self.n_layers, self.n_heads, self.causal = n_layers, n_heads, causal
        self.generator = torch.Generator().manual_seed(seed)
        self.js_queries_per_batch = js_queries_per_batch
        self.js_queries = 0
        LH = n_layers * n_heads
        self.sums = torch.zeros(len(METRICS), LH, dtype=torch.float64)
        self.queries = 0  # real query tokens
        self.normalisable = 0  # queries that see more than one key
        self.cls_entropy = torch.zeros(LH, dtype=torch.float64)
        self.cls_rows = 0
        self.js = torch.zeros(LH, LH, dtype=torch.float64)

    def update(self, batch: Batch, attention: Attention) -> None:
        p = attention.flat  # [B, LH, T, T]
        B, T = p.shape[0], p.shape[-1]
        real = batch.attention_mask.bool()  # [B, T]
        special = batch.special.to(p.dtype)
        word = batch.word_of_token.clamp(min=0)
        punct = (torch.gather(batch.punct, 1, word) & (batch.word_of_token >= 0)).to(p.dtype)
        pos = torch.arange(T, device=p.device)
        keys = (
            real.sum(1, keepdim=True).expand(B, T)
            if not self.causal
            else (pos + 1)[None].expand(B, T)
        )
        keys = torch.minimum(keys, real.sum(1, keepdim=True))

        entropy = -torch.special.xlogy(p, p).sum(-1)  # [B, LH, T]
        shifted = lambda k: torch.diagonal(p, offset=k, dim1=-2, dim2=-1)  # noqa: E731
        previous = torch.nn.functional.pad(shifted(-1), (1, 0))  # query q -> key q-1
        following = torch.nn.functional.pad(shifted(1), (0, 1))  # query q -> key q+1
        following = following * real.roll(-1, 1)[:, None]  # the next key must be real
        confidence, argmax = p.max(-1)
        offset = argmax - pos  # where each query's maximum lies, relative to the query
        log_keys = torch.log(keys.to(p.dtype).clamp(min=2))
        per_query = [
            p @ special[:, None, :, None],
            p @ punct[:, None, :, None],
            torch.diagonal(p, dim1=-2, dim2=-1)[..., None],
            previous[..., None],
            following[..., None],
            entropy[..., None],
            (entropy / log_keys[:, None])[..., None] * (keys > 1)[:, None, :, None],
            confidence[..., None],
            *((offset == o).to(p.dtype)[..., None] for o in MAX_OFFSETS),
        ]
        stats = torch.cat(per_query, -1)  # [B, LH, T, metric]
        mask = real[:, None, :, None].to(p.dtype)
        self.sums += (stats * mask).sum((0, 2)).T.double().cpu()
        self.queries += int(real.sum())
        self.normalisable += int((real & (keys > 1)).sum())
        has_cls = batch.special[:, 0] & ~torch.tensor(self.causal)
        self.cls_entropy += entropy[has_cls, :, 0].sum(0).double().cpu()
        self.cls_rows += int(has_cls.sum())
        self._add_js(p, real)

    def _add_js(self, p: torch.Tensor, real: torch.Tensor) -> None:
        """Σ over sampled real queries of JS(head a, head b) = H(m) - (H(a) + H(b)) / 2.

        Every pair of heads costs O(keys) per query, so the mean is estimated on a seeded
        uniform sample of queries from each batch rather than on all of them."""
        b, t = real.nonzero(as_tuple=True)
        chosen = torch.randperm(len(b), generator=self.generator)[: self.js_queries_per_batch]
        chosen = chosen.to(b.device)
        q = p[b[chosen], :, t[chosen], :].float()  # [queries, LH, T]
        LH, T = q.shape[1], q.shape[2]
        entropy = lambda x: -torch.special.xlogy(x, x).sum(-1)  # noqa: E731
        own = entropy(q)  # [queries, LH]
        first, second = torch.triu_indices(LH, LH, offset=1, device=q.device)  # JS is symmetric
        chunk = max(1, int(2e7 // (len(first) * T)))
        for start in range(0, len(q), chunk):
            part, o = q[start : start + chunk], own[start : start + chunk]
            mixed = entropy((part[:, first] + part[:, second]) / 2)  # [queries, pairs]
            pairs = (mixed - (o[:, first] + o[:, second]) / 2).sum(0).double().cpu()
            self.js[first.cpu(), second.cpu()] += pairs
            self.js[second.cpu(), first.cpu()] += pairs
        self.js_queries += len(q)

    def tables(self) -> dict[str, pd.DataFrame]:
        """``head_stats`` (one row per head) and ``head_similarity`` (one row per pair)."""
        L, H = self.n_layers, self.n_heads
        means = (self.sums / max(self.queries, 1)).numpy()
        means[METRICS.index("entropy_normalised")] *= self.queries / max(self.normalisable, 1)
        layer, head = np.divmod(np.arange(L * H), H)
        stats = pd.DataFrame(
            {"layer": layer, "head": head, **dict(zip(METRICS, means, strict=True))}
        )
        stats["cls_entropy"] = (
            (self.cls_entropy / self.cls_rows).numpy() if self.cls_rows else math.nan
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


def heads_table(
    stats: pd.DataFrame,
    similarity: pd.DataFrame | None = None,
    syntax_best_per_head: pd.DataFrame | None = None,
    spectra: pd.DataFrame | None = None,
    thresholds: Thresholds = Thresholds(),
    seed: int = 0,
) -> pd.DataFrame:
    """The table that joins every analysis: one row per head with its metrics and roles.

    Parameters
    ----------
    stats : DataFrame
        ``head_stats`` from ``RolesAnalysis.tables()``, or just the (layer, head) grid when the
        roles analysis did not run (then only the syntactic role can be given).
    similarity : DataFrame, optional
        ``head_similarity``; adds the 2-D MDS coordinates ``mds_x``, ``mds_y``.
    syntax_best_per_head : DataFrame, optional
        From ``best_relation_per_head``.
    spectra : DataFrame, optional
        ``spectra.csv``; adds ``qk_effective_rank`` and ``ov_effective_rank``.
    """
    heads = stats.copy()
    roles: list[list[str]] = [[] for _ in range(len(heads))]
    tests = {
        "previous-token": ("max_at_-1", thresholds.previous_token),
        "next-token": ("max_at_+1", thresholds.next_token),
        "sink": ("sink_share", thresholds.sink),
        "broad": ("entropy_normalised", thresholds.broad),
    }
    if "special" in heads:
        heads["sink_share"] = heads["special"] + heads["punct"]
    for role, (column, threshold) in tests.items():
        if column in heads:
            for i in np.nonzero((heads[column] >= threshold).to_numpy())[0]:
                roles[i].append(role)
    if syntax_best_per_head is not None and len(syntax_best_per_head):
        heads = heads.merge(syntax_best_per_head, on=["layer", "head"], how="left")
        for i in np.nonzero((heads["best_relation_margin"] >= thresholds.syntactic).to_numpy())[0]:
            roles[i].append("syntactic")
    if spectra is not None:
        ranks = spectra.pivot_table(
            index=["layer", "head"], columns="circuit", values="effective_rank"
        ).rename(columns={"QK": "qk_effective_rank", "OV": "ov_effective_rank"})
        heads = heads.merge(ranks.reset_index(), on=["layer", "head"], how="left")
    heads["roles"] = [";".join(r) for r in roles]
    if similarity is not None:
        xy = embed(similarity, len(heads), seed)
        heads["mds_x"], heads["mds_y"] = xy[:, 0], xy[:, 1]
    return heads


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
        return pd.DataFrame(columns=["layer", "head", *BEST_RELATION_COLUMNS])
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


def embed(similarity: pd.DataFrame, n: int, seed: int = 0) -> np.ndarray:
    """A 2-D MDS embedding of the heads from √JS (a metric), as in Clark et al. (2019)."""
    js = similarity.js_divergence.to_numpy().reshape(n, n)
    distance = np.sqrt(np.maximum((js + js.T) / 2, 0))
    np.fill_diagonal(distance, 0)
    if n < 3:
        return np.zeros((n, 2))
    mds = MDS(n_components=2, metric="precomputed", init="classical_mds", random_state=seed)
    return mds.fit_transform(distance)


def figures(tables: dict[str, pd.DataFrame]) -> list[Figure]:
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
    sns.scatterplot(heads, x="mds_x", y="mds_y", hue="layer", palette="viridis", ax=ax1, s=40)
    ax1.set_title("Heads by similarity of attention (MDS of √JS), by layer")
    primary = heads.roles.fillna("").map(lambda r: r.split(";")[0] if r else "none")
    sns.scatterplot(
        heads.assign(role=primary), x="mds_x", y="mds_y", hue="role", style="role", ax=ax2, s=40
    )
    ax2.set_title("… by role")
    for ax in (ax1, ax2):
        ax.set_xlabel("")
        ax.set_ylabel("")
        ax.legend(fontsize="x-small")
    alt = (
        "Two scatter plots of all heads placed by multidimensional scaling of the "
        "Jensen-Shannon distance between their attention, coloured by layer and by role."
    )
    out.append(Figure("similarity", "Head similarity map", alt, fig))
    return out
