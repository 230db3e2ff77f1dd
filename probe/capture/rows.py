"""Attention patterns in blocks of query rows, so that no T × T pattern need exist whole.

At 32,768 tokens one layer of a 32-head model's pattern is 32 × 32,768² floats: 128 GiB. Here
the model runs its own fast kernel (``sdpa``) while the queries and keys that meet in its scores
(after the rotary embedding and any norms) are captured beside it; a layer's pattern is then
computed from them one block of query rows at a time, with the model's own mask:

    pattern[b, h, i, j] = softmax_j(q_i · k_j · scaling + mask[b, i, j])    for i in the block

A causal model's block of rows ``start:stop`` sees keys ``0:stop`` only (and a sliding window's
fewer), so the keys past ``stop`` are never scored. Memory per layer is O(block × T); the block's
size follows a memory budget (``parse_size``, ``block_rows``). Each block's softmax and its rows'
statistics (``RowBlock.summary``, ``top``, ``max_at``, ``received``) come from one pass of the
fused kernel (``probe.capture.fused``), or from torch where it is not built. A receiver that
reads every block may also mix the layer's output from them (p · V, ``Scored.add_output``) and
hand it back: the model then goes on from it, and its sdpa kernel does not compute the same
scores a second time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from probe.capture.architectures import architecture, blocks
from probe.capture.fused import Fused, available, softmax_stats
from probe.errors import ProbeError
from probe.numerics import entropy
from probe.options import parse_size  # noqa: F401 (where users of rows find it)

IMPLEMENTATION = "probe_rows"
# A block holds about this many [batch, head, rows, keys] float32 tensors at once: the scores,
# the pattern, and a consumer's temporaries (a comparison, a product with a mask).
TENSORS_PER_BLOCK = 4
# Within the budget, a block of one layer's rows takes about this many bytes a tensor, for each
# of torch's threads (an operation splits a block's rows among them), but never fewer than
# MIN_ROWS rows a thread: each block costs a few dozen operations whatever its size, and at 32k
# tokens a row of 4 heads is already 512 KiB.
# - Where torch computes the statistics, each a pass over the block, blocks that fit the
#   processor's cache (CACHE_BYTES): a 4k-token input's blocks and entropies took a third of the
#   time they took in blocks of 64 MiB.
# - Where the fused kernel does (``probe.capture.fused``), it reads a block once, and larger
#   blocks (FUSED_BYTES) spare the per-block operations: at 32k tokens, d_head 16, the analysis
#   took 5.2 s in blocks of 32 MiB a thread, 5.6 s in blocks of 8 MiB (the floor 3.1-3.2 s).
CACHE_BYTES = 8 * 2**20
FUSED_BYTES = 32 * 2**20
MIN_ROWS = 16


def block_rows(
    budget: int, batch: int, heads: int, keys: int, per_thread: int = CACHE_BYTES
) -> int:
    """How many query rows a block may hold within ``budget`` bytes (at least one), at most
    about ``per_thread`` bytes of them a tensor for each of torch's threads."""
    row = 4 * batch * heads * max(keys, 1)
    threads = torch.get_num_threads()  # each operation splits a block's rows among them
    cached = max(MIN_ROWS * threads, per_thread * threads // row)
    return max(1, min(budget // (TENSORS_PER_BLOCK * row), cached))


@dataclass(frozen=True)
class RowBlock:
    """One block of a layer's attention pattern: queries ``rows``, keys ``keys`` (every key
    outside ``keys`` has weight 0 for these queries).

    A block made by ``Scored.blocks`` lives in memory the next block reuses: read it before
    asking for the next, and copy what must outlast it.
    """

    rows: slice
    keys: slice
    pattern: torch.Tensor  # [batch, head, rows, keys], float32
    attention: str = "blocks.attn"  # which of the model's attentions (``attentions``)
    # The scores the pattern is the softmax of, [batch, head, rows, keys] (masked keys at the
    # lowest float), when they came with it; ``summary`` shifts them.
    scores: torch.Tensor | None = field(default=None, repr=False)
    # Each query's weight in ``received``, [batch, rows]; None: every query weighs 1.
    queries: torch.Tensor | None = field(default=None, repr=False)
    # The statistics the fused kernel computed with the pattern, when it did
    fused: Fused | None = field(default=None, repr=False)

    @classmethod
    def whole(
        cls,
        pattern: torch.Tensor,
        attention: str = "blocks.attn",
        queries: torch.Tensor | None = None,
    ) -> RowBlock:
        """A whole pattern ``[batch, head, q_pos, k_pos]`` as one block (``queries``: each
        query's weight in ``received``, ``[batch, q_pos]``)."""
        rows, keys = slice(0, pattern.shape[-2]), slice(0, pattern.shape[-1])
        return cls(rows, keys, pattern.float(), attention, queries=queries)

    @cached_property
    def top(self) -> torch.Tensor:
        """Each query's largest weight, ``[batch, head, rows]``."""
        return self.fused.top if self.fused is not None else self.pattern.amax(-1)

    @cached_property
    def received(self) -> torch.Tensor:
        """What each key receives from the block's queries, Σ_i w_i p_ij with w their weights
        (``queries``, else 1): ``[batch, head, keys]``."""
        if self.fused is not None and self.fused.received is not None:
            return self.fused.received
        p = self.pattern
        if self.queries is None:
            return p.sum(-2)
        return (self.queries.to(p.dtype)[:, None, None] @ p).squeeze(-2)

    @cached_property
    def summary(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query's entropy -Σ p log p (nats) and largest weight, ``[batch, head, rows]``.

        From the scores, when the block has them: with s' = s - max s, -Σ p log p =
        log Σ exp s' - Σ p s', and log Σ exp s' = -log max p (the softmax's largest weight is
        1 / Σ exp s'), which spares a logarithm of every weight. The shift keeps it exact: Σ p s
        unshifted loses |max s| · 2⁻²⁴ to rounding, more than a sharp head's whole entropy.
        """
        if self.fused is not None:
            return self.fused.entropy, self.fused.top
        p, s, top = self.pattern, self.scores, self.top
        if s is None:
            return entropy(p), top
        s.sub_(s.amax(-1, keepdim=True))
        return torch.einsum("bhik,bhik->bhi", p, s).neg_().sub_(top.log()), top

    def max_at(self, offsets: Sequence[int], near: torch.Tensor | None = None) -> torch.Tensor:
        """Which of ``offsets`` (relative to each query, consecutive and ascending) holds the
        query's first largest weight, the key ``p.max(-1)`` names: ``[batch, head, rows]``
        long, with ``len(offsets)`` for a key outside them. ``near``: ``at_offsets(offsets)``,
        when the caller has it.

        The first largest weight lies at the first offset that holds ``top``, unless a key
        before the offsets holds it too; that is read from each row's largest weight before its
        offsets (one vectorised maximum, and a b × b corner), for ``max`` with indices reads a
        row one number at a time.
        """
        if self.fused is not None:  # the kernel found each row's first largest weight
            return self._offset_of(self.fused.first, offsets)
        p = self.pattern
        b, K = p.shape[-2:]
        if b >= K:
            # A whole pattern, say: the corner below would be all of it, and torch's max, which
            # names each row's first largest weight, costs less (1.06 ms against 1.42 for a
            # [32, 12, 35, 35] block, 2.38 against 4.60 for [32, 12, 60, 60]).
            top, first = p.max(-1)
            self.__dict__.setdefault("top", top)
            return self._offset_of(first, offsets)
        # each row's first offset, as a column: ``first + r`` for row r; the keys before the
        # first row's (``edge``) come before every row's offsets
        first = self.rows.start + offsets[0] - self.keys.start
        edge = min(max(first, 0), K)
        ahead = p[..., :edge].amax(-1) if edge else None
        if ahead is not None and "top" not in self.__dict__:  # the rest of the row, for ``top``
            rest = p[..., edge:].amax(-1) if edge < K else ahead  # (a maximum is exact)
            self.__dict__["top"] = torch.maximum(ahead, rest)
        top = self.top
        corner = p[..., edge : edge + b]  # row r's keys before its offsets: columns < first + r
        columns = [] if ahead is None else [ahead[..., None]]  # largest weights before offsets
        if corner.shape[-1]:
            after = _not_before(b, corner.shape[-1], first - edge, p.device)
            columns.append(corner.masked_fill(after, -1).amax(-1, keepdim=True))
        near = self.at_offsets(offsets) if near is None else near
        # The first of [before the offsets…, the offsets…, none] that holds ``top``
        held = torch.cat([*columns, near, top[..., None]], -1) == top[..., None]
        return _max_at_answers(len(columns), len(offsets), p.device)[held.byte().argmax(-1)]

    def _offset_of(self, key: torch.Tensor, offsets: Sequence[int]) -> torch.Tensor:
        """Which of ``offsets`` each row's ``key`` (counted in ``keys``) lies at, as ``max_at``
        answers."""
        shift = self.keys.start - self.rows.start - offsets[0]  # key k of row r: k + shift - r
        at = key + (shift - torch.arange(key.shape[-1], device=key.device))
        return at.masked_fill_((at < 0) | (at >= len(offsets)), len(offsets))

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
        return self.at_offsets((offset,))[..., 0]

    def at_offsets(self, offsets: Sequence[int]) -> torch.Tensor:
        """``at_offset`` of each of ``offsets`` at once: ``[batch, head, rows, offset]``."""
        B, H, b, K = self.pattern.shape
        shift = self.rows.start - self.keys.start  # row r's key at offset o: r + o + shift
        index, inside = _near_keys(b, tuple(offsets), -shift, K - shift, self.pattern.device)
        return self.pattern.gather(-1, (index + shift).expand(B, H, b, len(offsets))) * inside


# A long input's blocks share a few shapes: what indexes their near keys is made once for each.
def _near_keys(
    rows: int, offsets: tuple[int, ...], low: int, high: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """For row r and offset o, the key r + o, clamped into ``[low, high)``, ``[rows, offsets]``
    long; and 1.0 where it lies inside, 0.0 where not."""
    wide = max(map(abs, offsets)) + 1  # the bounds as far as these rows and offsets can tell
    return _near_keys_made(rows, offsets, max(low, -wide), min(high, rows + wide), device)


@lru_cache(maxsize=64)
def _near_keys_made(
    rows: int, offsets: tuple[int, ...], low: int, high: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    column = torch.arange(rows, device=device)[:, None] + torch.tensor(offsets, device=device)
    inside = ((column >= low) & (column < high)).float()
    return column.clamp(low, max(high - 1, low)), inside


@lru_cache(maxsize=64)
def _max_at_answers(before: int, offsets: int, device: torch.device) -> torch.Tensor:
    """What ``RowBlock.max_at`` answers for the first column that holds the largest weight:
    ``offsets`` for one of the ``before`` columns of keys before the offsets and for the
    sentinel after them, the offset's own index for one of them."""
    return torch.tensor([offsets] * before + list(range(offsets)) + [offsets], device=device)


@lru_cache(maxsize=64)
def _after(rows: int, keys: int, device: torch.device) -> torch.Tensor:
    """``[rows, keys]``: True where key j lies after query i, both counted from the same place."""
    return torch.ones(rows, keys, dtype=torch.bool, device=device).triu_(1)


@lru_cache(maxsize=64)
def _not_before(rows: int, columns: int, first: int, device: torch.device) -> torch.Tensor:
    """``[rows, columns]``: True where column c is not before row r's first offset, first + r."""
    r, c = torch.arange(rows, device=device)[:, None], torch.arange(columns, device=device)
    return c >= r + first


@dataclass(frozen=True)
class Scored:
    """What meets in one layer's scores, as the model's attention received it."""

    query: torch.Tensor  # [batch, head, q_pos, d_head], rotated where the model rotates
    key: torch.Tensor  # [batch, kv_head, k_pos, d_head]: fewer heads under grouped-query attention
    mask: torch.Tensor | None  # the model's: bool (True: attend) or additive, [batch|1, 1, q, k]
    causal: bool  # query i sees no key after i
    scaling: float
    window: int | None = None  # a sliding window: query i sees keys after i - window only
    value: torch.Tensor | None = None  # [batch, kv_head, k_pos, d_head]: what the weights mix

    def keys_of(self, rows: slice) -> slice:
        """The keys the queries ``rows`` can see."""
        T = self.key.shape[-2]
        if not self.causal:
            return slice(0, T)
        start = 0 if self.window is None else max(0, rows.start - self.window)
        return slice(start, min(rows.stop, T))

    def block(
        self, rows: slice, work: torch.Tensor | None = None, queries: torch.Tensor | None = None
    ) -> RowBlock:
        """The pattern of the queries ``rows``: ``[batch, head, rows, keys]`` in float32, with
        its statistics (``probe.capture.fused``) or its scores; in ``work`` (two such blocks'
        numbers, float32) when given. ``queries``: the rows' weights in ``RowBlock.received``,
        ``[batch, rows]``."""
        keys = self.keys_of(rows)
        q, k = self.query[:, :, rows], self.key[:, :, keys]
        B, H, b, d = q.shape
        G, K = k.shape[1], k.shape[2]  # query head h reads key head h // (H // G)
        n = B * H * b * K
        if work is None:
            work = torch.empty(2, n, device=q.device, dtype=torch.float32)
        scores, pattern = work[0, :n].view(B, H, b, K), work[1, :n].view(B, H, b, K)
        q, k = q.reshape(B * G, H // G * b, d), k.reshape(B * G, K, d).transpose(-1, -2)
        if q.dtype == torch.float32:  # scaled inside the product, into the block's memory
            torch.baddbmm(scores.view(B * G, -1, K), q, k, beta=0, alpha=self.scaling,
                          out=scores.view(B * G, -1, K))  # fmt: skip
        else:  # as the eager attention: the product in the model's dtype
            scores.view(B * G, -1, K).copy_(q @ k).mul_(self.scaling)
        lowest = torch.finfo(scores.dtype).min
        if self.mask is not None:
            mask = self.mask[:, :, rows, keys]
            if mask.dtype == torch.bool:  # as the eager mask: the lowest float, not -inf
                scores.masked_fill_(~mask, lowest)
            else:  # no -inf, whose product with a weight of 0 is NaN (``RowBlock.summary``)
                scores.add_(mask).clamp_(min=lowest)
        elif self.causal:  # only the keys from the block's first query on lie after a query
            later = scores[..., rows.start - keys.start :]
            later.masked_fill_(_after(b, later.shape[-1], q.device), lowest)
        stats = softmax_stats(scores, scores, queries)  # the pattern over its scores
        if stats is not None:
            return RowBlock(rows, keys, scores, queries=queries, fused=stats)
        torch.softmax(scores, -1, out=pattern)
        return RowBlock(rows, keys, pattern, scores=scores, queries=queries)

    def output(self) -> torch.Tensor:
        """An empty attention output, ``[batch, q_pos, head, d_head]`` in the value's dtype (the
        layout the model's attention function returns), for ``add_output`` to fill."""
        B, H, T, _ = self.query.shape
        return self.value.new_empty(B, T, H, self.value.shape[-1])

    def add_output(self, block: RowBlock, out: torch.Tensor) -> None:
        """Write the block's rows of the attention output, pattern · V, into ``out``: the
        layer's output from the blocks already in hand, in place of a second attention kernel
        over the same scores. It equals sdpa's to its rounding (the weights are summed in
        another order), and a masked key's weight is exactly 0, as in sdpa."""
        B, H, b, K = block.pattern.shape
        G = self.value.shape[1]  # query head h reads value head h // (H // G)
        v = self.value[:, :, block.keys].float()
        mixed = torch.bmm(block.pattern.reshape(B * G, H // G * b, K), v.reshape(B * G, K, -1))
        out[:, block.rows] = mixed.view(B, H, b, -1).transpose(1, 2)

    def blocks(self, budget: int, queries: torch.Tensor | None = None) -> Iterator[RowBlock]:
        """The whole pattern in blocks of rows that fit in ``budget`` bytes, in order, each in
        the memory of the one before. ``queries``: each query's weight in the blocks'
        ``received``, ``[batch, q_pos]``."""
        B, H, T, _ = self.query.shape
        per_thread = FUSED_BYTES if available(self.query.device) else CACHE_BYTES
        size = min(block_rows(budget, B, H, self.key.shape[-2], per_thread), T)
        work = torch.empty(2, B * H * size * self.key.shape[-2], device=self.query.device,
                           dtype=torch.float32)  # fmt: skip
        for start in range(0, T, size):
            rows = slice(start, min(start + size, T))
            yield self.block(rows, work, None if queries is None else queries[:, rows])


def rows_unsupported(model: nn.Module) -> str | None:
    """Why ``model``'s patterns cannot be computed in rows beside its sdpa kernel, or None."""
    from probe.capture.spec import describe

    return describe(model).rows_unsupported


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
    """What meets in the scores, handed on; then the model's own sdpa attention, unless the
    receiver gave the output from the pattern's blocks (``Scored.add_output``)."""
    receive = _RECEIVERS.get(id(module))
    if receive is None:
        raise RuntimeError("the 'probe_rows' attention runs only inside probe.capture.rows.scored")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    # As sdpa decides: a module is causal unless it says otherwise, and a mask, when there is
    # one, says everything.
    causal = bool(getattr(module, "is_causal", True)) and query.shape[2] > 1
    window = int(sliding_window) if sliding_window else None
    mixes = dropout == 0.0 or not module.training  # p·V is the output only without dropout
    what = Scored(query, key, attention_mask, causal, scaling, window, value if mixes else None)
    output = receive(module, what)
    if output is not None:
        return output, None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, sliding_window=sliding_window,
                                  **kwargs)  # fmt: skip


AttentionInterface.register(IMPLEMENTATION, rows_attention)
AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


@contextmanager
def scored(
    model: nn.Module, receive: Callable[[int, Scored], torch.Tensor | None]
) -> Iterator[None]:
    """Run ``model`` on sdpa, calling ``receive(layer, scored)`` as each layer of its (first)
    attention meets its queries and keys; the model's implementation is restored on exit.
    Where ``receive`` returns the layer's attention output (``Scored.add_output``), the layer
    goes on from it, and sdpa is not run.

    Layers are counted from 0 in the order of ``probe.capture.architectures.blocks``; a module
    shared by several layers (ALBERT) is told apart by its call order within a forward pass.
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

    def hand_on(module: nn.Module, what: Scored) -> torch.Tensor | None:
        served = layers[id(module)]
        n = calls.get(id(module), 0)
        calls[id(module)] = n + 1
        return receive(served[n % len(served)], what)

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
