"""Attribution patching: every head's patching effect at once, from gradients.

Patching a head's activation a from the clean run into the corrupted one moves the metric by
about (a_clean − a_corrupted) · ∂metric/∂a, the gradient taken at the corrupted run (Nanda's
attribution patching, AtP). One forward pass of each input and one backward pass give it for
every head. Three estimates:

- ``"atp"``: the gradient at the corrupted run;
- ``"atp*"``: AtP with Kramár et al.'s (2024) fix for saturated attention: for a query or key
  point, the head's attention pattern with the clean query (key) is computed exactly, and only
  the rest is linearised: (A_patched − A_corrupted) · ∂metric/∂A. At other points (``hook_z``:
  the head's whole output, whose own softmax patching replaces outright) it equals AtP, and
  ``attrs["note"]`` says so;
- ``"ig"``: integrated gradients, the gradient averaged over ``steps`` runs whose start
  (embeddings) is interpolated from the corrupted to the clean input (α = k/steps, k = 1…steps,
  as EAP-IG takes it), in one stacked pass.
"""

from __future__ import annotations

import math

import pandas as pd
import torch
from torch import nn

from probe.capture.hookpoints import hook_points, trace
from probe.capture.names import point_of
from probe.errors import ProbeError
from probe.interventions.gradients import (
    clean_start,
    memory_budget,
    metric_gradients,
    run_bytes,
    start_point,
)
from probe.interventions.guard import keeps_model
from probe.interventions.pairs import (
    PER_PAIR,
    Batch,
    Metric,
    Moments,
    as_pairs,
    check_chunk,
    chunks,
    form,
    read,
    release,
    rows_of,
)
from probe.interventions.patching import LAYOUT
from probe.interventions.progress import advance, shown

METHODS = ("atp", "atp*", "ig")
# The query and key points, each with the point it meets in the scores.
PARTNER = {
    "hook_q": "hook_k",
    "hook_k": "hook_q",
    "hook_rot_q": "hook_rot_k",
    "hook_rot_k": "hook_rot_q",
}


