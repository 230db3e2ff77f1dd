"""Prompt pairs, as patching, attribution and edges take them: a clean and a corrupted batch of the
same shape, a metric read per pair, and means with 95% intervals over the pairs.

A metric is ``metric(output)`` of the model's output on a batch of pairs, and returns one value
per pair (``[batch]``) or, for a single pair, a scalar. Patching stacks several patched copies of
the batch along the batch dimension; the metric is then read from each copy's rows of the output
(``copies_of``), so a metric written for the user's batch works unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from probe.errors import ProbeError
from probe.inference import t975

Metric = Callable[[Any], torch.Tensor | float]


def check_pairs(clean: Mapping[str, Any], corrupted: Mapping[str, Any]) -> int:
    """The number of pairs, after checking that ``clean`` and ``corrupted`` match.

    Raises
    ------
    ProbeError
        Where their keyword arguments, a tensor's shape, or the padding (``attention_mask``)
        differ: positions are patched one to one.
    """
    if set(clean) != set(corrupted):
        raise ProbeError(
            f"clean and corrupted need the same arguments; got {sorted(clean)} and "
            f"{sorted(corrupted)}"
        )
    sizes = set()
    for key, value in clean.items():
        other = corrupted[key]
        if isinstance(value, torch.Tensor) != isinstance(other, torch.Tensor):
            raise ProbeError(f"{key}: a tensor in one of clean and corrupted but not the other")
        if not isinstance(value, torch.Tensor):
            continue
        if value.shape != other.shape:
            raise ProbeError(
                f"clean and corrupted {key} differ in shape ({tuple(value.shape)} and "
                f"{tuple(other.shape)}); pairs need inputs of the same length (pad them alike)"
            )
        if "mask" in key and not torch.equal(value, other):
            raise ProbeError(
                f"clean and corrupted {key} differ: pad each pair alike, so that positions "
                "are patched one to one"
            )
        if value.dim():
            sizes.add(value.shape[0])
    if len(sizes) > 1:
        raise ProbeError(f"the inputs' batch sizes differ: {sorted(sizes)}")
    return sizes.pop() if sizes else 1


def stacked(inputs: Mapping[str, Any], copies: int, pairs: int) -> dict[str, Any]:
    """``inputs`` repeated ``copies`` times along the batch: copy c is rows c·pairs…(c+1)·pairs."""
    if copies == 1:
        return dict(inputs)
    return {
        key: value.repeat(copies, *(1,) * (value.dim() - 1))
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == pairs
        else value
        for key, value in inputs.items()
    }


def copies_of(output: Any, copies: int, pairs: int) -> list[Any]:
    """Each copy's rows of a model's output whose batch is ``copies`` stacked copies of ``pairs``
    rows: tensors, tuples and ``ModelOutput``s split along the batch; other objects (a key-value
    cache) become None, so that a metric cannot read another copy's rows by mistake.

    One split per tensor, not a slice per copy: a gradient through the copies' metrics then
    meets in one concatenation, not in a zero-filled tensor of the whole batch per copy.
    """
    if copies == 1:
        return [output]
    total = copies * pairs
    if isinstance(output, torch.Tensor):
        if output.dim() and output.shape[0] == total:
            return list(output.split(pairs))
        return [output] * copies
    if isinstance(output, Mapping):
        parts = {k: copies_of(v, copies, pairs) for k, v in output.items()}
        return [type(output)(**{k: v[c] for k, v in parts.items()}) for c in range(copies)]
    if isinstance(output, tuple | list):
        split = [copies_of(v, copies, pairs) for v in output]
        return [type(output)(v[c] for v in split) for c in range(copies)]
    if output is None or isinstance(output, int | float | bool | str):
        return [output] * copies
    return [None] * copies


def per_pair(value: Any, pairs: int, *, differentiable: bool = False) -> torch.Tensor:
    """A metric's value as ``[pairs]`` float (one value per pair), checked.

    Raises
    ------
    ProbeError
        For a value that is neither a scalar (with one pair) nor one per pair, or, with
        ``differentiable``, one that carries no gradient.
    """
    if differentiable and not (isinstance(value, torch.Tensor) and value.requires_grad):
        raise ProbeError(
            "the metric is not differentiable: return a tensor computed from the model's output "
            "(no .item(), float(), argmax or comparisons)"
        )
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.tensor(float(value))
        except (TypeError, ValueError):
            raise ProbeError(
                f"the metric returned a {type(value).__name__}; return a scalar tensor or one "
                "value per pair"
            ) from None
    if value.dim() == 0 and pairs == 1:
        return value.reshape(1)
    if value.shape != (pairs,):
        raise ProbeError(
            f"the metric returned shape {tuple(value.shape)}; with {pairs} pairs it must return "
            f"one value per pair, shape ({pairs},)"
        )
    return value


def mean_interval(values: torch.Tensor) -> tuple[float, float, float]:
    """Mean over the last dimension and its 95% t-interval (NaN for one value)."""
    values = values.double()
    n = values.shape[-1]
    mean = float(values.mean())
    if n < 2:
        return mean, math.nan, math.nan
    half = t975(n - 1) * float(values.std()) / math.sqrt(n)
    return mean, mean - half, mean + half


def mean_intervals(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Means over the last dimension of ``[..., pairs]`` with their 95% t-intervals."""
    values = values.double()
    n = values.shape[-1]
    mean = values.mean(-1)
    if n < 2:
        nan = torch.full_like(mean, math.nan)
        return mean, nan, nan
    half = t975(n - 1) * values.std(-1) / math.sqrt(n)
    return mean, mean - half, mean + half
