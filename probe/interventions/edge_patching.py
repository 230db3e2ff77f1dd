"""Exact edge patching: the metric with only a chosen set of edges carrying their clean values
(``patch_edges``), several sets a forward pass.

The model runs on the clean input, and every edge outside the set gives its receiver the
sender's ablated value instead of its value in this run: the receiver's input has that sender's
difference, this run's − ablated, taken off. The ablated value is the sender's in the corrupted
run (patching), its mean over the clean runs of every pair, zero, or its value in another pair's
clean run (a resample, ``faithfulness.resample_partners``). The edges are ``graph``'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from probe.capture.head_weights import head_weights
from probe.capture.hookpoints import Hook, hook_points, hooks, trace
from probe.capture.modes import ungrouped
from probe.capture.spec import describe
from probe.errors import ProbeError
from probe.interventions.faithfulness import check_ablation, resample_partners
from probe.interventions.gradients import memory_budget, run_bytes
from probe.interventions.graph import Graph, graph, result_points, sender_points
from probe.interventions.guard import keeps_model
from probe.interventions.pairs import (
    Batch,
    Metric,
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


@keeps_model
@torch.no_grad()
def patch_edges(
    model: nn.Module,
    clean: Batch,
    corrupted: Batch,
    metric: Metric,
    kept: Sequence[Sequence[bool]],
    max_rows: int = 256,
    *,
    max_bytes: int | None = None,
    ablation: str = "corrupted",
    seed: int = 0,
) -> torch.Tensor:
    """The metric with only the ``kept`` edges carrying their clean values, exactly.

    The model runs on the clean input; each receiver's input has, for every edge not kept, the
    sender's value in this run replaced by its corrupted value. Several sets of edges run in one
    forward pass, as stacked copies of the pairs: at most ``max_rows`` rows, and as many copies
    as ``max_bytes`` holds, counting per position the receivers' inputs per head (the patched
    model forms every head's own input), the senders' changes, formed a layer at a time from
    their ``hook_z``, and the forward pass (``run_bytes``). Pairs that do not fit one copy at
    once run a chunk at a time, at least two (``probe.interventions.pairs``: the metric then
    takes ``pairs``).

    Parameters
    ----------
    kept : ``[sets, edges]`` bool
        Per set of edges, which of ``graph(model).edges`` (the rows of ``edges``) are kept.
    ablation : {"corrupted", "mean", "zero", "resample"}
        What an edge left out carries: the sender's value in the pair's corrupted run; its mean
        over every pair's clean run, per position (over the positions the attention mask
        holds, where the inputs have one); zero; or its value in the clean run of the pair's
        partner (``resample_partners(seed, pairs)``). With every edge kept each gives the
        clean run.
    seed : int
        Keys the resample ablation's partners.

    Returns
    -------
    ``[sets, pairs]`` float: the metric of each pair with each set.

    Raises
    ------
    ProbeError
        Where ``max_bytes`` does not hold one copy of two pairs (naming the smallest that
        does), or the pairs at once with a metric that cannot be split.
    """
    clean, corrupted, pairs = as_pairs(clean, corrupted, model)
    check_ablation(ablation, pairs)
    max_bytes = memory_budget(model, max_bytes)
    g = graph(model)
    kept = torch.as_tensor(kept, dtype=torch.bool)
    if kept.dim() != 2 or kept.shape[1] != len(g.edges):
        raise ProbeError(f"kept must be [sets, {len(g.edges)}] (one flag per edge)")
    shares = _PatchBytes(g, model, clean, pairs)
    parts = chunks(pairs, shares.fixed + shares.per_copy, max_bytes, metric,
                   "patched runs", fixed=shares.mask)  # fmt: skip
    partners = torch.from_numpy(resample_partners(seed, pairs)) if ablation == "resample" else None
    out = []
    with hook_points(model), ungrouped():
        means = _clean_means(model, clean, pairs, parts, g) if ablation == "mean" else None
        for rows in parts:
            k = rows.stop - rows.start
            copies = max(1, min(max_rows // k, (max_bytes - k * shares.fixed)
                                // (k * shares.per_copy + shares.mask)))  # fmt: skip
            if ablation == "resample":
                source = rows_of(clean, partners[rows], pairs)  # the partners' clean runs
            else:
                source = rows_of(corrupted, rows, pairs)
            values = _patched_chunk(model, rows_of(clean, rows, pairs), source, metric, rows,
                                    kept, g, copies, ablation, means)  # fmt: skip
            check_chunk(values[0], rows, pairs, len(parts))
            out.append(values)
            if len(parts) > 1:
                release()
    values = torch.cat(out, dim=-1)
    same_form(list(values), pairs)
    return values


class _PatchBytes:
    """What exact edge patching holds, in bytes: per pair, the corrupted senders every copy
    shares (``fixed``) and, per copy, the heads' inputs and the senders' changes (float32, at
    every position) with its forward pass (``run_bytes``); per copy, the edges' masks."""

    def __init__(self, g: Graph, model: nn.Module, clean: Mapping[str, Any], pairs: int) -> None:
        positions = max((v.shape[1] for v in clean.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 1), default=1)  # fmt: skip
        d = int(model.config.hidden_size)
        n_heads, n_layers = describe(model).n_heads, describe(model).n_layers
        self.fixed = positions * 4 * d * (2 * n_layers + 1)
        self.per_copy = positions * 4 * d * (6 * n_heads + 2 * n_layers)
        self.per_copy += run_bytes(model, clean, pairs, backward=False)
        self.mask = 4 * len(g.senders) * len(g.receivers)


