"""One long input's attention from Python, without a T × T tensor ever existing.

>>> import probe
>>> rows = probe.attention_rows(model, ids, layer=3, rows=slice(32000, 32064))  # [B, H, 64, T]
>>> table = probe.head_statistics(model, ids)  # one row per (layer, head)

Both run the model on its sdpa kernel and compute patterns from each layer's queries and keys in
blocks of query rows (``probe.capture.rows``).
"""

from __future__ import annotations

from contextlib import suppress

import pandas as pd
import torch
from torch import nn

from probe.capture import arguments
from probe.capture.architectures import check_length
from probe.capture.rows import RowBlock, Scored, scored
from probe.capture.spec import describe
from probe.errors import ProbeError
from probe.options import ATTENTION_BUDGET, parse_size

STATISTICS = ("entropy", "confidence", "first", "self", "previous", "distance")


class _Stop(Exception):  # noqa: N818 (a signal, not an error)
    """Raised once the layers asked for have been read: the rest of the forward pass is spared."""


def _inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> dict:
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    return {"input_ids": input_ids, "attention_mask": mask.reshape(input_ids.shape)}


def _checked(model: nn.Module, input_ids, attention_mask, function: str) -> tuple:
    """The arguments both functions take, checked at the door (``probe.capture.arguments``): the ids
    and mask as long ``[batch, pos]``."""
    arguments.module(model, function)
    ids = arguments.token_ids(model, input_ids)
    return ids, arguments.attention_mask(attention_mask, ids)


def _run(model: nn.Module, inputs: dict, receive, last: int) -> None:
    def hand_on(layer: int, what: Scored) -> None:
        receive(layer, what)
        if layer == last:
            raise _Stop

    check_length(model, inputs["input_ids"].shape[-1])
    device = next(model.parameters()).device
    with torch.inference_mode(), scored(model, hand_on), suppress(_Stop):
        model(**{k: v.to(device) for k, v in inputs.items()})


def attention_rows(
    model: nn.Module,
    input_ids: torch.Tensor,
    layer: int,
    rows: slice,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The attention of the queries ``rows`` of one layer, every head.

    Parameters
    ----------
    model : nn.Module
        A supported Hugging Face model (not encoder-decoder;
        ``probe.capture.rows.rows_unsupported``).
    input_ids : ``[batch, pos]`` or ``[pos]`` long
    layer : int
        0-based.
    rows : slice
        Query positions (``slice(start, stop)``, step 1).
    attention_mask : ``[batch, pos]``, optional
        1 for real tokens; all real by default.

    Returns
    -------
    ``[batch, head, rows, k_pos]`` float32: the rows of ``blocks.{layer}.attn.hook_pattern``
    (within float32 rounding), keys a query cannot see at 0.
    """
    input_ids, attention_mask = _checked(model, input_ids, attention_mask, "attention_rows")
    arguments.whole_number(layer, "layer")
    arguments.query_rows(rows)
    inputs = _inputs(input_ids, attention_mask)
    T, L = inputs["input_ids"].shape[1], describe(model).n_layers
    start, stop, step = rows.indices(T)
    if not 0 <= layer < L or step != 1 or start >= stop:
        raise ProbeError(
            f"attention_rows takes a layer in 0…{L - 1} and a slice of rows with step 1 within "
            f"{T} positions; got layer {layer}, rows {rows}"
        )
    found: list[torch.Tensor] = []

    def receive(at: int, what: Scored) -> None:
        if at == layer:
            found.append(what.block(slice(start, stop)).full(T))

    _run(model, inputs, receive, layer)
    return found[0]


def head_statistics(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    budget: str = ATTENTION_BUDGET,
) -> pd.DataFrame:
    """Per head, means over the real queries of statistics of its attention, streamed in blocks
    of query rows (memory O(block × T) per layer, the block within ``budget``).

    Returns
    -------
    pandas.DataFrame
        One row per (layer, head), 0-based: ``entropy`` (nats), ``confidence`` (the largest
        weight), ``first`` (the weight on position 0, the sink), ``self``, ``previous`` (on
        the token before), ``distance`` (Σ_j p_ij |i - j|, tokens), and ``queries``.
    """
    input_ids, attention_mask = _checked(model, input_ids, attention_mask, "head_statistics")
    inputs = _inputs(input_ids, attention_mask)
    size, L = parse_size(budget, "budget"), describe(model).n_layers
    real = inputs["attention_mask"].bool()
    sums = torch.zeros(L, 0, dtype=torch.float64)

    def receive(layer: int, what: Scored) -> None:
        nonlocal sums
        for block in what.blocks(size):
            added = _sums(block, real.to(block.pattern.device))  # [statistic, head]
            if not sums.shape[1]:
                sums = torch.zeros(L, *added.shape, dtype=torch.float64)
            sums[layer] += added.double().cpu()

    _run(model, inputs, receive, L - 1)
    H, queries = sums.shape[-1], int(real.sum())
    means = (sums / queries).permute(0, 2, 1).reshape(L * H, -1).numpy()
    table = pd.DataFrame(means, columns=list(STATISTICS))
    table.insert(0, "head", [h for _ in range(L) for h in range(H)])
    table.insert(0, "layer", [layer for layer in range(L) for _ in range(H)])
    table["queries"] = queries
    return table


def _sums(block: RowBlock, real: torch.Tensor) -> torch.Tensor:
    """Σ over the block's real queries of each of ``STATISTICS``: ``[statistic, head]``."""
    p = block.pattern  # [B, H, rows, keys]
    query = torch.arange(block.rows.start, block.rows.stop, device=p.device)
    key = torch.arange(block.keys.start, block.keys.stop, device=p.device)
    first = p[..., 0] if block.keys.start == 0 else torch.zeros_like(p[..., 0])
    distance = (p * (query[:, None] - key[None]).abs().to(p.dtype)).sum(-1)  # [B, H, rows]
    entropies, top = block.summary
    per_query = torch.stack([entropies, top, first, block.at_offset(0), block.at_offset(-1),
                             distance])  # fmt: skip
    weights = real[:, block.rows].to(p.dtype)  # [B, rows]
    return (per_query * weights[None, :, None]).sum((1, 3))
