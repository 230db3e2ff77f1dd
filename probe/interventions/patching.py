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
from probe.interventions.guard import keeps_model
from probe.interventions.pairs import (
    Batch,
    Metric,
    as_pairs,
    copies_of,
    mean_intervals,
    read,
    same_form,
    stacked,
)

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
    clean, corrupted, pairs = as_pairs(clean, corrupted)
    head_dim, position_dim = LAYOUT[hook]
    # One mirror for the whole call: the nested trace and hooks blocks below share it.
    with hook_points(model) as points:
        names = [name for name in points if point_of(name) == hook]
        if not names:
            rotary = " (only rotary models have it)" if hook in ROTARY_POINTS else ""
            raise ProbeError(f"the model has no {hook} points{rotary}")
        with trace(model, names) as cache:
            clean_values = read(metric, model(**clean), pairs)
        corrupted_values = read(metric, model(**corrupted), pairs)
        n_heads = max(cache[name].shape[head_dim] for name in names)
        wanted = None if heads is None else check_heads(heads, len(names), n_heads)
        patches = []
        for layer, name in enumerate(names):
            source = cache[name]
            positions = range(source.shape[position_dim]) if per_position else [None]
            layer_heads = range(source.shape[head_dim]) if wanted is None else wanted.get(layer, [])
            for head in layer_heads:
                patches += [(layer, name, head, position) for position in positions]
        copies = max(1, max_rows // pairs)
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
                patched.append(read(metric, seen, pairs))

    metric_form = same_form([clean_values, corrupted_values, *patched], pairs)
    width = clean_values.shape[-1]
    values = torch.stack(patched).double() if patched else torch.zeros(0, width)
    table = _table(patches, per_position, values, clean_values, corrupted_values)
    clean_metric, corrupted_metric = float(clean_values.mean()), float(corrupted_values.mean())
    table.attrs = {
        "clean": clean_metric,
        "corrupted": corrupted_metric,
        "pairs": pairs,
        "metric": metric_form,
    }
    return table


def _table(patches, per_position, values, clean_values, corrupted_values) -> pd.DataFrame:
    """One row per patch: its mean metric, recovery and effect with the effect's interval."""
    effect, low, high = mean_intervals(values - corrupted_values.double())
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
    table["metric"] = values.mean(-1).numpy()
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
