"""Head roles and attention statistics (Clark et al. 2019; Voita et al. 2019).

Streams token-level sums per head: attention to special tokens, punctuation, itself, the previous
and next token; entropy; confidence (mean maximum weight); where each query's maximum lies; and
the Jensen-Shannon divergence between every pair of heads on the same queries. Roles follow from
the means with thresholds that are stated in the report and can be overridden.

The map of heads by similarity is made and drawn in ``analyses.head_map``.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from typing import TYPE_CHECKING, ClassVar

from analyses import Analysis, Context, Measure, Schema, svg
from analyses.figures import Figure, Plot
from analyses.head_map import embed, similarity_map, start_map
from analyses.vocabulary import Role, Thresholds
from probe.inputs.units import Either
from probe.keys import poisson, uniform
from probe.lazy import lazy
from probe.numerics import pairwise_js

if TYPE_CHECKING:
    from probe.capture.rows import RowBlock
    from probe.inputs.corpus import Batch

np = lazy("numpy")
pd = lazy("pandas")
torch = lazy("torch")

MAX_OFFSETS = (-2, -1, 0, 1, 2)
# What a layer keeps of each query until its last block: the weights on MAX_OFFSETS, which of
# them holds the largest weight (``RowBlock.max_at``), the entropy and the largest weight.
ROW_VALUES = (*(f"at_{o:+d}" for o in MAX_OFFSETS), "max_at", "entropy", "confidence")
METRICS = (
    "special",
    "punct",
    "cls_like",  # the first real token, when special ([CLS], <s>, BOS)
    "sep_like",  # the other special tokens ([SEP], </s>…)
    "self",
    "previous",
    "next",
    "entropy",
    "entropy_normalised",
    "confidence",
    *(f"max_at_{o:+d}" for o in MAX_OFFSETS),
)
# Each role's statistic gets a 95% interval from a Poisson bootstrap over sentences, as syntax
# has: each sentence weighs Poisson(1) in each replicate, keyed by its index (``probe.keys``).
ROLE_BOOT = 200
# The statistic behind each role, in the order of the bootstrap's sums; broad's is over the
# queries that see more than one key, the others over every real query.
ROLE_METRICS = ("max_at_-1", "max_at_+1", "sink_share", "entropy_normalised")
# Head similarity is estimated on a keyed sample of the real queries: each is in it with this
# probability, decided by its sentence and position alone (``probe.keys``).
JS_QUERY_SHARE = 1 / 32
# ... but of a long input (past 2,048 tokens) about this many queries: each costs a pass over
# its keys for every pair of heads, so a share of them would cost O(T²) per input, as much as
# the attention itself (a quarter of a 2 × 4-head model's forward pass at 8k tokens); a fixed
# number costs O(T).
JS_QUERIES_PER_INPUT = 64
# ... and at most about this many numbers of sampled rows per input (64 MiB of float32): a
# 32,768-token input of a 2 × 4-head model keeps 64 queries. Sentences are far below it.
JS_CELLS = 2**24
JS_GROUPS = 8  # of a causal model's sampled queries, each measured over the keys it sees
# A batch's per-query values of every layer are kept until its last layer, up to this many bytes
STACKED_BYTES = 16 * 2**20

INTERVALS = {f"{m}_{end}": "float" for m in ROLE_METRICS for end in ("low", "high")}


class Roles(Analysis):
    """Per-head sums of attention statistics and pairwise Jensen-Shannon divergences."""

    name = "roles"
    title = "Head roles"
    captures = ("hook_pattern",)
    rows = True
    unit = Either("text", "sentence")  # a corpus's windows when one is given
    helper_warmup = "analyses.head_map:warm_up"  # the head map's MDS
    tables: ClassVar[dict[str, Schema]] = {
        "head_stats": {
            "layer": "int", "head": "int", **dict.fromkeys(METRICS, "float"),
            "cls_entropy": "float", **INTERVALS,
        },
        "head_similarity": {
            "layer_a": "int", "head_a": "int", "layer_b": "int", "head_b": "int",
            "js_divergence": "float",
        },
    }  # fmt: skip
    head_columns: ClassVar[Schema] = {
        **dict.fromkeys(METRICS, "float"),
        "cls_entropy": "float",
        **INTERVALS,
        "sink_share": "float",
        "uncertain_roles": "str",
        "mds_x": "float",
        "mds_y": "float",
    }
    measures = (
        Measure("entropy", "entropy"),
        Measure("entropy_normalised", "normalised entropy"),
        Measure("special", "attention on special tokens", "pct"),
        Measure("cls_like", "attention on [CLS]-like tokens", "pct"),
        Measure("sep_like", "attention on [SEP]-like tokens", "pct"),
        Measure("punct", "attention on punctuation", "pct"),
        Measure("previous", "attention on the previous token", "pct"),
        Measure("next", "attention on the next token", "pct"),
    )

    def __init__(self, context: Context, *, js_query_share: float = JS_QUERY_SHARE):
        super().__init__(context)
        L, H = context.n_layers, context.n_heads
        self.js_query_share = js_query_share
        self.sums = torch.zeros(len(METRICS), L, H, dtype=torch.float64)
        self.queries = 0  # real query tokens
        self.normalisable = 0  # queries that see more than one key
        self.cls_entropy = torch.zeros(L, H, dtype=torch.float64)
        self.cls_rows = 0
        self.js = torch.zeros(L * H, L * H, dtype=torch.float64)
        self.js_queries = 0
        self.boot = torch.zeros(ROLE_BOOT, len(ROLE_METRICS), L, H, dtype=torch.float64)
        self.boot_queries = torch.zeros(ROLE_BOOT, dtype=torch.float64)
        self.boot_normalisable = torch.zeros(ROLE_BOOT, dtype=torch.float64)

    def begin_batch(self, batch: Batch) -> None:
        """What every layer of the batch shares: which queries are real, what each key is
        (special token, punctuation), how many keys each query sees, and the queries sampled
        for head similarity."""
        real = batch.attention_mask.bool()  # [B, T]
        B, T = real.shape
        word = batch.word_of_token.clamp(min=0)
        punct = torch.gather(batch.punct, 1, word) & (batch.word_of_token >= 0)
        keys = real.sum(1, keepdim=True).expand(B, T)
        if self.context.causal:
            keys = torch.minimum(torch.arange(1, T + 1, device=real.device)[None], keys)
        self._real = real.float()
        # Per query, what each statistic is weighed by: the metric's sum runs over real queries,
        # normalised entropy over queries that see more than one key.
        self._normaliser = (real & (keys > 1)) / torch.log(keys.float().clamp(min=2))
        # the next key must be real too (the last query has none)
        last = torch.zeros_like(real[:, :1])
        self._next = torch.cat([real[:, :-1] & real[:, 1:], last], 1).float()
        first = torch.arange(T, device=real.device)[None] == real.float().argmax(1, keepdim=True)
        kinds = [batch.special, punct, batch.special & first, batch.special & ~first]
        self._key_kinds = torch.stack(kinds, -1).float()  # [B, T, 4]
        self._has_cls = batch.special[:, 0] & (not self.context.causal)
        self.queries += int(real.sum())
        self.normalisable += int((real & (keys > 1)).sum())
        index, replicate = batch.index.cpu().numpy()[None], np.arange(ROLE_BOOT)[:, None]
        weights = poisson(self.context.seed, "roles-bootstrap", index, replicate)
        self._weights = torch.from_numpy(weights).double()  # [ROLE_BOOT, B]
        self.boot_queries += self._weights @ real.sum(1).double().cpu()
        self.boot_normalisable += self._weights @ (real & (keys > 1)).sum(1).double().cpu()
        self.cls_rows += int(self._has_cls.sum())
        # Head similarity: every pair of heads costs O(keys) per query, so the mean is estimated
        # on a sample of the real queries, each drawn by its sentence and position: the same
        # queries whatever the batches or the number of processes.
        # A long input's sample is smaller: about JS_QUERIES_PER_INPUT queries, whose kept rows,
        # L·H·queries·length numbers, stay within JS_CELLS (the share depends on the input's
        # own length, not on its batch).
        b, t = real.nonzero(as_tuple=True)
        sentence = batch.index.to(b.device)[b]
        drawn = uniform(self.context.seed, "js-query", sentence.cpu().numpy(), t.cpu().numpy())
        L, H = self.context.n_layers, self.context.n_heads
        length = real.sum(1).double().cpu().numpy()[b.cpu().numpy()]
        share = np.minimum(self.js_query_share, JS_QUERIES_PER_INPUT / length)
        share = np.minimum(share, JS_CELLS / (L * H * length**2))
        chosen = torch.from_numpy(drawn < share).to(b.device)
        self._keep_groups(b[chosen], t[chosen], T)
        # A layer's per-query values, filled block by block: the weights on keys -2…+2, where
        # the maximum lies, entropy and largest weight; and what each key receives from the real
        # queries. Every layer's are kept until the batch's last and summed at once (a sixth of
        # the operations on MiniLM's sentence batches), unless they would take more than
        # STACKED_BYTES: a long input's are summed a layer at a time.
        stacked = L * B * H * T * (len(ROW_VALUES) + 1) * 4 <= STACKED_BYTES
        self._stacked = L if stacked else 1
        self._values = torch.zeros(self._stacked, B, H, T, len(ROW_VALUES), device=real.device)
        self._received = torch.zeros(self._stacked, B, H, T, device=real.device)

    def update_rows(self, batch: Batch, layer: int, block: RowBlock) -> None:
        rows, keys = block.rows, block.keys
        slot = layer if self._stacked > 1 else 0
        near = block.at_offsets(MAX_OFFSETS)  # [B, H, rows, offset]
        values = self._values[slot, :, :, rows]
        values[..., : len(MAX_OFFSETS)] = near
        values[..., ROW_VALUES.index("max_at")] = block.max_at(MAX_OFFSETS, near)
        values[..., ROW_VALUES.index("entropy")], values[..., ROW_VALUES.index("confidence")] = (
            block.summary
        )
        if rows.start == 0:
            self._received[slot].zero_()
        # each key's share of the real queries' attention (the blocks weigh each query by the
        # batch's attention mask, as ``_real`` does)
        self._received[slot, ..., keys] += block.received
        self._keep_sample(layer, block)
        if rows.stop == self._values.shape[3] and slot == self._stacked - 1:
            self._add_layers(layer + 1 - self._stacked)

    def _add_layers(self, first: int) -> None:
        """Add the sums over their queries of the layers kept, ``first`` on, from their values
        and the keys' shares."""
        values, real = self._values, self._real  # [layers, B, H, T, ROW_VALUES], [B, T]
        layers, B, H, T, _ = values.shape
        n = len(MAX_OFFSETS)
        near = values[..., :n]
        offset = values[..., ROW_VALUES.index("max_at")].long().masked_fill_(real[:, None] == 0, n)
        entropies = values[..., ROW_VALUES.index("entropy")]
        confidence = values[..., ROW_VALUES.index("confidence")]
        # Per sentence and head: the attention the real queries give each kind of key (special,
        # punct, cls_like, sep_like), then the sums over real queries of self, entropy,
        # normalised entropy and confidence.
        normalised = entropies * self._normaliser[:, None]
        per_query = torch.stack([near[..., MAX_OFFSETS.index(0)], entropies, normalised,
                                 confidence], -2)  # fmt: skip
        per_sentence = torch.cat(
            [self._received @ self._key_kinds, (per_query @ real[:, None, :, None]).squeeze(-1)],
            -1,
        )  # [layers, B, H, 8]
        sums = per_sentence.sum(1).transpose(1, 2)
        previous = (near[..., MAX_OFFSETS.index(-1)] * real[:, None]).sum((1, 3))  # q -> q-1
        following = (near[..., MAX_OFFSETS.index(1)] * self._next[:, None]).sum((1, 3))
        # Where each query's maximum lies, relative to the query: offsets -2…+2 counted at once
        # (anything else, and padding queries, in one more bin).
        at_each = values.new_zeros(layers, B, H, n + 1).scatter_add_(
            3, offset, values.new_ones(()).expand(layers, B, H, T)
        )[..., :n]
        at = at_each.sum(1)  # [layers, H, offset]
        self_at = METRICS.index("self") + 1  # the sums up to self, then previous and next
        stats = torch.cat([sums[:, :self_at], previous[:, None], following[:, None],
                           sums[:, self_at:], at.transpose(1, 2)], 1)  # fmt: skip
        kept = slice(first, first + layers)
        self.sums[:, kept] += stats.double().cpu().transpose(0, 1)  # in the order of METRICS
        # The roles' statistics per sentence, [B, ROLE_METRICS, layers, H], for the bootstrap
        kinds = self._key_kinds.shape[-1]
        roles = torch.stack([
            at_each[..., MAX_OFFSETS.index(-1)],
            at_each[..., MAX_OFFSETS.index(1)],
            per_sentence[..., 0] + per_sentence[..., 1],
            per_sentence[..., kinds + 2],
        ], 0).permute(2, 0, 1, 3)  # fmt: skip
        self.boot[:, :, kept] += (self._weights @ roles.flatten(1).double().cpu()).view(
            ROLE_BOOT, len(ROLE_METRICS), layers, H
        )
        self.cls_entropy[kept] += entropies[..., 0][:, self._has_cls].sum(1).double().cpu()

    def _keep_groups(self, b: torch.Tensor, t: torch.Tensor, T: int) -> None:
        """Where the sampled queries (sentence ``b``, position ``t``) keep their rows: a causal
        query sees no key after itself, and zero weights add nothing, so they are kept by
        position, in JS_GROUPS groups each as wide as the keys its last one sees (half the
        work, and the memory, of a long input's full rows)."""
        L, H = self.context.n_layers, self.context.n_heads
        order = t.argsort(stable=True)
        groups = order.tensor_split(JS_GROUPS) if self.context.causal else (order,)
        self._groups = []  # (its queries' sentences and positions, their rows [L, H, n, keys])
        for group in filter(len, groups):
            width = int(t[group].max()) + 1 if self.context.causal else T
            self._groups.append((b[group], t[group], torch.zeros(L, H, len(group), width,
                                                                 device=b.device)))  # fmt: skip
        # each group's positions, in order, to find a block's queries without the device
        self._positions = [t.tolist() for _, t, _ in self._groups]

    def _keep_sample(self, layer: int, block: RowBlock) -> None:
        """The sampled queries' rows of this block, for head similarity at the batch's end."""
        start, stop = block.rows.start, block.rows.stop
        for (b, t, kept), positions in zip(self._groups, self._positions, strict=True):
            here = slice(bisect_left(positions, start), bisect_left(positions, stop))
            if here.start == here.stop:
                continue
            keys = slice(block.keys.start, min(block.keys.stop, kept.shape[-1]))
            picked = block.pattern[b[here], :, t[here] - start, : keys.stop - keys.start]
            kept[layer, :, here, keys] = picked.transpose(0, 1)  # [H, sampled, keys]

    def end_batch(self, batch: Batch) -> None:
        for _, _, kept in self._groups:
            self._add_js(kept.flatten(0, 1))

    def _add_js(self, q: torch.Tensor) -> None:
        """Add Σ over sampled queries of JS(head a, head b), from each head's attention on the
        sampled queries, ``[layer·head, queries, keys]`` (``probe.numerics.pairwise_js``)."""
        self.js += pairwise_js(q).double().cpu()
        self.js_queries += q.shape[1]

    def merge(self, other: Roles) -> None:
        self._check_mergeable(other)
        for name in ("sums", "cls_entropy", "js", "boot", "boot_queries", "boot_normalisable"):
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
        # 95% bootstrap intervals of each role's statistic (replicates that drew no query
        # give no ratio, and are left out)
        for k, metric in enumerate(ROLE_METRICS):
            counts = self.boot_normalisable if metric == "entropy_normalised" else self.boot_queries
            drawn = counts > 0
            ratios = (self.boot[drawn, k] / counts[drawn, None, None]).flatten(1).numpy()
            low, high = np.percentile(ratios, [2.5, 97.5], axis=0) if drawn.any() else (
                np.full(L * H, math.nan), np.full(L * H, math.nan))  # fmt: skip
            stats[f"{metric}_low"], stats[f"{metric}_high"] = low, high
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
        start_map(similarity, L * H)
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
        uncertain = []
        for role, (column, threshold) in tests.items():
            heads[str(role)] = heads[column] >= threshold
            # granted, but the interval reaches below the threshold
            low = heads.get(f"{column}_low", heads[column])
            uncertain.append(np.where(heads[str(role)] & (low < threshold), str(role), ""))
        heads["uncertain_roles"] = [";".join(filter(None, r)) for r in zip(*uncertain, strict=True)]
        xy = embed(tables["head_similarity"], len(heads))
        heads["mds_x"], heads["mds_y"] = xy[:, 0], xy[:, 1]
        return heads

    plots = (
        Plot("per-layer", "Where attention goes, per layer", "analyses.paper:attention_per_layer",
             page=lambda tables: per_layer(tables), needs=("heads",)),
        Plot("similarity", "The heads by similarity of attention (MDS of √JS)",
             "analyses.paper:head_map", page=lambda tables: similarity(tables),
             needs=("heads",)),
    )  # fmt: skip

    @classmethod
    def section(cls, tables: dict[str, pd.DataFrame], run: dict) -> dict:
        thresholds = Thresholds(**run.get("thresholds", {}))
        return {"rules": thresholds.describe(), "heads": tables["heads"].to_dict("records")}


