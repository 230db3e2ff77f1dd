"""Edge attribution: every edge's score, the estimated change of the metric when the edge alone is
restored to its clean value in the corrupted run (``edges``).

Edge attribution patching (EAP, Syed et al. 2023) scores an edge of the graph (``graph``) by
(s_clean − s_corrupted) · ∂metric/∂(receiver's input); EAP-IG (Hanna et al. 2024) averages the
gradient over runs interpolated from the corrupted to the clean input. The runs take a chunk of
pairs at a time, and the scores a chunk of pairs and positions at a time, within ``max_bytes``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from torch import nn

from probe.capture.head_weights import head_weights
from probe.capture.hookpoints import hook_points, trace
from probe.capture.modes import ungrouped
from probe.capture.names import hook_name
from probe.capture.spec import describe
from probe.errors import ProbeError
from probe.interventions.gradients import clean_start, memory_budget, metric_gradients, run_bytes
from probe.interventions.graph import LN1_POINTS, Graph, graph, result_points, sender_points
from probe.interventions.guard import keeps_model
from probe.interventions.head_input_grads import HeadInput, add_head_input_grads, head_inputs
from probe.interventions.pairs import (
    PER_PAIR,
    Batch,
    Metric,
    Moments,
    as_pairs,
    check_chunk,
    chunks,
    read,
    release,
    rows_of,
    same_form,
)
from probe.interventions.progress import advance, long_work, shown
from probe.interventions.stability import RESAMPLES, BootstrapSums, check_resamples

METHODS = ("eap", "eap-ig")


@keeps_model
def edges(
    model: nn.Module,
    clean: Batch,
    corrupted: Batch,
    metric: Metric,
    method: str = "eap-ig",
    steps: int = 5,
    *,
    max_bytes: int | None = None,
    resamples: int = RESAMPLES,
    seed: int = 0,
    progress: bool | None = None,
) -> pd.DataFrame:
    """Score every edge from a sender's output into a receiver's input.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A pre-LayerNorm model (GPT-2, Llama…), with its LM head where the metric reads logits.
    clean, corrupted : dict or torch.Tensor
        Keyword arguments of ``model`` for a batch of prompt pairs, of the same shapes, or token
        ids ``[pairs, pos]``.
    metric : callable
        ``metric(logits)``: one differentiable value per pair ``[pairs]``, or a scalar over the
        batch, as TransformerLens's metrics return (the same scores, without intervals).
        ``metric(logits, pairs)`` where it reads per-pair data of its own: ``pairs`` is the
        slice of the batch its logits hold (see ``max_bytes``).
    method : {"eap", "eap-ig"}
        Gradient at the corrupted run, or averaged over ``steps`` runs interpolated from the
        corrupted to the clean input (α = k/steps, k = 1…steps), run one after the other.
    steps : int
        EAP-IG's interpolation steps.
    max_bytes : int, optional
        By default (``memory_budget``) a share (``gradients.FREE_SHARE``) of the memory free on the
        model's device when the call starts. What the call may hold at once: a chunk of pairs' runs
        (one forward and backward pass at a time, ``run_bytes``' estimate) and the few
        ``[pairs, pos, d_model]`` tensors per layer it keeps from them, then the scores'
        computation, whose senders' values and receivers' gradients are formed for a chunk of pairs
        and positions at a time within what is left. Pairs that do not fit at once run a chunk at a
        time, at least two (``probe.interventions.pairs``: the metric then takes ``pairs``). The
        scores do not depend on it (to float32 rounding).
    resamples, seed : int
        Bootstrap resamples of the pairs (at least 2), keyed by ``seed``, whose weighted sums
        of the per-pair scores are kept for the circuit's stability (``BootstrapSums``, in
        ``attrs["bootstrap"]``): no run more, and ``[resamples, edges]`` kept.
    progress : bool, optional
        A tqdm progress bar on stderr: by default where stderr is a terminal
        (``probe.interventions.progress``); ``False`` never, ``True`` always.

    Returns
    -------
    pandas.DataFrame
        One row per edge, in the order of the computation: ``sender`` (``embed``, ``L-H``,
        ``mlpL``), ``receiver`` (``L-H``, ``mlpL``, ``logits``), ``input`` (``q``, ``k``, ``v``
        into a head, empty otherwise), ``score`` (mean over pairs: the estimated change of the
        metric when the edge alone is restored to its clean value in the corrupted run), with
        its 95% interval ``score_low``, ``score_high`` (NaN for one pair or a scalar metric).
        ``attrs``: ``method``, ``steps``, ``pairs``, ``clean`` and ``corrupted`` mean metrics,
        ``chunks`` (of pairs and positions the scores were summed over) and the ``metric``'s
        form (``"per pair"`` or ``"scalar"``); ``bootstrap``, the ``BootstrapSums`` of the
        per-pair scores (None for a scalar metric, whose per-pair terms are not the pairs').

    Raises
    ------
    ProbeError
        Besides bad pairs, metric or model: a ``max_bytes`` too small for two pairs, naming
        the smallest that works, or pairs that do not fit it at once with a metric that cannot
        be split (a scalar, or one that does not take ``pairs``).
    """
    if method not in METHODS:
        raise ProbeError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
    if steps < 1:
        raise ProbeError(f"steps must be at least 1, not {steps}")
    resamples = check_resamples(resamples)
    clean, corrupted, pairs = as_pairs(clean, corrupted, model)
    max_bytes = memory_budget(model, max_bytes)
    tokens = clean["input_ids"].shape[-1] if "input_ids" in clean else 1
    runs = 2 + 3 * (steps if method == "eap-ig" else 1)  # a backward counts as two forwards
    long_work("probe.edges()", f"{pairs:,} pairs and steps={steps:,}", model, pairs * tokens * runs)
    # Attached once: graph and every run below share it; one key and value head per query head.
    with hook_points(model), ungrouped():
        g = graph(model)
        budget = _Budget(g, model, max_bytes)
        alphas = [k / steps for k in range(1, steps + 1)] if method == "eap-ig" else [0.0]
        kept = _kept_bytes(model, clean, pairs, len(alphas))
        parts = chunks(pairs, kept + run_bytes(model, clean, pairs, backward=True), max_bytes,
                       metric, "runs", fixed=budget.smallest)  # fmt: skip
        moments, readings, count = Moments(), {"clean": [], "corrupted": []}, 0
        boot = BootstrapSums(len(g.edges), resamples, seed)
        with shown(f"edges ({method})", pairs * len(alphas), progress, "pair-step"):
            for rows in parts:
                left = max_bytes - (rows.stop - rows.start) * kept  # for the scores
                runs, n = _chunk_scores(model, rows_of(clean, rows, pairs),
                                        rows_of(corrupted, rows, pairs), metric, rows, alphas, g,
                                        budget, (moments, boot, rows.start), left)  # fmt: skip
                check_chunk(runs.clean, rows, pairs, len(parts))
                readings["clean"].append(runs.clean)
                readings["corrupted"].append(runs.corrupted)
                count += n
                if len(parts) > 1:
                    release()
    metric_form = same_form([torch.cat(v) for v in readings.values()], pairs)
    s_index = torch.tensor([s for s, _ in g.edges])
    r_index = torch.tensor([r for _, r in g.edges])
    mean, low, high = (v[s_index, r_index] for v in moments.intervals())
    if metric_form != PER_PAIR:  # a scalar's per-pair terms are shares of one value
        low, high = torch.full_like(mean, torch.nan), torch.full_like(mean, torch.nan)
    table = pd.DataFrame(
        {
            "sender": [g.senders[s][0] for s, _ in g.edges],
            "receiver": [g.receivers[r][0] for _, r in g.edges],
            "input": [g.receivers[r][1] for _, r in g.edges],
            "score": mean.numpy(),
            "score_low": low.numpy(),
            "score_high": high.numpy(),
        }
    )
    table.attrs = {
        "method": method,
        "steps": steps if method == "eap-ig" else 0,
        "pairs": pairs,
        "clean": float(torch.cat(readings["clean"]).double().mean()),
        "corrupted": float(torch.cat(readings["corrupted"]).double().mean()),
        "chunks": count,
        "metric": metric_form,
        "max_bytes": max_bytes,
        "bootstrap": boot if metric_form == PER_PAIR else None,
    }
    return table


def _kept_bytes(model: nn.Module, inputs: Mapping[str, Any], pairs: int, runs: int) -> int:
    """What a pair's runs keep for its scores (float32 ``[pos, d_model]`` tensors a layer):
    the senders of both runs and their changes, each head input's ḡ and, per run, the norm's
    normalised input and the heads' ``along``, and the other receivers' float64 gradients."""
    spec = describe(model)
    d, L, H = int(model.config.hidden_size), spec.n_layers, spec.n_heads
    positions = max((v.shape[1] for v in inputs.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 1), default=1)  # fmt: skip
    row = 4 * d * (3 * (2 * L + 1) + 3 * L + L * runs + 2 * (L + 1)) + 4 * H * 3 * L * runs
    return positions * row


@dataclass
class _Runs:
    """What a chunk of pairs' clean and corrupted runs give the scores: the metric on each input
    (``[pairs]``, ``[1]`` for a scalar metric) and the senders' values in each (point ->
    ``[pairs, ...]``), dropped once their changes are formed (``_sender_changes``)."""

    clean: torch.Tensor
    clean_senders: dict[str, torch.Tensor]
    corrupted: torch.Tensor | None = None  # EAP's is its run at α = 0 (``_receivers``)
    corrupted_senders: dict[str, torch.Tensor] = field(default_factory=dict)


def _chunk_scores(model, clean, corrupted, metric, rows, alphas, g, budget, moments, left):
    """A chunk of pairs' runs, and its edges' scores added to ``moments`` (the ``Moments``,
    ``BootstrapSums`` and the chunk's first pair: ``_edge_scores``,
    within ``left`` bytes). Returns the runs' metrics (``_Runs``) and the chunks of pairs and
    positions the scores were summed over."""
    pairs = rows.stop - rows.start
    points, z_of = sender_points(g)

    def traced(inputs):  # the metric and the senders' values, without gradients
        with torch.no_grad(), trace(model, points) as cache:
            reading = read(metric, model(**inputs), pairs, rows=rows)
        return reading, {p: cache[p] for p in points}

    runs = _Runs(*traced(clean))
    # The embeddings, START, are a sender: the clean run's is the runs' start.
    start = clean_start(model, clean, runs.clean_senders)
    if 0.0 not in alphas:  # EAP's run at α = 0 is the corrupted run
        runs.corrupted, runs.corrupted_senders = traced(corrupted)
    receivers = _receivers(model, corrupted, metric, pairs, start, alphas, g, points, runs, rows)
    senders = _sender_changes(model, runs, points, z_of)
    return runs, _edge_scores(g, senders, receivers, budget, pairs, moments, left)


def _receivers(model, corrupted, metric, pairs, start, alphas, g, points, runs, rows):
    """Every receiver point's gradient, the mean over the steps ``alphas`` run one at a time
    (the memory of one forward and backward pass): a head input's as a ``HeadInput``, which
    forms it a chunk at a time, the others' ``[pairs, pos, d_model]`` float64. EAP's run at
    α = 0 is the corrupted run: its metric and senders go into ``runs``."""
    # The heads' inputs' gradients come from their projections' (see add_head_input_grads).
    layers = range(describe(model).n_layers)
    heads = head_inputs(model)
    outputs = [hook_name(f"hook_{part}", layer) for layer in layers for part in "qkv"]
    norms = [hook_name(p, layer) for layer in layers for p in LN1_POINTS]
    others = sorted({point for *_, point, _ in g.receivers} - set(heads))
    mean_grads: dict[str, torch.Tensor] = {}
    for alpha in alphas:
        own = points if alpha == 0 else []
        values, grads, kept = metric_gradients(
            model, corrupted, metric, pairs, others + outputs, start, [alpha],
            norms + outputs + own, rows=rows,
        )  # fmt: skip
        for point in others:
            term = grads.pop(point)[0].double() / len(alphas)
            mean_grads[point] = mean_grads[point] + term if point in mean_grads else term
        add_head_input_grads(model, heads, grads, kept, len(alphas))
        advance(pairs)
        if alpha == 0:
            runs.corrupted = values[0]
            runs.corrupted_senders = {p: kept[p][0] for p in points}
        del values, grads, kept
    return dict(heads) | mean_grads


def _sender_changes(model, runs: _Runs, points, z_of) -> _Senders:
    """The senders' clean − corrupted values from the two runs' in ``runs`` (dropped there):
    whole points as they are, each head's as its ``hook_z`` change and W_O."""
    clean, corrupted = runs.clean_senders, runs.corrupted_senders
    runs.clean_senders, runs.corrupted_senders = {}, {}
    return _Senders(
        {p: clean[p].float() - corrupted[p].float() for p in points
         if p not in z_of.values()},
        {r: clean[z].float() - corrupted[z].float() for r, z in z_of.items()},
        {r: w.W_O for r, w in zip(result_points(model), head_weights(model), strict=True)},
    )  # fmt: skip


