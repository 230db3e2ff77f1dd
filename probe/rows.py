"""Attention patterns in blocks of query rows, so that no T × T pattern need exist whole.

At 32,768 tokens one layer of a 32-head model's pattern is 32 × 32,768² floats: 128 GiB. Here
the model runs its own fast kernel (``sdpa``) while the queries and keys that meet in its scores
(after the rotary embedding and any norms) are captured beside it; a layer's pattern is then
computed from them one block of query rows at a time, with the model's own mask:

    pattern[b, h, i, j] = softmax_j(q_i · k_j · scaling + mask[b, i, j])    for i in the block

A causal model's block of rows ``start:stop`` sees keys ``0:stop`` only (and a sliding window's
fewer), so the keys past ``stop`` are never scored. Memory per layer is O(block × T); the block's
size follows a memory budget (``parse_size``, ``block_rows``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from probe.architectures import architecture, blocks, is_encoder_decoder
from probe.errors import ProbeError
from probe.sizes import parse_size  # noqa: F401 (where users of rows find it)

IMPLEMENTATION = "probe_rows"
# A block holds about this many [batch, head, rows, keys] float32 tensors at once: the scores,
# the pattern, and a consumer's temporaries (entropy's p·log p, a product with a mask).
TENSORS_PER_BLOCK = 4


def block_rows(budget: int, batch: int, heads: int, keys: int) -> int:
    """How many query rows a block may hold within ``budget`` bytes (at least one)."""
    per_row = TENSORS_PER_BLOCK * 4 * batch * heads * max(keys, 1)
    return max(1, budget // per_row)


@dataclass(frozen=True)
class RowBlock:
    """One block of a layer's attention pattern: queries ``rows``, keys ``keys`` (every key
    outside ``keys`` has weight 0 for these queries)."""

    rows: slice
    keys: slice
    pattern: torch.Tensor  # [batch, head, rows, keys], float32
    attention: str = "blocks.attn"  # which of the model's attentions (``attentions``)

    @classmethod
    def whole(cls, pattern: torch.Tensor, attention: str = "blocks.attn") -> RowBlock:
        """A whole pattern ``[batch, head, q_pos, k_pos]`` as one block."""
        rows, keys = slice(0, pattern.shape[-2]), slice(0, pattern.shape[-1])
        return cls(rows, keys, pattern.float(), attention)

    def full(self, length: int) -> torch.Tensor:
        """The block's rows over all ``length`` keys ``[batch, head, rows, length]`` (zeros
        outside ``keys``)."""
        if self.keys == slice(0, length):
            return self.pattern
        out = self.pattern.new_zeros(*self.pattern.shape[:-1], length)
        out[..., self.keys] = self.pattern
        return out

    def at_offset(self, offset: int) -> torch.Tensor:
        """Each query's weight on the key ``offset`` after it (before it, when negative),
        ``[batch, head, rows]``: 0 where that key is not among ``keys``."""
        B, H, b, K = self.pattern.shape
        query = torch.arange(self.rows.start, self.rows.start + b, device=self.pattern.device)
        column = query + offset - self.keys.start
        inside = (column >= 0) & (column < K)
        index = column.clamp(0, max(K - 1, 0)).expand(B, H, b)[..., None]
        return self.pattern.gather(-1, index).squeeze(-1) * inside


@dataclass(frozen=True)
class Scored:
    """What meets in one layer's scores, as the model's attention received it."""

    query: torch.Tensor  # [batch, head, q_pos, d_head], rotated where the model rotates
    key: torch.Tensor  # [batch, kv_head, k_pos, d_head]: fewer heads under grouped-query attention
    mask: torch.Tensor | None  # the model's: bool (True: attend) or additive, [batch|1, 1, q, k]
    causal: bool  # query i sees no key after i
    scaling: float
    window: int | None = None  # a sliding window: query i sees keys after i - window only

    def keys_of(self, rows: slice) -> slice:
        """The keys the queries ``rows`` can see."""
        T = self.key.shape[-2]
        if not self.causal:
            return slice(0, T)
        start = 0 if self.window is None else max(0, rows.start - self.window)
        return slice(start, min(rows.stop, T))

    def block(self, rows: slice) -> RowBlock:
        """The pattern of the queries ``rows``: ``[batch, head, rows, keys]`` in float32."""
        keys = self.keys_of(rows)
        q, k = self.query[:, :, rows], self.key[:, :, keys]
        B, H, b, d = q.shape
        group = H // k.shape[1]  # query heads per key head: h reads key head h // group
        scores = q.reshape(B, k.shape[1], group * b, d) @ k.transpose(-1, -2)
        scores = scores.view(B, H, b, -1).float().mul_(self.scaling)
        if self.mask is not None:
            mask = self.mask[:, :, rows, keys]
            if mask.dtype == torch.bool:  # as the eager mask: the lowest float, not -inf
                scores.masked_fill_(~mask, torch.finfo(scores.dtype).min)
            else:
                scores.add_(mask)
        elif self.causal:
            query = torch.arange(rows.start, rows.start + b, device=q.device)[:, None]
            key = torch.arange(keys.start, keys.stop, device=q.device)[None]
            scores.masked_fill_(key > query, torch.finfo(scores.dtype).min)
        return RowBlock(rows, keys, F.softmax(scores, dim=-1))

    def blocks(self, budget: int) -> Iterator[RowBlock]:
        """The whole pattern in blocks of rows that fit in ``budget`` bytes, in order."""
        B, H, T, _ = self.query.shape
        size = block_rows(budget, B, H, self.key.shape[-2])
        for start in range(0, T, size):
            yield self.block(slice(start, min(start + size, T)))


def rows_unsupported(model: nn.Module) -> str | None:
    """Why ``model``'s patterns cannot be computed in rows beside its sdpa kernel, or None."""
    if is_encoder_decoder(model):
        return "an encoder-decoder model's three attentions are read whole"
    config = getattr(model, "config", None)
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "sdpa cannot soft-cap the scores (Gemma 2)"
    if getattr(config, "model_type", "") in ("t5", "mt5"):
        return "T5's position bias is read whole"
    return None