def per_layer(tables: dict[str, pd.DataFrame]) -> Figure:
    """Where attention goes and its entropy, per layer, as inline SVG."""
    heads = tables["heads"]
    means = heads.groupby("layer")[["cls_like", "sep_like", "punct", "self", "previous",
                                    "next"]].mean()  # fmt: skip
    labels = {
        "cls_like": "[CLS]-like (first, special)",
        "sep_like": "[SEP]-like (other special)",
        "punct": "punctuation",
        "self": "itself",
        "previous": "previous token",
        "next": "next token",
    }
    where = [svg.Series(label, means.index, means[column])
             for column, label in labels.items()]  # fmt: skip
    entropy = heads.groupby("layer")[["entropy", "cls_entropy"]].mean()
    entropies = [svg.Series("mean over tokens", entropy.index, entropy.entropy)]
    if entropy.cls_entropy.notna().any():
        entropies.append(svg.Series("[CLS] row", entropy.index, entropy.cls_entropy))
    panels = [
        svg.Chart("Where attention goes, mean over heads", where, "layer (0-based)",
                  "mean attention"),
        svg.Chart("Attention entropy per layer", entropies, "layer (0-based)", "entropy (nats)"),
    ]  # fmt: skip
    alt = (
        "Line charts per layer of mean attention to the first special token ([CLS]), the other "
        "special tokens ([SEP]), punctuation, self, previous and next token, and of entropy."
    )
    return Figure("per-layer", "Attention per layer", alt, svg.charts(panels, alt=alt))


def similarity(tables: dict[str, pd.DataFrame]) -> Figure:
    """The map of heads by similarity, as inline SVG."""
    alt = (
        "A scatter plot of all heads placed by multidimensional scaling of the Jensen-Shannon "
        "distance between their attention, coloured by role; hovering a point names the head."
    )
    return Figure("similarity", "Head similarity map", alt, similarity_map(tables["heads"]))
