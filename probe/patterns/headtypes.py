"""Head types scored from attention patterns on repeated sequences, and attention sinks.

On a sequence of a BOS at position 0, then n tokens r_1…r_n at 1…n, then the same n tokens again
at n+1…2n, a head's attention A (rows: queries, columns: keys) gives, per sequence:

- ``previous_token`` = mean over queries i = 1…2n of A[i, i−1] (Elhage et al. 2021);
- ``duplicate_token`` = mean over second-copy queries i = n+1…2n of A[i, i−n], the earlier
  copy of the same token (Wang et al. 2022);
- ``induction`` = mean over second-copy queries of A[i, i−n+1], the token that followed the
  earlier copy (Olsson et al. 2022).

On a null sequence (the second half fresh random tokens) the same offsets measure what the head
gives those positions without a repeat: the duplicate-token and induction scores' nulls. The
previous token is the previous token on a null sequence too, so a previous-token head scores the
same there and that null would equal its score by construction; its null is instead
``uniform_previous``: what a head attending uniformly over the keys it sees gives the previous
position, averaged over the same queries. ``sink_alpha`` is Gu et al.'s (2024) α for the first
position: the mean attention to key 0 over the queries that see it, on a text's first 64 tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import pandas as pd
    from torch import nn

    from probe.capture.rows import RowBlock

SCORES = ("previous_token", "duplicate_token", "induction")
SINK_TOKENS = 64  # Gu et al. measure α on each text's first 64 tokens


def offset_scores(pattern: torch.Tensor, n: int, start: int = 0) -> torch.Tensor:
    """The three scores of every sequence and head.

    Parameters
    ----------
    pattern : ``[batch, head, q_pos, k_pos]``
        Attention on sequences laid out as the module says (BOS at 0, copies at 1…n and
        n+1…2n; anything after 2n, such as an encoder's [SEP], is ignored).
    n : int
        Tokens in each copy.
    start : int
        Where the BOS is: 1 for an encoder-decoder model's decoder, which reads the sequence
        after its start token (``probe.pipeline.runner.decoder_inputs``); every position moves with
        it.

    Returns
    -------
    ``[batch, 3, head]``
        ``previous_token``, ``duplicate_token``, ``induction`` (the order of ``SCORES``).
    """
    if pattern.shape[-2] < start + 2 * n + 1:
        raise ValueError(f"a pattern of {pattern.shape[-2]} queries has no second copy of {n} "
                         f"tokens after position {start}")  # fmt: skip
    # diagonal(-d) holds A[i, i-d] at index i-d; s = start shifts every query and key
    s = start
    previous = pattern.diagonal(-1, -2, -1)[..., s : s + 2 * n]  # i = s+1…s+2n
    duplicate = pattern.diagonal(-n, -2, -1)[..., s + 1 : s + n + 1]  # i = s+n+1…s+2n
    induction = pattern.diagonal(-(n - 1), -2, -1)[..., s + 2 : s + n + 2]  # i = s+n+1…s+2n
    return torch.stack([previous.mean(-1), duplicate.mean(-1), induction.mean(-1)], 1)


def uniform_previous(n: int, start: int = 0, *, causal: bool, keys: int) -> float:
    """The previous-token score of a head that attends uniformly over the keys it sees: the mean
    over the score's queries i = start+1…start+2n of 1/(i+1) where a query sees itself and the
    keys before it (causal), or of 1/``keys`` where every query sees all ``keys`` keys.

    Parameters
    ----------
    n : int
        Tokens in each copy.
    start : int
        Where the BOS is (as in ``offset_scores``).
    causal : bool
        Whether query i sees keys 0…i only.
    keys : int
        The sequence's length (the keys a non-causal query sees).
    """
    if not causal:
        return 1.0 / keys
    queries = range(start + 1, start + 2 * n + 1)
    return sum(1.0 / (i + 1) for i in queries) / len(queries)


def sink_sums(pattern: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Σ over the real queries among each text's first ``SINK_TOKENS`` of the attention to key 0,
    per head, and how many queries that is (α is their ratio).

    Parameters
    ----------
    pattern : ``[batch, head, q_pos, k_pos]``
    real : ``[batch, pos]`` bool
        The tokens that are not padding (every real query sees key 0, causal or not).
    """
    queries = real[:, :SINK_TOKENS].to(pattern.dtype)  # [B, q]
    first = pattern[:, :, :SINK_TOKENS, 0]  # [B, H, q]
    return (first * queries[:, None]).sum((0, 2)), int(queries.sum())


def offset_sums(block: RowBlock, n: int, start: int = 0) -> torch.Tensor:
    """Per sequence and head, the sums behind ``offset_scores`` over one block of query rows:
    Σ A[i, i-1], Σ A[i, i-n] and Σ A[i, i-n+1] over the block's queries in each score's range
    (every query moved ``start`` right, as in ``offset_scores``). A sequence's scores are the
    sums over all its blocks divided by ``offset_queries(n)``.

    Returns
    -------
    ``[batch, 3, head]``, float32
    """
    # (offset to the key, first and last query + 1), in the order of SCORES
    ranges = ((-1, 1, 2 * n + 1), (-n, n + 1, 2 * n + 1), (1 - n, n + 1, 2 * n + 1))
    rows = torch.arange(block.rows.start, block.rows.stop, device=block.pattern.device) - start
    sums = []
    for offset, first, stop in ranges:
        inside = ((rows >= first) & (rows < stop)).to(block.pattern.dtype)
        sums.append(block.at_offset(offset) @ inside)  # [B, H]
    return torch.stack(sums, 1)


def offset_queries(n: int) -> torch.Tensor:
    """How many queries each of ``SCORES`` is the mean over: ``[3]``."""
    return torch.tensor([2 * n, n, n])


def sink_block_sums(block: RowBlock, real: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``sink_sums`` over one block of query rows: adding the blocks of a pattern gives its
    ``sink_sums``."""
    rows = slice(block.rows.start, min(block.rows.stop, SINK_TOKENS))
    if rows.start >= rows.stop:
        return block.pattern.new_zeros(block.pattern.shape[1]), 0
    queries = real[:, rows].to(block.pattern.dtype)  # [B, q]
    first = block.pattern[:, :, : rows.stop - rows.start, 0]  # [B, H, q]
    if block.keys.start > 0:  # a sliding window that no longer reaches key 0
        first = torch.zeros_like(first)
    return (first * queries[:, None]).sum((0, 2)), int(queries.sum())


def head_types(
    model: nn.Module,
    sequences: torch.Tensor,
    n: int,
    nulls: torch.Tensor | None = None,
    *,
    attention: str | None = None,
) -> pd.DataFrame:
    """Score every head on token sequences you supply, for detectors of your own.

    Parameters
    ----------
    model : nn.Module
        A supported Hugging Face model (or a model with probe's hook points).
    sequences : ``[batch, pos]`` long
        Token ids laid out as the module says: a BOS at 0, then n tokens, then the same n.
    n : int
        Tokens in each copy.
    nulls : ``[batch, pos]`` long, optional
        Sequences of the same shape whose second half is not a repeat: the duplicate-token and
        induction scores' nulls (the previous-token score's null is ``uniform_previous``, which
        needs none).
    attention : str, optional
        Which attention of an encoder-decoder model (``"decoder.attn"``…); default its first.

    Returns
    -------
    pandas.DataFrame
        One row per (layer, head): each of ``SCORES``, its mean over the sequences and, with
        ``nulls``, ``<score>_null``; layers and heads 0-based. ``previous_token_null`` is
        ``uniform_previous`` (for a model without a config, one that reads every key causally).
    """
    import pandas as pd

    from probe.capture import arguments
    from probe.capture.hookpoints import trace
    from probe.capture.names import Attention
    from probe.capture.spec import describe
    from probe.pipeline.runner import decoder_inputs

    arguments.module(model, "head_types")
    sequences = arguments.token_ids(model, sequences, "sequences")
    arguments.whole_number(n, "n", at_least=1)
    arguments.repeated(sequences, n)
    if nulls is not None:
        nulls = arguments.token_ids(model, nulls, "nulls")
        arguments.same_shape(nulls, sequences, "nulls")
    start = int(attention == Attention.DECODER)
    described = describe(model) if getattr(model, "config", None) is not None else None
    encoder_decoder = described is not None and described.encoder_decoder
    causal = described is None or (
        attention == Attention.DECODER if encoder_decoder else described.causal
    )

    def scores(ids: torch.Tensor) -> torch.Tensor:  # [layer, 3, head]
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if encoder_decoder:
            inputs = decoder_inputs(model, inputs)
        with torch.inference_mode(), trace(model, "hook_pattern") as cache:
            model(**inputs)
        stacked = cache.stack("hook_pattern", attention=attention)  # [layer, B, H, T, T]
        return torch.stack([offset_scores(p.float(), n, start).mean(0) for p in stacked])

    found = scores(sequences)
    L, _, H = found.shape
    table = pd.DataFrame({"layer": torch.arange(L).repeat_interleave(H).numpy(),
                          "head": torch.arange(H).repeat(L).numpy()})  # fmt: skip
    null = scores(nulls) if nulls is not None else None
    uniform = uniform_previous(n, start, causal=causal, keys=sequences.shape[1])
    for k, score in enumerate(SCORES):
        table[score] = found[:, k].flatten().double().numpy()
        if null is not None:
            table[f"{score}_null"] = null[:, k].flatten().double().numpy()
    if null is not None:
        table["previous_token_null"] = uniform
    return table
