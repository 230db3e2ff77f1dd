"""Prompt pairs, as patching, attribution and edges take them: a clean and a corrupted batch of the
same shape, a metric read per pair or over the batch, and means with 95% intervals over the pairs.

The contract is TransformerLens's. A batch is the model's keyword arguments (a dict) or a tensor
of token ids ``[batch, pos]``. A metric is ``metric(logits)`` where the model's output has
logits (a Hugging Face model with its LM head), else ``metric(output)`` of what the model
returns (an encoder's ``BaseModelOutput``, ``probe.MultiHeadAttention``'s tensor). It returns
one value per pair (``[batch]``), which gives every estimate an interval over the pairs, or a
scalar for the whole batch (TransformerLens's batch mean), which gives the same estimates
without intervals: an effect on a scalar is the effect of patching every pair at once, and the
mean of per-pair effects is the effect on their mean. Results say which in ``attrs["metric"]``.

Patching stacks several patched copies of the batch along the batch dimension; the metric is
then read from each copy's rows of the output (``copies_of``), so a metric written for the
user's batch works unchanged.

Memory is bounded by a budget (``max_bytes``; by default a share, ``gradients.FREE_SHARE``, of the
memory free on the model's device, ``gradients.memory_budget``), not by the number of pairs: where
the pairs' runs do not fit it at once, they run a chunk of pairs at a time (``chunks``), and the
means and intervals over the pairs are running sums (``Moments``), the same to float rounding. A
metric is then given a chunk's logits, so it must say which pairs they are to read per-pair data of
its own (answers, positions): one that takes a parameter ``pairs`` is called ``metric(logits,
pairs=rows)``, ``rows`` the slice of the batch's pairs the logits hold (every pair where they fit
at once). A metric of the logits alone is given every pair at once, and a scalar metric cannot be
split: either, where the pairs do not fit, is refused in one line, never run on part of the batch.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import math
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from probe.errors import ProbeError
from probe.inference import t_interval

Metric = Callable[[Any], torch.Tensor | float]
Batch = Mapping[str, Any] | torch.Tensor

PER_PAIR, SCALAR = "per pair", "scalar"  # attrs["metric"]: the form the metric returned


# Keyword arguments that are one row a sequence of token positions: [batch, pos].
PER_TOKEN = ("input_ids", "attention_mask", "token_type_ids", "position_ids")


def as_pairs(
    clean: Batch, corrupted: Batch, model: Any = None
) -> tuple[dict[str, Any], dict[str, Any], int]:
    """The pairs as the model's keyword arguments, and their number, checked (``check_pairs``;
    with ``model``, token ids within its vocabulary too, ``check_ids``).

    A tensor of token ids ``[batch, pos]`` (TransformerLens's ``tokens``) becomes
    ``{"input_ids": tokens}``; a dict is taken as it is.
    """
    clean, corrupted = _keywords(clean, "clean"), _keywords(corrupted, "corrupted")
    for batch, side in ((clean, "clean"), (corrupted, "corrupted")):
        for key in PER_TOKEN:
            value = batch.get(key)
            if isinstance(value, torch.Tensor) and value.dim() != 2:
                raise ProbeError(
                    f"{side}[{key!r}] has shape {tuple(value.shape)}; it must be [batch, pos] "
                    f"(one sequence: add the batch dimension, {key}[None])"
                )
    pairs = check_pairs(clean, corrupted)
    if model is not None:
        for batch, side in ((clean, "clean"), (corrupted, "corrupted")):
            check_ids(model, batch, side)
    return clean, corrupted, pairs


def check_ids(model: Any, batch: Mapping[str, Any], side: str) -> None:
    """Refuse token ids outside the model's vocabulary (its input embedding's rows), which
    would fail deep inside the model as an ``IndexError``.

    Raises
    ------
    ProbeError
        Naming the argument, the id and the vocabulary's size.
    """
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or not ids.numel():
        return
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocabulary = getattr(embedding, "num_embeddings", None)
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ProbeError(f"{side}['input_ids'] must hold integer token ids, not {ids.dtype}")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (vocabulary is not None and high >= vocabulary):
        bad = low if low < 0 else high
        within = f"0 … {vocabulary - 1}" if vocabulary is not None else "non-negative"
        raise ProbeError(
            f"{side}['input_ids'] holds token id {bad}, outside the model's vocabulary "
            f"({within}): tokenize with the model's own tokenizer"
        )


def _keywords(batch: Batch, side: str) -> dict[str, Any]:
    if isinstance(batch, Mapping):
        return dict(batch)
    if isinstance(batch, torch.Tensor):
        if batch.is_floating_point() or batch.is_complex() or batch.dim() != 2:
            raise ProbeError(
                f"{side}: a tensor must hold token ids, [batch, pos] integers; got "
                f"{str(batch.dtype).removeprefix('torch.')} of shape {tuple(batch.shape)}. "
                "Pass other inputs as a dict of the model's keyword arguments"
            )
        return {"input_ids": batch}
    raise ProbeError(
        f"{side}: pass a dict of the model's keyword arguments or a tensor of token ids "
        f"[batch, pos], not a {type(batch).__name__}"
    )


def takes_pairs(metric: Metric) -> bool:
    """Whether ``metric`` takes a parameter ``pairs`` (the slice of pairs it is given): an
    ``nn.Module``'s ``forward`` is what it is called with, its ``__call__`` takes anything."""
    target = metric.forward if isinstance(metric, torch.nn.Module) else metric
    try:
        return "pairs" in inspect.signature(target).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def read(
    metric: Metric,
    output: Any,
    pairs: int,
    *,
    differentiable: bool = False,
    rows: slice | None = None,
) -> torch.Tensor:
    """The metric of a model's ``output`` on ``pairs`` pairs: ``[pairs]``, or ``[1]`` for a scalar
    over the batch (``per_pair``). It is given the logits where the output has them, and
    ``pairs=rows`` (the batch's pairs they hold; all by default) where it takes ``pairs``."""
    logits = getattr(output, "logits", None)
    seen = logits if isinstance(logits, torch.Tensor) else output
    try:
        if takes_pairs(metric):
            value = metric(seen, pairs=slice(0, pairs) if rows is None else rows)
        else:
            value = metric(seen)
    except ProbeError:
        raise
    except Exception as error:  # the user's code: say where, in one line
        if isinstance(error, AttributeError) and seen is not output and "'Tensor'" in str(error):
            raise ProbeError(
                f"the metric is given the logits, [batch, pos, vocab], as in TransformerLens, "
                f"not the model's output object ({error}); write metric(logits)"
            ) from None
        if isinstance(error, AttributeError) and seen is output and _of_tensors(error):
            raise ProbeError(
                f"the metric reads .{error.name} of the model's output, a "
                f"{type(output).__name__}, which has no logits: load the model with its LM head "
                "(probe.load(name, lm_head=True), or --lm-head) and write metric(logits)"
            ) from None
        given = f"logits {list(seen.shape)}" if seen is logits else type(seen).__name__
        raise ProbeError(
            f"the metric raised {type(error).__name__}: {error}{_where(error)}; it was given "
            f"{given}"
        ) from None
    return per_pair(value, pairs, differentiable=differentiable)