@dataclass
class _Senders:
    """What each sender's value differs by, clean − corrupted, kept small: a head's by its
    ``hook_z`` (its ``hook_result`` is z W_O, formed a chunk of positions at a time) and a whole
    point as it is (``[pairs, pos, d_model]``)."""

    points: dict[str, torch.Tensor]  # START and hook_mlp_out points -> [pairs, pos, d_model]
    z: dict[str, torch.Tensor]  # hook_result point -> Δz [pairs, pos, head, d_head]
    W_O: dict[str, torch.Tensor]  # hook_result point -> W_O [head, d_head, d_model]

    def chunk(self, g: Graph, pairs: slice, pos: slice) -> torch.Tensor:
        """``[pairs, sender, pos, d_model]`` float64: every sender's difference at the chunk's
        pairs and positions."""
        d = next(iter(self.points.values())).shape[-1]
        first = next(iter(self.points.values()))[pairs, pos]
        out = torch.empty(first.shape[0], len(g.senders), first.shape[1], d, dtype=torch.float64,
                          device=first.device)  # fmt: skip
        for i, (_, point, head) in enumerate(g.senders):
            if head is None:
                out[:, i] = self.points[point][pairs, pos]
            elif head == 0:  # the layer's heads, in order, at once
                z, W_O = self.z[point][pairs, pos], self.W_O[point]
                result = torch.einsum("nphe,hed->nhpd", z, W_O.to(z.dtype))
                out[:, i : i + len(W_O)] = result
        return out