_RECEIVERS: dict[int, Callable[[nn.Module, Scored], None]] = {}  # id(attention) -> its receiver


def rows_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """The model's own sdpa attention, with what meets in its scores handed on beside it."""
    receive = _RECEIVERS.get(id(module))
    if receive is None:
        raise RuntimeError("the 'probe_rows' attention runs only inside probe.rows.scored")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    # As sdpa decides: a module is causal unless it says otherwise, and a mask, when there is
    # one, says everything.
    causal = bool(getattr(module, "is_causal", True)) and query.shape[2] > 1
    window = int(sliding_window) if sliding_window else None
    receive(module, Scored(query, key, attention_mask, causal, scaling, window))
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, sliding_window=sliding_window,
                                  **kwargs)  # fmt: skip


AttentionInterface.register(IMPLEMENTATION, rows_attention)
AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


@contextmanager
def scored(model: nn.Module, receive: Callable[[int, Scored], None]) -> Iterator[None]:
    """Run ``model`` on sdpa, calling ``receive(layer, scored)`` as each layer of its (first)
    attention meets its queries and keys; the model's implementation is restored on exit.

    Layers are counted from 0 in the order of ``probe.architectures.blocks``; a module shared by
    several layers (ALBERT) is told apart by its call order within a forward pass.
    """
    why = rows_unsupported(model)
    if why is not None:
        raise ProbeError(f"attention in rows is not available for this model: {why}")
    base = getattr(model, "base_model", model)
    path = architecture(model).attention
    layers: dict[int, list[int]] = {}
    for layer, block in enumerate(blocks(model)):
        layers.setdefault(id(block.get_submodule(path)), []).append(layer)
    calls: dict[int, int] = {}

    def hand_on(module: nn.Module, what: Scored) -> None:
        served = layers[id(module)]
        n = calls.get(id(module), 0)
        calls[id(module)] = n + 1
        receive(served[n % len(served)], what)

    modules = {id(m): m for m in base.modules() if id(m) in layers}
    handle = base.register_forward_pre_hook(lambda *_: calls.clear())
    previous = model.config._attn_implementation
    _RECEIVERS.update(dict.fromkeys(modules, hand_on))
    try:
        model.set_attn_implementation(IMPLEMENTATION)
        yield
    finally:
        model.set_attn_implementation(previous)
        handle.remove()
        for key in modules:
            _RECEIVERS.pop(key, None)