def _of_tensors(error: AttributeError) -> bool:
    """Whether ``error`` is a tensor's attribute (``log_softmax``, ``argmax``) read from an object
    that is not one: a metric written for logits, given an encoder's output object."""
    name = getattr(error, "name", None)
    return isinstance(name, str) and hasattr(torch.Tensor, name)


def _where(error: Exception) -> str:
    """`` at FILE:LINE``: the last frame of the metric's traceback."""
    frames = traceback.extract_tb(error.__traceback__)
    return f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""


def form(values: torch.Tensor, pairs: int) -> str:
    """``PER_PAIR`` or ``SCALAR``: what ``values`` (``[..., pairs]`` or ``[..., 1]`` from
    ``read``) say the metric returned."""
    return SCALAR if pairs > 1 and values.shape[-1] == 1 else PER_PAIR


def same_form(values: list[torch.Tensor], pairs: int) -> str:
    """The one form of several readings of a metric.

    Raises
    ------
    ProbeError
        Where the metric returned one value per pair on some runs and a scalar on others.
    """
    forms = {form(v, pairs) for v in values}
    if len(forms) > 1:
        raise ProbeError(
            "the metric returned one value per pair on some runs and a scalar on others; "
            "return the same form for every batch"
        )
    return forms.pop() if forms else PER_PAIR


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
    pairs = sizes.pop() if sizes else 1
    if pairs == 0:
        raise ProbeError("clean and corrupted hold no pairs (batch size 0); give at least one")
    return pairs


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
    """A metric's value as float ``[pairs]`` (one value per pair), or ``[1]`` for a scalar over a
    batch of several pairs, checked.

    Raises
    ------
    ProbeError
        For a value that is neither a scalar nor one value per pair, or, with
        ``differentiable``, one that carries no gradient.
    """
    if differentiable and not (isinstance(value, torch.Tensor) and value.requires_grad):
        raise ProbeError(
            "the metric is not differentiable: return a tensor computed from the model's output "
            "(no .item(), float(), argmax or comparisons)"
        )
    if not isinstance(value, torch.Tensor):
        try:
            if isinstance(value, str | bytes):  # float("0.5") reads it; a metric returns numbers
                raise TypeError
            value = torch.tensor(float(value))
        except (TypeError, ValueError):
            raise ProbeError(
                f"the metric returned a {type(value).__name__}; return a scalar tensor or one "
                "value per pair"
            ) from None
    if value.dim() == 0:
        value = value.reshape(1)
    elif value.shape != (pairs,):
        raise ProbeError(
            f"the metric returned shape {tuple(value.shape)}; with {pairs} pairs it must return "
            f"one value per pair, shape ({pairs},), or a scalar"
        )
    if value.is_complex():
        raise ProbeError("the metric returned complex numbers; return real values")
    if not value.is_floating_point():  # counts, or flags: their mean is a rate
        value = value.double()
    finite = torch.isfinite(value.detach())
    if not finite.all():
        which = "the batch" if len(value) == 1 < pairs else f"pair {int((~finite).nonzero()[0])}"
        raise ProbeError(
            f"the metric returned {float(value.detach()[~finite][0])} for {which}; it must be "
            "finite (a log of 0, or a division by 0?)"
        )
    return value


