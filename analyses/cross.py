"""Cross-attention of encoder-decoder models: how spread each decoder head's attention over the
source is, and how closely it follows the diagonal.

The decoder reads each sentence itself, shifted right after its start token
(``probe.pipeline.runner.decoder_inputs``): decoder position t has read source tokens 0…t-1 and
predicts token t. A head that aligns the target with the source puts its weight near source
position t; the statistics say how much lands at t (the token being predicted), at t-1 (the
token just read) and at t+1, and how often the maximum is at t or t-1. The weights of each head
add the effective rank of its QK circuit, which pairs the decoder's queries with the encoder's
keys.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from analyses import Analysis, Context, Schema, svg
from analyses.figures import Figure, Plot
from probe.inputs.units import Either
from probe.lazy import lazy
from probe.numerics import entropy

if TYPE_CHECKING:
    from probe.inputs.corpus import Batch
    from probe.pipeline.runner import LayerCapture

np = lazy("numpy")
pd = lazy("pandas")
torch = lazy("torch")

ATTENTION = "decoder.cross_attn"
OFFSETS = {"at_read": -1, "at_predicted": 0, "at_next": 1}  # source position minus t
METRICS = ("entropy", "entropy_normalised", *OFFSETS, "max_at_read", "max_at_predicted")


class CrossAttention(Analysis):
    """Per decoder head, sums over real target positions of cross-attention statistics."""

    name = "cross"
    title = "Cross-attention"
    captures = ("hook_pattern",)
    unit = Either("text", "sentence")  # a corpus's windows when one is given
    attention = ATTENTION
    tables: ClassVar[dict[str, Schema]] = {
        "cross_attention": {
            "layer": "int", "head": "int", **dict.fromkeys(METRICS, "float"),
            "diagonal": "float", "queries": "int", "qk_effective_rank": "float",
            "ov_effective_rank": "float",
        }
    }  # fmt: skip

    @classmethod
    def unsupported(cls, model) -> str | None:
        from probe.capture.spec import describe

        if not describe(model).encoder_decoder:
            return "cross-attention needs an encoder-decoder model (BART, T5…)"
        return None

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        from probe.capture.spec import describe

        cross = describe(context.model).attention(ATTENTION)
        self.n_layers, self.n_heads = cross.n_layers, cross.n_heads
        self.sums = torch.zeros(len(METRICS), self.n_layers, self.n_heads, dtype=torch.float64)
        self.queries = 0  # real target positions
        self.normalisable = 0  # real target positions whose sentence has more than one token

    def begin_batch(self, batch: Batch) -> None:
        keys = batch.attention_mask.bool()  # the source's real tokens
        # The decoder's real positions: its start token, then the source shifted right by one,
        # one position per source token (``probe.pipeline.runner.decoder_inputs``).
        queries = keys
        n_keys = keys.sum(1, keepdim=True).expand_as(queries)
        self._real = queries.float()  # [B, T]
        self._normaliser = (queries & (n_keys > 1)) / torch.log(n_keys.float().clamp(min=2))
        self._positions = torch.arange(keys.shape[1], device=keys.device)
        self.queries += int(queries.sum())
        self.normalisable += int((queries & (n_keys > 1)).sum())

    def update(self, batch: Batch, layer: int, capture: LayerCapture) -> None:
        p = capture.pattern  # [B, H, target, source]; both are T long
        real = self._real
        entropies = entropy(p)  # [B, H, T]
        per_query = [entropies, entropies * self._normaliser[:, None]]
        for offset in OFFSETS.values():
            at = p.diagonal(offset, -2, -1)  # [B, H, T - |offset|]: weight on source t + offset
            padded = torch.zeros_like(entropies)
            padded[..., max(-offset, 0) : p.shape[-1] - max(offset, 0)] = at
            per_query.append(padded)
        argmax = p.argmax(-1) - self._positions  # offset of each query's maximum
        per_query += [(argmax == -1).to(p.dtype), (argmax == 0).to(p.dtype)]
        sums = torch.einsum("mbhq,bq->mh", torch.stack(per_query), real)
        self.sums[:, layer] += sums.double().cpu()

    def merge(self, other: CrossAttention) -> None:
        self._check_mergeable(other)
        self.sums += other.sums
        self.queries += other.queries
        self.normalisable += other.normalisable

    def _tables(self) -> dict[str, pd.DataFrame]:
        """``cross_attention``: one row per decoder (layer, head), means over real positions."""
        from probe.capture.head_weights import iter_head_weights
        from probe.weights.spectra import spectra

        L, H = self.n_layers, self.n_heads
        means = (self.sums.flatten(1) / max(self.queries, 1)).numpy()
        means[METRICS.index("entropy_normalised")] *= self.queries / max(self.normalisable, 1)
        layer, head = np.divmod(np.arange(L * H), H)
        table = pd.DataFrame(
            {"layer": layer, "head": head, **dict(zip(METRICS, means, strict=True))}
        )
        table["diagonal"] = table[list(OFFSETS)].sum(axis=1)
        table["queries"] = self.queries
        ranks = spectra(iter_head_weights(self.context.model, ATTENTION)).pivot_table(
            index=["layer", "head"], columns="circuit", values="effective_rank"
        )
        table["qk_effective_rank"] = ranks["QK"].to_numpy()
        table["ov_effective_rank"] = ranks["OV"].to_numpy()
        return {"cross_attention": table}

    plots = (
        Plot("heads", "Cross-attention per decoder head", "analyses.paper:cross_heads",
             page=lambda tables: heatmaps(tables), needs=("cross_attention",),
             panels=({"column": "diagonal"}, {"column": "entropy_normalised"}), width="page"),
    )  # fmt: skip

    @classmethod
    def section(cls, tables: dict[str, pd.DataFrame], run: dict) -> dict:
        table = tables["cross_attention"]
        per_layer = table.groupby("layer")[["entropy_normalised", "diagonal", "max_at_predicted"]]
        best = table.loc[table.diagonal.idxmax()] if len(table) else None
        return {
            "layers": per_layer.mean().reset_index().to_dict("records"),
            "best": None if best is None else best.to_dict(),
            "queries": int(table.queries.iloc[0]) if len(table) else 0,
        }


def heatmaps(tables: dict[str, pd.DataFrame]) -> Figure:
    """The heatmaps of cross-attention, as inline SVG."""
    table = tables["cross_attention"]
    alt = (
        "Two decoder layer-by-head heatmaps: the share of cross-attention within one "
        "position of the diagonal, and the normalised entropy of cross-attention."
    )
    drawings = [
        svg.heatmaps(
            [svg.Grid(f"Cross-attention: {title}",
                      table.pivot(index="layer", columns="head", values=column))],
            vmin=0, vmax=1, anchors=anchors, label=column.replace("_", " "), alt=alt,
            name=f"cross-{column}", size=(300, 170),
        )
        for column, title, anchors in (
            ("diagonal", "weight within one position of the diagonal", svg.MAGMA),
            ("entropy_normalised", "normalised entropy", svg.VIRIDIS),
        )
    ]  # fmt: skip
    title = "Cross-attention per decoder head"
    return Figure("cross-attention", title, alt, "".join(drawings))
