"""Activation patching: which heads (at which positions) carry what makes two inputs differ,
over a batch of prompt pairs, many heads to a forward pass."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import pandas as pd
import torch
from torch import nn

from probe.capture.hookpoints import Hook, hook_points, hooks, trace
from probe.capture.names import ROTARY_POINTS, point_of
from probe.errors import ProbeError
from probe.interventions.ablation import check_heads
from probe.interventions.gradients import memory_budget, run_bytes
from probe.interventions.guard import keeps_model
from probe.interventions.pairs import (
    Batch,
    Metric,
    Moments,
    as_pairs,
    check_chunk,
    chunks,
    copies_of,
    read,
    release,
    rows_of,
    same_form,
    stacked,
)
from probe.interventions.progress import advance, shown

# Per-head hook points: (head dimension, position dimension) of their tensors.
LAYOUT = {
    "hook_q": (2, 1),
    "hook_k": (2, 1),
    "hook_v": (2, 1),
    "hook_rot_q": (2, 1),  # rotary models: after the rotation
    "hook_rot_k": (2, 1),
    "hook_z": (2, 1),
    "hook_result": (2, 1),
    "hook_attn_scores": (1, 2),  # the query's position
    "hook_pattern": (1, 2),
}


@keeps_model
@torch.no_grad()
def patch(
    model: nn.Module,
    clean: Batch,
    corrupted: Batch,
    metric: Metric,
    *,
    hook: str = "hook_z",
    per_position: bool = False,
    heads: Iterable[tuple[int, int]] | None = None,
    max_rows: int = 256,
    max_bytes: int | None = None,
    progress: bool | None = None,
) -> pd.DataFrame:
    """Patch each head's activation from a clean run into a corrupted one, and measure.

    For every layer and head (and position), the corrupted input is run with that one slice of
    ``hook`` taken from the clean run; ``metric`` reads the output. A head that restores the
    clean metric carries what distinguishes the two inputs. The hooks are attached once, and
    many patches run in one forward pass, as copies of the batch of pairs stacked along the
    batch dimension (at most ``max_rows`` rows a pass): the cost is about one forward pass of
    the pairs per (layer, head[, position]), without the set-up of one.

    Parameters
    ----------
    model : nn.Module
        A Hugging Face model, a ``probe.MultiHeadAttention`` or a module built from them.
    clean, corrupted : dict or torch.Tensor
        Keyword arguments of ``model`` for a batch of prompt pairs, ``[pairs, ...]`` of the same
        shapes (positions are patched one to one; padding must be the same in both), or token
        ids ``[pairs, pos]``.
    metric : callable
        ``metric(logits)`` (``metric(output)`` for a model without logits): one value per pair,
        ``[pairs]``, e.g. a logit difference, or a scalar over the batch, as TransformerLens's
        metrics return (the same effects, without intervals). With several copies stacked it
        is called on each copy's rows.
        ``metric(logits, pairs)`` where it reads per-pair data of its own: ``pairs`` is the
        slice of the batch its logits hold (see ``max_bytes``).
    hook : str
        A per-head hook point: ``hook_z`` (default), ``hook_result``, ``hook_q``, ``hook_k``,
        ``hook_v``, ``hook_rot_q`` or ``hook_rot_k`` (rotary models: after the rotation),
        ``hook_pattern`` or ``hook_attn_scores`` (patched at the query position). Keys and
        values of grouped-query models have fewer heads than queries.
    per_position : bool
        Patch each position separately instead of every position at once.
    heads : iterable of (layer, head), optional
        Patch only these heads (0-based); every head by default.
    max_rows : int
        At most this many rows (copies x pairs) in one forward pass; at least one copy.
    max_bytes : int, optional
        By default (``memory_budget``) a share (``gradients.FREE_SHARE``) of the memory free on the
        model's device when the call starts. What the runs may hold at once: the clean activations
        at ``hook`` and the patched forward passes' (``run_bytes``' estimate), a chunk of pairs at a
        time where they do not fit at once (``probe.interventions.pairs``: the metric then takes
        ``pairs``). The effects do not depend on it.
    progress : bool, optional
        A tqdm progress bar on stderr: by default where stderr is a terminal
        (``probe.interventions.progress``); ``False`` never, ``True`` always.

    Returns
    -------
    pandas.DataFrame
        One row per patch: ``layer``, ``head`` (0-based), ``position`` (with ``per_position``),
        ``metric`` (mean over pairs), ``recovered`` = (metric - corrupted) / (clean -
        corrupted), NaN when the two inputs score alike, and ``effect`` = the mean over pairs
        of patched - corrupted metric with its 95% t-interval ``effect_low``, ``effect_high``
        (NaN for one pair or a scalar metric). ``attrs`` holds the ``clean`` and ``corrupted``
        mean metrics, the number of ``pairs`` and the ``metric``'s form (``"per pair"`` or
        ``"scalar"``).
    """
    if hook not in LAYOUT:
        raise ProbeError(f"cannot patch {hook!r} per head; choose from {', '.join(LAYOUT)}")
    if max_rows < 1:
        raise ProbeError(f"max_rows must be at least 1, not {max_rows}")
    clean, corrupted, pairs = as_pairs(clean, corrupted, model)
    max_bytes = memory_budget(model, max_bytes)
    # One mirror for the whole call: the nested trace and hooks blocks below share it.
    with hook_points(model) as points:
        names = [name for name in points if point_of(name) == hook]
        if not names:
            rotary = " (only rotary models have it)" if hook in ROTARY_POINTS else ""
            raise ProbeError(f"the model has no {hook} points{rotary}")
        with trace(model, names) as cache:  # a pair's sizes: its heads, its clean activations
            model(**rows_of(clean, slice(0, 1), pairs))
        kept = sum(4 * cache[name][0].numel() for name in names)
        forward = run_bytes(model, clean, pairs, backward=False)
        n_heads = max(cache[name].shape[LAYOUT[hook][0]] for name in names)
        wanted = None if heads is None else check_heads(heads, len(names), n_heads)
        patches = _patches(cache, names, hook, per_position, wanted)
        del cache
        parts = chunks(pairs, kept + forward, max_bytes, metric, "patched runs")
        readings: list[torch.Tensor] = []
        effects, metrics = Moments(), Moments()
        with shown("patch", len(patches) * pairs, progress, "patched pair"):
            for rows in parts:
                k = rows.stop - rows.start
                copies = max(1, min(max_rows // k, (max_bytes - k * kept) // (k * forward)))
                found = _chunk(model, rows_of(clean, rows, pairs), rows_of(corrupted, rows, pairs),
                               metric, rows, names, patches, hook, copies)  # fmt: skip
                check_chunk(found[0], rows, pairs, len(parts))
                readings += found[:2]
                metrics.add(found[2])
                effects.add(found[2] - found[1].double())
                if len(parts) > 1:
                    release()
    clean_values = torch.cat(readings[0::2]).double()
    corrupted_values = torch.cat(readings[1::2]).double()
    metric_form = same_form([clean_values, corrupted_values], pairs)
    table = _table(patches, per_position, metrics, effects, clean_values, corrupted_values)
    table.attrs = {
        "clean": float(clean_values.mean()),
        "corrupted": float(corrupted_values.mean()),
        "pairs": pairs,
        "metric": metric_form,
        "max_bytes": max_bytes,
        "chunks": len(parts),
    }
    return table


def _patches(cache, names, hook, per_position, wanted) -> list[tuple[int, str, int, int | None]]:
    """Every patch, ``(layer, point, head, position)``, in the table's order."""
    head_dim, position_dim = LAYOUT[hook]
    patches = []
    for layer, name in enumerate(names):
        source = cache[name]
        positions = range(source.shape[position_dim]) if per_position else [None]
        layer_heads = range(source.shape[head_dim]) if wanted is None else wanted.get(layer, [])
        for head in layer_heads:
            patches += [(layer, name, head, position) for position in positions]
    return patches