def _clean_means(model, clean, pairs, parts, g) -> dict[str, torch.Tensor]:
    """Each sender point's mean over every pair's clean run, per position ``[1, pos, ...]``
    (float64 sums, then the points' dtype): over the positions the attention mask holds where
    the inputs have one (a position no pair holds is 0)."""
    points, _ = sender_points(g)
    sums: dict[str, torch.Tensor] = {}
    count = None
    for rows in parts:
        inputs = rows_of(clean, rows, pairs)
        with trace(model, points) as cache:
            model(**inputs)
        mask = inputs.get("attention_mask")
        for p in points:
            v = cache[p].double()
            w = torch.ones(v.shape[:2], dtype=torch.float64, device=v.device)
            if isinstance(mask, torch.Tensor) and mask.shape == v.shape[:2]:
                w = mask.to(v.device, torch.float64)
            w = w.reshape(*w.shape, *([1] * (v.dim() - 2)))
            term = (v * w).sum(0, keepdim=True)
            sums[p] = sums[p] + term if p in sums else term
            if p == points[0]:
                count = w.sum(0, keepdim=True) if count is None else count + w.sum(0, keepdim=True)
        del cache
    means = {}
    for p, total in sums.items():
        n = count.reshape(*count.shape[:2], *([1] * (total.dim() - 2)))
        means[p] = torch.where(n > 0, total / n.clamp(min=1), 0.0).float()
    return means


def _patched_chunk(model, clean, source, metric, rows, kept, g, copies, ablation="corrupted",
                   means=None) -> torch.Tensor:  # fmt: skip
    """A chunk of pairs' metric with each set of ``kept`` edges, ``[sets, pairs]`` float,
    ``copies`` sets a forward pass; the edges left out carry the ``ablation``'s values:
    ``source``'s run's (the corrupted inputs, or the partners' clean ones), ``means``' or
    zero."""
    pairs = rows.stop - rows.start
    points, z_of = sender_points(g)
    result_of = {z: r for r, z in z_of.items()}
    s_index = torch.tensor([s for s, _ in g.edges])
    r_index = torch.tensor([r for _, r in g.edges])
    by_point, senders_of = _routes(g, points, result_of)
    W_O = dict(zip(result_points(model), (w.W_O for w in head_weights(model)), strict=True))
    out = []
    if ablation in ("corrupted", "resample"):
        with trace(model, points) as cache:
            model(**source)
        corrupted_values = {p: cache[p] for p in points}
        del cache
    elif ablation == "mean":
        corrupted_values = means
    else:
        corrupted_values = None  # zero: the difference is the value itself
    for begin in range(0, len(kept), copies):
        # removed[copy, sender, receiver]: the edge's receiver sees the sender's corrupted value.
        flags = kept[begin : begin + copies]
        n = len(flags)
        chunk = torch.zeros(n, len(g.senders), len(g.receivers))
        chunk[:, s_index, r_index] = (~flags).float()
        current: dict[str, torch.Tensor] = {}  # sender point -> its value in this run

        def record(x: torch.Tensor, hook: Hook, n=n, current=current) -> None:
            current[str(hook)] = x.unflatten(0, (n, pairs))

        def replace(x: torch.Tensor, hook: Hook, chunk=chunk, current=current) -> torch.Tensor:
            receivers = by_point[str(hook)]
            fix = None
            for point, value in current.items():
                mask = chunk[:, senders_of[point]][:, :, receivers]  # [copy, sender, recv.]
                if not mask.any():
                    continue
                diff = value if corrupted_values is None else value - corrupted_values[point]
                if point in result_of:  # each head's hook_result: z W_O
                    diff = torch.einsum("cbphe,hed->cbphd", diff, W_O[result_of[point]])
                else:
                    diff = diff.unsqueeze(-2)
                term = torch.einsum("cbpsd,csr->cbprd", diff, mask.to(diff))
                fix = term if fix is None else fix.add_(term)
            if fix is None:
                return x
            fix = fix.flatten(0, 1)
            return x - (fix if x.dim() == 4 else fix[:, :, 0])

        fns = [(p, record) for p in points] + [(p, replace) for p in by_point]
        with hooks(model, fns):
            output = model(**stacked(clean, n, pairs))
        for seen in copies_of(output, n, pairs):
            out.append(read(metric, seen, pairs, rows=rows))
    same_form(out, pairs)
    return torch.stack(out).float()


def _routes(g: Graph, points, result_of) -> tuple[dict, dict]:
    """Each receiver point's receivers, and each sender point's senders (a ``hook_z`` point's
    are its heads' ``hook_result``), as indices of ``g``'s."""
    by_point: dict[str, list[int]] = {}
    for r, (*_, point, _) in enumerate(g.receivers):
        by_point.setdefault(point, []).append(r)
    senders_of = {
        p: [i for i, (_, q, _) in enumerate(g.senders) if q == result_of.get(p, p)] for p in points
    }
    return by_point, senders_of