@keeps_model
def attribute(
    model: nn.Module,
    clean: Batch,
    corrupted: Batch,
    metric: Metric,
    method: str = "atp",
    *,
    hook: str = "hook_z",
    per_position: bool = False,
    steps: int = 5,
    max_bytes: int | None = None,
    progress: bool | None = None,
) -> pd.DataFrame:
    """Estimate every head's patching effect (``probe.patch``'s ``effect``) from gradients.

    Parameters
    ----------
    model : nn.Module
        A Hugging Face model, a ``probe.MultiHeadAttention`` or a module built from them.
    clean, corrupted : dict or torch.Tensor
        Keyword arguments of ``model`` for a batch of prompt pairs, of the same shapes, or token
        ids ``[pairs, pos]``.
    metric : callable
        ``metric(logits)`` (``metric(output)`` for a model without logits): one differentiable
        value per pair ``[pairs]``, e.g. a logit difference or a log-probability, or a scalar
        over the batch, as TransformerLens's metrics return (the same estimates, without
        intervals).
        ``metric(logits, pairs)`` where it reads per-pair data of its own: ``pairs`` is the
        slice of the batch its logits hold (see ``max_bytes``).
    method : {"atp", "atp*", "ig"}
        See the module's description.
    hook : str
        A per-head point (``probe.patch``'s; ``hook_pattern`` and ``hook_attn_scores`` patched at
        the query position).
    per_position : bool
        One row per head and position (the position's slice patched alone).
    steps : int
        Interpolation steps of ``"ig"``, run one after the other.
    max_bytes : int, optional
        By default (``memory_budget``) a share (``gradients.FREE_SHARE``) of the memory free on the
        model's device when the call starts. What the call may hold at once: the runs (one forward
        and backward pass at a time, ``run_bytes``' estimate), the point's activations and
        gradients, and their products (float64). Pairs that do not fit at once run a chunk at a
        time, at least two (``probe.interventions.pairs``: the metric then takes ``pairs``); the
        estimates do not depend on it (to float32 rounding).
    progress : bool, optional
        A tqdm progress bar on stderr: by default where stderr is a terminal
        (``probe.interventions.progress``); ``False`` never, ``True`` always.

    Returns
    -------
    pandas.DataFrame
        ``layer``, ``head`` (0-based), ``position`` (with ``per_position``), ``attribution``
        (mean over pairs) with its 95% t-interval ``attribution_low``, ``attribution_high``
        (NaN for one pair or a scalar metric). ``attrs``: ``method``, ``pairs``, ``clean`` and
        ``corrupted`` mean metrics, the ``metric``'s form (``"per pair"`` or ``"scalar"``), and
        a ``note`` where ``"atp*"`` had nothing to fix, or where, at the keys of a model with
        grouped-query attention, it gives a row per query head (the keys it reads, as on the
        model's ungrouped twin; ``"atp"`` and ``"ig"`` give one per key head).

    Raises
    ------
    ProbeError
        For an unknown method or point, pairs of different shapes, a metric that is not
        differentiable, a ``max_bytes`` too small for two pairs (naming the smallest), or pairs
        that do not fit it at once with a metric that cannot be split (a scalar, or one that
        does not take ``pairs``).
    """
    if method not in METHODS:
        raise ProbeError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
    if hook not in LAYOUT:
        raise ProbeError(f"cannot attribute to {hook!r} per head; choose from {', '.join(LAYOUT)}")
    if method == "ig" and steps < 1:
        raise ProbeError(f"steps must be at least 1, not {steps}")
    clean, corrupted, pairs = as_pairs(clean, corrupted, model)
    max_bytes = memory_budget(model, max_bytes)
    with hook_points(model) as points:
        names = [name for name in points if point_of(name) == hook]
        if not names:
            raise ProbeError(f"the model has no {hook} points")
        fix = method == "atp*" and hook in PARTNER
        rotated = hook.replace("hook_", "hook_rot_")
        if fix and rotated in PARTNER and any(point_of(n) == rotated for n in points):
            # The scores are made of the rotated queries and keys, not of these: atp* works there.
            raise ProbeError(
                f"atp* at {hook} needs the {hook[-1]} the scores are made of, and this model "
                f"rotates them after {hook}: use hook={rotated!r} (after the rotation), or "
                "method='atp' here"
            )
        stems = [n[: -len(hook)] for n in names] if fix else []
        alphas = [k / steps for k in range(1, steps + 1)] if method == "ig" else [0.0]
        plan = _Plan(method, hook, names, stems, alphas, per_position, max_bytes)
        parts = chunks(pairs, plan.pair_bytes(model, clean, pairs), max_bytes, metric,
                       "runs and products")  # fmt: skip
        moments, readings, rows_seen = Moments(), [], []
        with shown(f"attribute ({method})", pairs * len(alphas), progress, "pair-step"):
            for rows in parts:
                found = plan.chunk(model, rows_of(clean, rows, pairs),
                                   rows_of(corrupted, rows, pairs), metric, rows)  # fmt: skip
                check_chunk(found[0], rows, pairs, len(parts))
                readings.append(found[:2])
                table_rows, values = _values(found[2], per_position)
                moments.add(values)
                rows_seen = table_rows
                if len(parts) > 1:
                    release()
    metric_form = form(readings[0][0], parts[0].stop)
    table = _table(rows_seen, moments, "attribution", metric_form == PER_PAIR)
    table.attrs = {
        "method": method,
        "pairs": pairs,
        "clean": float(torch.cat([r[0] for r in readings]).double().mean()),
        "corrupted": float(torch.cat([r[1] for r in readings]).double().mean()),
        "metric": metric_form,
        "max_bytes": max_bytes,
        "chunks": len(parts),
    }
    if plan.note is not None:
        table.attrs["note"] = plan.note
    return table