class _Budget:
    """How many pairs and positions the scores' computation takes at a time within
    ``max_bytes``: per position, every sender's value and one receiver point's gradients
    (float64, with their float32 making); per pair, its scores ``[sender, receiver]``; and
    throughout, the running means and spreads over the pairs."""

    def __init__(self, g: Graph, model: nn.Module, max_bytes: int) -> None:
        spec = describe(model)
        d = int(model.config.hidden_size)
        S, R, H = len(g.senders), len(g.receivers), spec.n_heads
        self.per_row = d * (8 * S + 32 * H)
        self.per_pair = 3 * 8 * S * R
        weights = head_weights(model)[0].W_O
        copies = 0 if weights.dtype == torch.float32 else 2 * 4 * weights[0].numel() * H
        self.fixed = 2 * 8 * S * R + copies
        # The least the scores take: one position (``chunks``' share of what the runs leave).
        self.smallest = self.fixed + self.per_pair + self.per_row

    def chunks(self, pairs: int, pos: int, max_bytes: int) -> list[tuple[slice, slice]]:
        """The chunks ``(pairs, positions)`` within ``max_bytes`` (at least ``smallest``):
        whole pairs where one fits, else a pair at a time in runs of positions."""
        left = max(int(max_bytes), self.smallest) - self.fixed
        whole = self.per_pair + pos * self.per_row
        if left >= whole:
            n = min(pairs, left // whole)
            return [(slice(i, min(i + n, pairs)), slice(0, pos)) for i in range(0, pairs, n)]
        p = (left - self.per_pair) // self.per_row
        return [
            (slice(i, i + 1), slice(j, min(j + p, pos)))
            for i in range(pairs)
            for j in range(0, pos, p)
        ]


def _edge_scores(
    g: Graph,
    senders: _Senders,
    receivers: Mapping[str, Any],
    budget: _Budget,
    pairs: int,
    moments: tuple[Moments, BootstrapSums, int],
    left: int,
) -> int:
    """Add a chunk of pairs' scores ``[sender, receiver]`` to ``moments``; return the number
    of chunks of pairs and positions they took within ``left`` bytes.

    A pair's score of an edge is δ_sender · gradient_receiver summed over positions and
    d_model: per chunk of pairs and positions, one batched product per receiver point (all its
    heads at once) with the senders upstream of it only (those before the last that feeds it),
    summed over the chunks of a pair's positions; the pairs' scores then join ``moments``'
    running means and sums of squared deviations and the bootstrap's weighted sums (the pairs'
    indices from the chunk's first, ``start``), so that no ``[pairs, edge]`` table is kept."""
    moments, boot, start = moments
    s_index = torch.tensor([s for s, _ in g.edges])
    r_index = torch.tensor([r for _, r in g.edges])
    upstream: dict[str, int] = {}
    for s, r in g.edges:
        upstream[g.receivers[r][2]] = max(upstream.get(g.receivers[r][2], 0), s + 1)
    columns: dict[str, list[int]] = {}
    for r, (*_, point, _) in enumerate(g.receivers):
        columns.setdefault(point, []).append(r)
    first = next(iter(senders.points.values()))
    pos = first.shape[1]
    chunks = budget.chunks(pairs, pos, left)
    block = None
    for n, p in chunks:
        if p.start == 0:
            block = torch.zeros(n.stop - n.start, len(g.senders), len(g.receivers),
                                dtype=torch.float64, device=first.device)  # fmt: skip
        delta = senders.chunk(g, n, p)  # [pairs, sender, pos, d_model]
        for point, cols in columns.items():
            found = receivers[point]
            x = found.chunk(n, p) if isinstance(found, HeadInput) else found[n, p].unsqueeze(0)
            m = upstream[point]
            heads = [g.receivers[r][3] or 0 for r in cols]
            product = torch.bmm(delta[:, :m].flatten(2), x.permute(1, 2, 3, 0).flatten(1, 2))
            block[:, :m, cols] += product[:, :, heads]
            del x, product
        del delta
        if p.stop == pos:  # the chunk's pairs are complete
            moments.add(block.permute(1, 2, 0))
            boot.add(block[:, s_index, r_index], slice(start + n.start, start + n.stop))
            block = None
    return len(chunks)
