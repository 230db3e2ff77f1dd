"""Activation patching: which heads (at which positions) carry what makes two inputs differ."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import pandas as pd
import torch
from torch import nn

from probe.capture.hookpoints import Hook, hook_points, hooks, trace
from probe.capture.names import ROTARY_POINTS, point_of
from probe.errors import ProbeError

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


@torch.no_grad()
def patch(
    model: nn.Module,
    clean: Mapping[str, Any],
    corrupted: Mapping[str, Any],
    metric: Callable[[Any], torch.Tensor | float],
    *,
    hook: str = "hook_z",
    per_position: bool = False,
) -> pd.DataFrame:
    """Patch each head's activation from a clean run into a corrupted one, and measure.

    For every layer and head (and position), the corrupted input is run with that one slice of
    ``hook`` taken from the clean run; ``metric`` reads the output. A head that restores the
    clean metric carries what distinguishes the two inputs. Costs one forward pass per
    (layer, head[, position]).

    Parameters
    ----------
    model : nn.Module
        A Hugging Face model, a ``probe.MultiHeadAttention`` or a module built from them.
    clean, corrupted : dict
        Keyword arguments of ``model``, of the same shapes (positions are patched one to one).
    metric : callable
        ``metric(output)`` of the model's output, a scalar (e.g. a logit difference).
    hook : str
        A per-head hook point: ``hook_z`` (default), ``hook_result``, ``hook_q``, ``hook_k``,
        ``hook_v``, ``hook_rot_q`` or ``hook_rot_k`` (rotary models: after the rotation),
        ``hook_pattern`` or ``hook_attn_scores`` (patched at the query position). Keys and
        values of grouped-query models have fewer heads than queries.
    per_position : bool
        Patch each position separately instead of every position at once.

    Returns
    -------
    pandas.DataFrame
        One row per patch: ``layer``, ``head`` (0-based), ``position`` (with ``per_position``),
        ``metric``, and ``recovered`` = (metric - corrupted) / (clean - corrupted), NaN when the
        two inputs score alike; ``attrs`` holds the ``clean`` and ``corrupted`` metrics.
    """
    if hook not in LAYOUT:
        raise ProbeError(f"cannot patch {hook!r} per head; choose from {', '.join(LAYOUT)}")
    head_dim, position_dim = LAYOUT[hook]
    with hook_points(model) as points:
        names = [name for name in points if point_of(name) == hook]
    if not names:
        rotary = " (only rotary models have it)" if hook in ROTARY_POINTS else ""
        raise ProbeError(f"the model has no {hook} points{rotary}")
    with trace(model, names) as cache:
        clean_metric = float(metric(model(**clean)))
    corrupted_metric = float(metric(model(**corrupted)))

    rows = []
    for layer, name in enumerate(names):
        source = cache[name]
        positions = range(source.shape[position_dim]) if per_position else [None]
        for head in range(source.shape[head_dim]):
            for position in positions:
                where: list[Any] = [slice(None)] * source.dim()
                where[head_dim] = head
                if position is not None:
                    where[position_dim] = position
                with hooks(model, {name: _put(source, tuple(where))}):
                    value = float(metric(model(**corrupted)))
                row = {"layer": layer, "head": head, "position": position, "metric": value}
                rows.append(
                    row if per_position else {k: v for k, v in row.items() if k != "position"}
                )
    table = pd.DataFrame(rows)
    spread = clean_metric - corrupted_metric
    table["recovered"] = (table.metric - corrupted_metric) / spread if spread else math.nan
    table.attrs = {"clean": clean_metric, "corrupted": corrupted_metric}
    return table


def _put(source: torch.Tensor, where: tuple) -> Callable[[torch.Tensor, Hook], torch.Tensor]:
    def put(x: torch.Tensor, hook: Hook) -> torch.Tensor:
        if x.shape != source.shape:
            raise ProbeError(
                f"{hook}: clean {tuple(source.shape)} and corrupted {tuple(x.shape)} differ in "
                "shape; patching needs inputs of the same length (pad them alike)"
            )
        x = x.clone()
        x[where] = source[where]
        return x

    return put