class _Plan:
    """What ``attribute`` runs for each chunk of pairs, and what a pair of it holds."""

    def __init__(self, method, hook, names, stems, alphas, per_position, max_bytes) -> None:
        self.method, self.hook, self.names, self.stems = method, hook, names, stems
        self.alphas, self.per_position, self.max_bytes = alphas, per_position, max_bytes
        self.patterns = [stem + "hook_pattern" for stem in stems]
        self.around = [stem + p for stem in stems for p in ("hook_attn_scores", PARTNER.get(hook))]
        self.keep = [*names, *self.patterns, *self.around]
        self.note: str | None = None

    def pair_bytes(self, model, clean, pairs) -> int:
        """What a pair adds: its forward and backward pass (``run_bytes``), and the point's
        activations (clean, corrupted) and gradients (float64) with their products (float64,
        ``_effects``'s), measured on a run of the first pair (atp*: the patterns' too)."""
        with torch.no_grad(), trace(model, self.keep) as cache:
            model(**rows_of(clean, slice(0, 1), pairs))
        point = sum(cache[n][0].numel() for n in self.names)
        pattern = sum(cache[n][0].numel() for n in self.patterns)
        around = sum(cache[n][0].numel() for n in self.around)
        return (run_bytes(model, clean, pairs, backward=True) + (4 + 4 + 8 + 32) * point
                + (4 + 8 + 96) * pattern + 4 * around)  # fmt: skip

    def chunk(self, model, clean, corrupted, metric, rows):
        """A chunk's clean and corrupted metric values, and each layer's ``[pairs, head,
        position]`` estimates."""
        pairs = rows.stop - rows.start
        first = [p for p in [start_point(model)] if p is not None and p not in self.names]
        with torch.no_grad(), trace(model, [*self.names, *first]) as cache:
            clean_values = read(metric, model(**clean), pairs, rows=rows)
        start = clean_start(model, clean, cache)
        values, grads, kept = _mean_over_steps(model, corrupted, metric, pairs,
                                               [*self.names, *self.patterns], start, self.alphas,
                                               self.keep, rows)  # fmt: skip
        if self.alphas != [0.0]:  # the corrupted run's own activations and metric
            with torch.no_grad(), trace(model, self.keep) as corrupted_cache:
                corrupted_values = read(metric, model(**corrupted), pairs, rows=rows)
            corrupted_acts = {n: corrupted_cache[n] for n in self.keep}
        else:
            corrupted_values = values[0]
            corrupted_acts = {n: kept[n][0] for n in self.keep}
        per_layer = _effects(self.hook, self.names, self.stems, cache, corrupted_acts, grads,
                             self.per_position, pairs, self.max_bytes)  # fmt: skip
        self._note(cache, per_layer)
        return clean_values, corrupted_values, per_layer

    def _note(self, cache, per_layer) -> None:
        hook, names = self.hook, self.names
        if self.stems and cache[names[0]].shape[LAYOUT[hook][0]] < per_layer[0].shape[1]:
            self.note = (
                f"grouped-query attention: {hook} has {cache[names[0]].shape[LAYOUT[hook][0]]} "
                "key heads; atp* gives one row per query head, its own copy of the keys it reads "
                "patched for it alone (as on the model's ungrouped twin)"
            )
        if self.method == "atp*" and not self.stems:
            self.note = (
                f"atp* fixes query and key points only; at {hook} it equals atp (the head's own "
                "softmax is replaced outright by patching its output)"
            )


def _mean_over_steps(model, corrupted, metric, pairs, points, start, alphas, keep, rows):
    """``metric_gradients``'s values and kept activations, with the gradients at ``points``
    averaged over the steps ``alphas``, one run at a time (the memory of one forward and backward
    pass)."""
    grads: dict[str, torch.Tensor] = {}
    for alpha in alphas:
        values, found, kept = metric_gradients(
            model,
            corrupted,
            metric,
            pairs,
            points,
            start,
            [alpha],
            keep if alpha == 0 else [],
            rows=rows,
        )
        for point, grad in found.items():  # [1, pairs, ...]
            term = grad.double() / len(alphas)
            grads[point] = grads[point] + term if point in grads else term
        del found
        advance(pairs)
    return values, grads, kept