def _chunk(model, clean, corrupted, metric, rows, names, patches, hook, copies):
    """A chunk of pairs: its clean and corrupted metrics, and every patch's ``[patch,
    pairs]`` (float64), ``copies`` patches a forward pass."""
    pairs = rows.stop - rows.start
    head_dim, position_dim = LAYOUT[hook]
    with trace(model, names) as cache:
        clean_values = read(metric, model(**clean), pairs, rows=rows)
    corrupted_values = read(metric, model(**corrupted), pairs, rows=rows)
    patched = []
    for start in range(0, len(patches), copies):
        chunk = patches[start : start + copies]
        by_name: dict[str, list[tuple[int, int, int | None]]] = {}
        for c, (_, name, head, position) in enumerate(chunk):
            by_name.setdefault(name, []).append((c, head, position))
        fns = {
            name: _put(cache[name], todo, pairs, len(chunk), head_dim, position_dim)
            for name, todo in by_name.items()
        }
        with hooks(model, fns):
            output = model(**stacked(corrupted, len(chunk), pairs))
        for seen in copies_of(output, len(chunk), pairs):
            patched.append(read(metric, seen, pairs, rows=rows))
        advance(len(chunk) * pairs)
    same_form([clean_values, corrupted_values, *patched], pairs)
    width = clean_values.shape[-1]
    values = torch.stack(patched).double() if patched else torch.zeros(0, width)
    return clean_values, corrupted_values, values


def _table(patches, per_position, metrics, effects, clean_values, corrupted_values):
    """One row per patch: its mean metric, recovery and effect with the effect's interval."""
    effect, low, high = effects.intervals()
    clean_metric, corrupted_metric = float(clean_values.mean()), float(corrupted_values.mean())
    table = pd.DataFrame(
        [
            {"layer": layer, "head": head, "position": position}
            for layer, _, head, position in patches
        ],
        columns=["layer", "head", "position"],
    )
    if not per_position:
        table = table.drop(columns="position")
    table["metric"] = metrics.mean.numpy()
    spread = clean_metric - corrupted_metric
    table["recovered"] = (table.metric - corrupted_metric) / spread if spread else math.nan
    table["effect"], table["effect_low"], table["effect_high"] = (
        effect.numpy(),
        low.numpy(),
        high.numpy(),
    )
    return table


def _put(
    source: torch.Tensor,
    todo: list[tuple[int, int, int | None]],
    pairs: int,
    copies: int,
    head_dim: int,
    position_dim: int,
) -> Callable[[torch.Tensor, Hook], torch.Tensor]:
    """A hook that writes, in copy c of the stacked batch, the clean ``source``'s slice of one head
    (at one position) for each (c, head, position) of ``todo``."""

    def put(x: torch.Tensor, hook: Hook) -> torch.Tensor:
        if x.shape[1:] != source.shape[1:] or x.shape[0] != copies * pairs:
            raise ProbeError(
                f"{hook}: clean {tuple(source.shape)} and corrupted {tuple(x.shape)} differ in "
                "shape; patching needs inputs of the same length (pad them alike)"
            )
        x = x.clone()
        for copy, head, position in todo:
            where: list[Any] = [slice(None)] * source.dim()
            where[head_dim] = head
            if position is not None:
                where[position_dim] = position
            into = [slice(copy * pairs, (copy + 1) * pairs), *where[1:]]
            x[tuple(into)] = source[tuple(where)]
        return x

    return put