def mean_intervals(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Means over the last dimension of ``[..., pairs]`` with their 95% t-intervals."""
    values = values.double()
    n = values.shape[-1]
    mean = values.mean(-1)
    if n < 2:
        nan = torch.full_like(mean, math.nan)
        return mean, nan, nan
    return mean, *t_interval(mean, values.std(-1), n)


def rows_of(inputs: Mapping[str, Any], rows: slice, pairs: int) -> dict[str, Any]:
    """The ``rows`` of the pairs' inputs: each tensor whose first dimension is ``pairs``
    sliced there, the rest as they are."""
    return {
        key: value[rows]
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == pairs
        else value
        for key, value in inputs.items()
    }


def chunks(
    pairs: int, per_pair: int, max_bytes: int, metric: Metric, what: str, fixed: int = 0
) -> list[slice]:
    """The chunks of pairs whose runs fit ``max_bytes``: ``fixed`` bytes, and ``per_pair`` for
    each pair of a chunk. Every pair at once where they fit; else as many a chunk as fit, at
    least two (so that a scalar metric shows itself on the first).

    Raises
    ------
    ProbeError
        Where ``max_bytes`` holds fewer than two pairs (or the one), naming the smallest that
        works, and where the pairs do not fit at once and the metric does not take ``pairs``
        (it would be given another chunk's logits than it reads per-pair data for).
    """
    fits = max(0, int(max_bytes) - fixed) // max(1, per_pair)
    if fits >= pairs:
        return [slice(0, pairs)]
    whole = fixed + per_pair * pairs
    if not takes_pairs(metric):
        raise ProbeError(
            f"the {pairs} pairs' {what} do not fit max_bytes={int(max_bytes):,} at once (they "
            f"need about {whole:,}), and the metric, metric(logits), is given every pair at "
            "once: give it a parameter pairs, metric(logits, pairs), returning one value for "
            "each pair of the slice pairs of the batch, or raise max_bytes"
        )
    if fits < 2:
        smallest = fixed + per_pair * 2
        raise ProbeError(
            f"max_bytes={int(max_bytes):,} is too small for two pairs' {what} at a time; give "
            f"at least max_bytes={smallest:,} ({smallest / 2**20:,.1f} MiB)"
        )
    return [slice(i, min(i + fits, pairs)) for i in range(0, pairs, fits)]


def check_chunk(values: torch.Tensor, rows: slice, pairs: int, n_chunks: int) -> None:
    """Refuse a scalar metric's reading (``[1]`` for several pairs) where the pairs run in
    ``n_chunks`` > 1 chunks: a batch's one value cannot be split into chunks' values.

    Raises
    ------
    ProbeError
        Saying to return one value per pair or raise ``max_bytes``.
    """
    given = rows.stop - rows.start
    if n_chunks > 1 and form(values, given) == SCALAR:
        raise ProbeError(
            f"the metric returned one value for the batch (a scalar), but the {pairs} pairs run "
            f"in {n_chunks} chunks within max_bytes, and a batch's value cannot be split: "
            "return one value per pair of the slice it is given, or raise max_bytes"
        )


class Moments:
    """Running means over pairs and sums of squared deviations from them (Chan et al.'s
    update), of values ``[..., pairs]`` added a chunk of pairs at a time: the same means and
    95% t-intervals as ``mean_intervals`` of every pair at once (to float rounding), with no
    ``[..., pairs]`` table kept."""

    def __init__(self) -> None:
        self.n = 0
        self.mean = torch.zeros(())
        self.spread = torch.zeros(())

    def add(self, values: torch.Tensor) -> None:
        """Add a chunk's values ``[..., k]`` (kept on the CPU, in float64)."""
        values = values.detach().to("cpu", torch.float64)
        k = values.shape[-1]
        mean = values.mean(-1)
        spread = ((values - mean.unsqueeze(-1)) ** 2).sum(-1)
        total = self.n + k
        shift = mean - self.mean
        self.mean = self.mean + shift * (k / total)
        self.spread = self.spread + spread + shift**2 * (self.n * k / total)
        self.n = total

    def intervals(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The means with their 95% t-intervals (NaN for one pair)."""
        if self.n < 2:
            nan = torch.full_like(self.mean, math.nan)
            return self.mean, nan, nan
        sd = (self.spread / (self.n - 1)).sqrt()
        return self.mean, *t_interval(self.mean, sd, self.n)


@functools.cache
def _libc() -> Any:
    """The process's own C library where it has ``malloc_trim`` (glibc), else None."""
    try:
        libc = ctypes.CDLL(None)  # the symbols already loaded: no search, no subprocess
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def release() -> None:
    """Give the memory a chunk of pairs freed back to the system (glibc's ``malloc_trim``;
    nothing elsewhere). Without it, the few small tensors kept from each chunk (its metric's
    values, the running sums) pin the heap above the chunk's freed runs, and the process's
    resident memory creeps up with the number of chunks though nothing more is held."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