def _effects(
    hook, names, stems, cache, corrupted_acts, grads, per_position, pairs, max_bytes
) -> list[torch.Tensor]:
    """Each layer's ``[pairs, head, position]`` estimates, from the products of the activations'
    change and the gradients taken a chunk of pairs at a time within ``max_bytes``: float64
    copies of a point's tensors per pair (atp*, where ``stems`` are given: of the pattern's
    too)."""
    head_dim, position_dim = LAYOUT[hook]
    per_pair = 8 * 4 * cache[names[0]][0].numel()
    if stems:
        per_pair += 8 * 12 * corrupted_acts[stems[0] + "hook_pattern"][0].numel()
    if max_bytes < per_pair:
        raise ProbeError(
            f"max_bytes={max_bytes:,} is too small for one pair's products at {hook}; give at "
            f"least max_bytes={per_pair:,} ({per_pair / 2**20:,.1f} MiB)"
        )
    step = max(1, min(pairs, max_bytes // per_pair))
    per_layer = []
    for layer, name in enumerate(names):
        effects = []
        for first in range(0, pairs, step):
            rows = slice(first, first + step)
            if stems:
                effect = _fixed(
                    hook, stems[layer], name, {name: cache[name][rows]},
                    {n: v[rows] for n, v in corrupted_acts.items()},
                    {n: v[:, rows] for n, v in grads.items()}, per_position,
                )  # fmt: skip
            else:
                delta = (cache[name][rows] - corrupted_acts[name][rows]).double()  # [pairs, ...]
                grad = grads[name][:, rows].sum(0)  # the mean over the steps
                effect = _per_head(delta * grad, head_dim, position_dim)  # [pairs, head, pos]
            effects.append(effect)
        per_layer.append(torch.cat(effects))
    return per_layer


def _fixed(hook, stem, name, cache, corrupted_acts, grads, per_position) -> torch.Tensor:
    """AtP*'s term of one layer's query or key point, ``[pairs, head, position]``."""
    at = {p: corrupted_acts[stem + p].double() for p in ("hook_attn_scores", PARTNER[hook])}
    return _query_key_exact(
        hook in ("hook_q", "hook_rot_q"),
        cache[name].double(),
        corrupted_acts[name].double(),
        at[PARTNER[hook]],
        at["hook_attn_scores"],
        corrupted_acts[stem + "hook_pattern"].double(),
        grads[stem + "hook_pattern"].double().mean(0),
        per_position,
        name,
    )


def _values(per_layer: list[torch.Tensor], per_position: bool) -> tuple[list[dict], torch.Tensor]:
    """The rows per head (and position) and their values per pair ``[rows, pairs]`` from each
    layer's ``[pairs, head, position]`` estimates (every position at once: linear terms add
    up; atp*'s is joint already)."""
    rows, values = [], []
    for layer, effect in enumerate(per_layer):
        n_heads, n_positions = effect.shape[1], effect.shape[2]
        for head in range(n_heads):
            if per_position:
                for position in range(n_positions):
                    rows.append({"layer": layer, "head": head, "position": position})
                    values.append(effect[:, head, position])
            else:
                rows.append({"layer": layer, "head": head})
                values.append(effect[:, head].sum(-1))
    return rows, torch.stack(values)


def _table(rows: list[dict], moments: Moments, column: str, intervals: bool) -> pd.DataFrame:
    """The ``rows`` with their values' means over pairs and 95% intervals (``moments``; NaN
    without ``intervals``: a scalar metric's per-pair terms are shares of one value, not values
    of their own), as ``column``, ``column_low``, ``column_high``."""
    mean, low, high = moments.intervals()
    if not intervals:
        low, high = torch.full_like(mean, math.nan), torch.full_like(mean, math.nan)
    table = pd.DataFrame(rows)
    table[column], table[f"{column}_low"], table[f"{column}_high"] = (
        mean.numpy(),
        low.numpy(),
        high.numpy(),
    )
    return table


def _per_head(product: torch.Tensor, head_dim: int, position_dim: int) -> torch.Tensor:
    """``[pairs, head, position]``: a per-head point's product summed over its other dimensions."""
    dims = [d for d in range(1, product.dim()) if d not in (head_dim, position_dim)]
    summed = product.sum(dims) if dims else product
    # The remaining dimensions are (pairs, head, position) in the point's order.
    return summed if head_dim < position_dim else summed.transpose(1, 2)


def _query_key_exact(
    query: bool,
    clean: torch.Tensor,
    corrupted: torch.Tensor,
    other: torch.Tensor,
    scores: torch.Tensor,
    pattern: torch.Tensor,
    grad_pattern: torch.Tensor,
    per_position: bool,
    name: str,
) -> torch.Tensor:
    """AtP*'s query/key term per pair, head and position: the pattern with the clean query (key)
    computed exactly, times ∂metric/∂pattern.

    ``clean``, ``corrupted`` ``[pairs, pos, head, d_head]``: the queries (``query``) or keys,
    and ``other`` the keys (queries) they meet at the corrupted run; ``scores``, ``pattern``,
    ``grad_pattern`` ``[pairs, head, q_pos, k_pos]``. Keys of fewer heads than the queries
    (grouped-query attention) are repeated for every query head they serve. Returns ``[pairs,
    head, position]`` (a query head per row, keys included), or ``[pairs, head, 1]`` for every
    position patched at once.
    """
    # Grouped-query attention: each query head's own copy of the keys it reads (the ungrouped
    # twin's), so that a key is patched for one query head at a time.
    heads = scores.shape[1]
    clean, corrupted, other = (
        t.repeat_interleave(heads // t.shape[2], dim=2) for t in (clean, corrupted, other)
    )
    queries, keys = (corrupted, other) if query else (other, corrupted)
    raw = torch.einsum("bqhd,bkhd->bhqk", queries, keys)
    real = scores > torch.finfo(torch.float32).min / 2
    scale = (raw * scores)[real].sum() / (raw * raw)[real].sum().clamp_min(1e-30)
    if not torch.allclose(scores[real], scale * raw[real], atol=1e-4, rtol=1e-3):
        raise ProbeError(
            f"{name}: atp* needs attention scores that are a scaled q·k (no position bias, "
            "soft cap or rotation after this point); use method='atp'"
        )
    delta = clean - corrupted
    shift = (
        torch.einsum("bqhd,bkhd->bhqk", delta, other)  # row i moves by (q'_i - q_i)·k_j s
        if query
        else torch.einsum("bqhd,bkhd->bhqk", other, delta)  # column j by q_i·(k'_j - k_j) s
    ) * scale
    if query or not per_position:  # rows are independent: each query's new row, exact
        new = torch.softmax((scores + shift).masked_fill(~real, -torch.inf), dim=-1).nan_to_num(0)
        change = ((new - pattern) * grad_pattern).sum(-1)  # [pairs, head, q_pos]
        return change if per_position else change.sum(-1, keepdim=True)
    # Key j alone: each row i's column j moves by δ_ij. With r = 1 + A_ij (e^δ - 1), the new
    # row is A/r except at j, A_ij e^δ / r: a closed form for every j at once.
    shift = shift.masked_fill(~real, 0.0).clamp(-600, 600)
    grown = pattern * (shift.exp() - 1)
    r = 1 + grown
    dot = (pattern * grad_pattern).sum(-1, keepdim=True)  # Σ_l A_il g_il
    change = (1 / r - 1) * dot + grown / r * grad_pattern  # [pairs, head, q_pos, k_pos]
    return change.sum(2)  # over the queries: [pairs, head, k_pos]
