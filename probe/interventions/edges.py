"""Edges between components, and the circuit of the strongest: which head feeds which, through
its query, key or value.

In a pre-LayerNorm model every component reads the residual stream, the sum of what the
embeddings, the heads and the MLPs before it wrote (plus biases, alike in every run). So each
receiver's input is a sum over senders, and an edge is one sender's term in one receiver's input.
Nodes: ``embed`` (the first block's input), ``L-H`` (head H of layer L, 0-based: its
``hook_result``), ``mlpL`` (``hook_mlp_out``) and ``logits`` (the last block's output, before the
final norm). Receivers: a head through its query, key or value input (``hook_q_input``,
``hook_k_input``, ``hook_v_input``), an MLP (``hook_mlp_in``) and the logits. Under grouped-query
attention every query head receives its own key and value inputs, as on the model's ungrouped
twin (its key and value weights repeated per query head): both run in TransformerLens's
ungrouped view (``probe.capture.mirror.ungrouped``).

Edge attribution patching (EAP, Syed et al. 2023) scores an edge by (s_clean − s_corrupted) ·
∂metric/∂(receiver's input); EAP-IG (Hanna et al. 2024) averages the gradient over runs
interpolated from the corrupted to the clean input. ``circuit`` then patches edges exactly: the
model runs on the clean input, and every edge outside the circuit gives its receiver the sender's
corrupted value instead of its value in this run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from torch import nn

from probe.capture.architectures import architecture, blocks, norm_gain
from probe.capture.head_weights import head_weights
from probe.capture.hookpoints import Hook, hook_points, hooks, trace
from probe.capture.mirror import ungroupable, ungrouped
from probe.capture.names import NORM_POINTS, hook_name
from probe.capture.spec import describe
from probe.errors import ProbeError
from probe.interventions.gradients import START, clean_start, memory_budget, run, run_bytes
from probe.interventions.guard import keeps_model
from probe.interventions.pairs import (
    PER_PAIR,
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

# The attention norm's points, scale and normalised input, that the heads' input gradients read.
_LN1 = tuple(f"ln1.{p}" for p in NORM_POINTS)

METHODS = ("eap", "eap-ig")


@dataclass
class Graph:
    """A model's nodes and edges, in the order of the computation.

    ``senders``: names, with their hook point and head (None for a whole point); ``receivers``:
    (name, input) with their hook point and head; ``edges``: (sender index, receiver index) of
    every sender upstream of the receiver.
    """

    senders: list[tuple[str, str, int | None]]
    receivers: list[tuple[str, str, str, int | None]]
    edges: list[tuple[int, int]]


def graph(model: nn.Module) -> Graph:
    """The nodes and edges of a pre-LayerNorm Hugging Face model.

    Raises
    ------
    ProbeError
        For a model whose components do not read one residual stream as a plain sum: an
        encoder-decoder, a post-LayerNorm (BERT) or a parallel-attention model, or a module that
        is not a Hugging Face model; and for grouped-query attention that probe cannot take
        apart per query head (``probe.capture.mirror.ungroupable``).

    Under grouped-query attention every query head is a receiver with its own query, key and
    value inputs, as on the model's ungrouped twin (TransformerLens's ungrouped view,
    ``probe.capture.mirror.ungrouped``, in which ``edges`` and ``patch_edges`` run the model):
    an edge into a head's key input changes the keys that head reads, and no other head's.
    """
    if getattr(model, "config", None) is None or describe(model).encoder_decoder:
        raise ProbeError("edges need a Hugging Face decoder or encoder with one residual stream")
    arch = architecture(model)
    if arch.post_ln or getattr(model.config, "use_parallel_residual", False):
        raise ProbeError(
            f"edges need a pre-LayerNorm model whose components read the residual stream as a "
            f"sum; {type(model).__name__} normalises after each sum or runs attention and MLP "
            "in parallel"
        )
    if (why := ungroupable(model)) is not None:
        raise ProbeError(f"edges enter each query head through its own key and value inputs: {why}")
    layers = range(describe(model).n_layers)
    with hook_points(model) as points:
        needed = [START] + [hook_name("hook_mlp_in", layer) for layer in layers]
        needed += [hook_name(_LN1[0], layer) for layer in layers]
        missing = [n for n in needed if n not in points]
        if missing:
            raise ProbeError(f"edges need the point {missing[0]}, which this model lacks")
    n_heads = describe(model).n_heads
    senders: list[tuple[str, str, int | None]] = [("embed", START, None)]
    receivers: list[tuple[str, str, str, int | None]] = []
    edges: list[tuple[int, int]] = []
    for layer in layers:
        upstream = list(range(len(senders)))
        for head in range(n_heads):
            for part in "qkv":
                receivers.append(
                    (f"{layer}-{head}", part, hook_name(f"hook_{part}_input", layer), head)
                )
                edges += [(s, len(receivers) - 1) for s in upstream]
        for head in range(n_heads):
            senders.append((f"{layer}-{head}", hook_name("hook_result", layer), head))
        receivers.append((f"mlp{layer}", "", hook_name("hook_mlp_in", layer), None))
        edges += [(s, len(receivers) - 1) for s in range(len(senders))]
        senders.append((f"mlp{layer}", hook_name("hook_mlp_out", layer), None))
    receivers.append(("logits", "", hook_name("hook_resid_post", layers[-1]), None))
    edges += [(s, len(receivers) - 1) for s in range(len(senders))]
    return Graph(senders, receivers, edges)


def _too_small(max_bytes: int, needed: int, what: str) -> ProbeError:
    return ProbeError(
        f"max_bytes={max_bytes:,} is too small for {what}; give at least "
        f"max_bytes={needed:,} ({needed / 2**20:,.1f} MiB)"
    )


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


def _sender_points(g: Graph) -> tuple[list[str], dict[str, str]]:
    """The points a run records for the senders (``hook_z`` for the heads), and each head
    sender's ``hook_result`` point's ``hook_z``."""
    whole = sorted({point for _, point, head in g.senders if head is None})
    z_of = {
        point: point[: -len("hook_result")] + "hook_z"
        for _, point, head in g.senders
        if head is not None
    }
    return whole + sorted(set(z_of.values())), z_of


@dataclass
class _HeadInput:
    """∂metric/∂``hook_{q,k,v}_input`` of one layer, kept small: its mean over the runs is, per
    head, γ ⊙ (W ḡ) − m · ḡ − Σ_runs a x̂ (see ``_head_input_grads``), formed a chunk of positions
    at a time."""

    weights: torch.Tensor  # [head or key/value head, d_model, d_head], the model's own (a view)
    kv_head: torch.Tensor | None  # each query head's key/value head, where keys are grouped
    gain: torch.Tensor | float  # the norm's weight γ [d_model]
    centre: torch.Tensor | None  # LayerNorm's m = mean over d_model of γ W: [head, d_head]
    grad: torch.Tensor  # ḡ: Σ_runs ∂q / (σ runs) [pairs, pos, head, d_head] float32
    along: list[torch.Tensor]  # per run a = x̂W' · ∂q / (σ runs d_model) [pairs, pos, head]
    normalized: list[torch.Tensor]  # per run x̂ [pairs, pos, d_model]

    @property
    def W(self) -> torch.Tensor:
        """``[head, d_model, d_head]``: one per query head, a grouped key or value head's
        repeated for each head it serves (made when asked for, not kept: a layer's repeated
        keys and values are as large as its queries)."""
        return self.weights if self.kv_head is None else self.weights[self.kv_head]

    def chunk(self, pairs: slice, pos: slice) -> torch.Tensor:
        """``[head, pairs, pos, d_model]`` float64 at the chunk's pairs and positions."""
        g = self.grad[pairs, pos]
        n, p, heads, _ = g.shape
        flat = g.flatten(0, 1).transpose(0, 1)  # [head, n·p, d_head]
        total = torch.bmm(flat, self.W.to(flat.dtype).transpose(1, 2)) * self.gain
        if self.centre is not None:
            total -= (flat * self.centre.unsqueeze(1)).sum(-1, keepdim=True)
        for a, x in zip(self.along, self.normalized, strict=True):
            total -= torch.einsum("nph,npd->hnpd", a[pairs, pos], x[pairs, pos]).flatten(1, 2)
        return total.view(heads, n, p, -1).double()


def _head_inputs(model: nn.Module) -> dict[str, _HeadInput]:
    """Every layer's ``hook_{q,k,v}_input`` receivers, with nothing run yet."""
    arch = architecture(model)
    found = {}
    for layer, (weights, block) in enumerate(zip(head_weights(model), blocks(model), strict=True)):
        norm = block.get_submodule(arch.ln1)
        gain = 1.0 if norm.weight is None else norm.weight.detach().float()
        gain = norm_gain(model, gain)  # Gemma's 1 + weight
        for part, W in zip("qkv", (weights.W_Q, weights.W_K, weights.W_V), strict=True):
            # Grouped keys and values, ungrouped (``ungrouped``): one per query head.
            kv_head = weights.kv_head if len(W) != len(weights.W_Q) else None
            found[hook_name(f"hook_{part}_input", layer)] = receiver = _HeadInput(
                W, kv_head, gain, None, torch.zeros(()), [], []
            )
            if isinstance(norm, nn.LayerNorm):
                W = receiver.W
                receiver.centre = torch.einsum("d,hde->he", torch.as_tensor(gain).expand(
                    W.shape[1]), W.float()) / W.shape[1]  # fmt: skip
    return found


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
        By default (``memory_budget``) half the memory free on the model's device when the call
        starts. What the call may hold at once: a chunk of pairs' runs (one forward and backward
        pass at a time, ``run_bytes``' estimate) and the few ``[pairs, pos, d_model]`` tensors per
        layer it keeps from them, then the scores' computation, whose senders' values and receivers'
        gradients are formed for a chunk of pairs and positions at a time within what is left. Pairs
        that do not fit at once run a chunk at a time, at least two (``probe.interventions.pairs``:
        the metric then takes ``pairs``). The scores do not depend on it (to float32 rounding).

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
        form (``"per pair"`` or ``"scalar"``).

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
    clean, corrupted, pairs = as_pairs(clean, corrupted)
    max_bytes = memory_budget(model, max_bytes)
    # Attached once: graph and every run below share it; one key and value head per query head.
    with hook_points(model), ungrouped():
        g = graph(model)
        budget = _Budget(g, model, max_bytes)
        alphas = [k / steps for k in range(1, steps + 1)] if method == "eap-ig" else [0.0]
        kept = _kept_bytes(model, clean, pairs, len(alphas))
        parts = chunks(pairs, kept + run_bytes(model, clean, pairs, backward=True), max_bytes,
                       metric, "runs", fixed=budget.smallest)  # fmt: skip
        moments, readings, count = Moments(), {"clean": [], "corrupted": []}, 0
        for rows in parts:
            left = max_bytes - (rows.stop - rows.start) * kept  # for the scores
            found, n = _chunk_scores(model, rows_of(clean, rows, pairs),
                                     rows_of(corrupted, rows, pairs), metric, rows, alphas, g,
                                     budget, moments, left)  # fmt: skip
            check_chunk(found["readings"][0], rows, pairs, len(parts))
            readings["clean"].append(found["readings"][0])
            readings["corrupted"].append(found["corrupted_values"])
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


def _chunk_scores(model, clean, corrupted, metric, rows, alphas, g, budget, moments, left):
    """A chunk of pairs' runs, and its edges' scores added to ``moments`` (``_edge_scores``,
    within ``left`` bytes). Returns the metric's readings (``"readings"``; the clean run's
    first) and the corrupted run's values (``"corrupted_values"``), and the chunks of pairs and
    positions the scores were summed over."""
    pairs = rows.stop - rows.start
    sender_points, z_of = _sender_points(g)
    found: dict[str, Any] = {"readings": []}
    sides = (("clean", clean), ("corrupted", corrupted))[: 1 + (0.0 not in alphas)]
    for side, inputs in sides:  # EAP's run at α = 0 is the corrupted run
        with torch.no_grad(), trace(model, sender_points) as cache:
            found["readings"].append(read(metric, model(**inputs), pairs, rows=rows))
            found[side + "_values"] = found["readings"][-1]
        found[side + "_senders"] = {p: cache[p] for p in sender_points}
        if side == "clean":  # the embeddings, START, are a sender: the runs' start
            start = clean_start(model, clean, cache)
        del cache
    receivers = _receivers(model, corrupted, metric, pairs, start, alphas, g, sender_points,
                           found, found["readings"], rows)  # fmt: skip
    senders = _sender_changes(model, found, sender_points, z_of)
    return found, _edge_scores(g, senders, receivers, budget, pairs, moments, left)


def _receivers(
    model, corrupted, metric, pairs, start, alphas, g, sender_points, found, readings, rows
):
    """Every receiver point's gradient, the mean over the steps ``alphas`` run one at a time
    (the memory of one forward and backward pass): a head input's as a ``_HeadInput``, which
    forms it a chunk at a time, the others' ``[pairs, pos, d_model]`` float64. EAP's run at
    α = 0 is the corrupted run: its metric and senders go into ``found``; every run's metric
    values into ``readings``."""
    # The heads' inputs' gradients come from their projections' (see _head_input_grads).
    layers = range(describe(model).n_layers)
    heads = _head_inputs(model)
    outputs = [hook_name(f"hook_{part}", layer) for layer in layers for part in "qkv"]
    norms = [hook_name(p, layer) for layer in layers for p in _LN1]
    others = sorted({point for *_, point, _ in g.receivers} - set(heads))
    mean_grads: dict[str, torch.Tensor] = {}
    for alpha in alphas:
        own = sender_points if alpha == 0 else []
        values, grads, kept = run(
            model, corrupted, metric, pairs, others + outputs, start, [alpha],
            norms + outputs + own, rows=rows,
        )  # fmt: skip
        for point in others:
            term = grads.pop(point)[0].double() / len(alphas)
            mean_grads[point] = mean_grads[point] + term if point in mean_grads else term
        _head_input_grads(model, heads, grads, kept, len(alphas))
        if alpha == 0:
            found["corrupted_values"] = values[0]
            found["corrupted_senders"] = {p: kept[p][0] for p in sender_points}
        readings.append(values[0])
        del values, grads, kept
    return dict(heads) | mean_grads


def _sender_changes(model, found, sender_points, z_of) -> _Senders:
    """The senders' clean − corrupted values from the two runs' in ``found`` (dropped there):
    whole points as they are, each head's as its ``hook_z`` change and W_O."""
    clean, corrupted = found.pop("clean_senders"), found.pop("corrupted_senders")
    return _Senders(
        {p: clean[p].float() - corrupted[p].float() for p in sender_points
         if p not in z_of.values()},
        {r: clean[z].float() - corrupted[z].float() for r, z in z_of.items()},
        {r: w.W_O for r, w in zip(_result_points(model), head_weights(model), strict=True)},
    )  # fmt: skip


def _result_points(model: nn.Module) -> list[str]:
    return [hook_name("hook_result", layer) for layer in range(describe(model).n_layers)]


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
    moments: Moments,
    left: int,
) -> int:
    """Add a chunk of pairs' scores ``[sender, receiver]`` to ``moments``; return the number
    of chunks of pairs and positions they took within ``left`` bytes.

    A pair's score of an edge is δ_sender · gradient_receiver summed over positions and
    d_model: per chunk of pairs and positions, one batched product per receiver point (all its
    heads at once) with the senders upstream of it only (those before the last that feeds it),
    summed over the chunks of a pair's positions; the pairs' scores then join ``moments``'
    running means and sums of squared deviations, so that no ``[pairs, edge]`` table is kept."""
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
            x = found.chunk(n, p) if isinstance(found, _HeadInput) else found[n, p].unsqueeze(0)
            m = upstream[point]
            heads = [g.receivers[r][3] or 0 for r in cols]
            product = torch.bmm(delta[:, :m].flatten(2), x.permute(1, 2, 3, 0).flatten(1, 2))
            block[:, :m, cols] += product[:, :, heads]
            del x, product
        del delta
        if p.stop == pos:  # the chunk's pairs are complete
            moments.add(block.permute(1, 2, 0))
            block = None
    return len(chunks)


INPUTS = ("hook_q_input", "hook_k_input", "hook_v_input")


def _head_input_grads(
    model: nn.Module,
    heads: Mapping[str, _HeadInput],
    grads: Mapping[str, torch.Tensor],
    kept: Mapping[str, torch.Tensor],
    runs: int,
) -> None:
    """Add one run's share of ∂metric/∂``hook_{q,k,v}_input`` to ``heads``, from
    ∂metric/∂``hook_{q,k,v}`` in ``grads``, and ``hook_{q,k,v}`` and ``ln1``'s ``hook_scale``
    and ``hook_normalized`` in ``kept`` (all ``[1, pairs, ...]``), of ``runs`` in all.

    A head's query input reaches the metric only through ``ln1`` and the head's slice of W_Q
    (key and value alike), so its gradient is the vector-Jacobian product of ∂metric/∂q through
    them, worked out here for every head at once instead of autograd running the norm and the
    projection once per head. With x̂ and σ the norm's normalised input and scale and W' = γ W_Q
    (γ its weight; for LayerNorm centred over d_model, W' = γ W_Q − m with m its mean over
    d_model, which takes the place of its −mean term): ∂metric/∂x = (W' ∂q − x̂ (x̂ · W' ∂q) /
    d_model) / σ, exactly for LayerNorm and RMSNorm (eps included). x̂ · W' ∂q is (x̂ W') · ∂q,
    and x̂ W' is the query less what the norm's bias and the projection's add (β W_Q + b_Q): no
    product with W' per run. What is kept is small, ``[pairs, pos, d_model]`` a layer and
    part: ḡ = Σ ∂q / σ (W' is alike in every run), and per run x̂ and the head's (x̂ W') · ∂q
    / σ; ``_HeadInput.chunk`` forms the gradient from them.
    """
    arch = architecture(model)
    for layer, (weights, block) in enumerate(zip(head_weights(model), blocks(model), strict=True)):
        norm = block.get_submodule(arch.ln1)
        shift = getattr(norm, "bias", None)
        scale = kept[hook_name(_LN1[0], layer)][0].float().unsqueeze(-1)
        normalized = kept[hook_name(_LN1[1], layer)][0].float()
        parts = zip("qkv", (weights.b_Q, weights.b_K, weights.b_V), strict=True)
        for part, b in parts:
            found = heads[hook_name(f"hook_{part}_input", layer)]
            W = found.W.float()
            if len(b) != len(weights.b_Q):  # grouped keys and values, ungrouped (``ungrouped``)
                b = b[weights.kv_head]
            offset = (
                b.float()
                if shift is None
                else b.float() + torch.einsum("d,hde->he", shift.detach().float(), W)
            )
            g = grads[hook_name(f"hook_{part}", layer)][0].float() / (scale * runs)
            seen = kept[hook_name(f"hook_{part}", layer)][0].float() - offset  # x̂ W'
            found.grad = found.grad + g
            found.along.append((seen * g).sum(-1) / normalized.shape[-1])  # [n, pos, head]
            found.normalized.append(normalized)


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

    Returns
    -------
    ``[sets, pairs]`` float: the metric of each pair with each set.

    Raises
    ------
    ProbeError
        Where ``max_bytes`` does not hold one copy of two pairs (naming the smallest that
        does), or the pairs at once with a metric that cannot be split.
    """
    clean, corrupted, pairs = as_pairs(clean, corrupted)
    max_bytes = memory_budget(model, max_bytes)
    g = graph(model)
    kept = torch.as_tensor(kept, dtype=torch.bool)
    if kept.dim() != 2 or kept.shape[1] != len(g.edges):
        raise ProbeError(f"kept must be [sets, {len(g.edges)}] (one flag per edge)")
    shares = _PatchBytes(g, model, clean, pairs)
    parts = chunks(pairs, shares.fixed + shares.per_copy, max_bytes, metric,
                   "patched runs", fixed=shares.mask)  # fmt: skip
    out = []
    with hook_points(model), ungrouped():
        for rows in parts:
            k = rows.stop - rows.start
            copies = max(1, min(max_rows // k, (max_bytes - k * shares.fixed)
                                // (k * shares.per_copy + shares.mask)))  # fmt: skip
            values = _patched_chunk(model, rows_of(clean, rows, pairs),
                                    rows_of(corrupted, rows, pairs), metric, rows, kept, g,
                                    copies)  # fmt: skip
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


def _patched_chunk(model, clean, corrupted, metric, rows, kept, g, copies) -> torch.Tensor:
    """A chunk of pairs' metric with each set of ``kept`` edges, ``[sets, pairs]`` float,
    ``copies`` sets a forward pass."""
    pairs = rows.stop - rows.start
    sender_points, z_of = _sender_points(g)
    result_of = {z: r for r, z in z_of.items()}
    s_index = torch.tensor([s for s, _ in g.edges])
    r_index = torch.tensor([r for _, r in g.edges])
    by_point, senders_of = _routes(g, sender_points, result_of)
    W_O = dict(zip(_result_points(model), (w.W_O for w in head_weights(model)), strict=True))
    out = []
    with trace(model, sender_points) as cache:
        model(**corrupted)
    corrupted_values = {p: cache[p] for p in sender_points}
    del cache
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
                diff = value - corrupted_values[point]
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

        fns = [(p, record) for p in sender_points] + [(p, replace) for p in by_point]
        with hooks(model, fns):
            output = model(**stacked(clean, n, pairs))
        for seen in copies_of(output, n, pairs):
            out.append(read(metric, seen, pairs, rows=rows))
    same_form(out, pairs)
    return torch.stack(out).float()


def _routes(g: Graph, sender_points, result_of) -> tuple[dict, dict]:
    """Each receiver point's receivers, and each sender point's senders (a ``hook_z`` point's
    are its heads' ``hook_result``), as indices of ``g``'s."""
    by_point: dict[str, list[int]] = {}
    for r, (*_, point, _) in enumerate(g.receivers):
        by_point.setdefault(point, []).append(r)
    senders_of = {
        p: [i for i, (_, q, _) in enumerate(g.senders) if q == result_of.get(p, p)]
        for p in sender_points
    }
    return by_point, senders_of


@keeps_model
def circuit(
    model: nn.Module,
    clean: Batch,
    corrupted: Batch,
    metric: Metric,
    faithfulness: float = 0.8,
    *,
    scores: pd.DataFrame | None = None,
    method: str = "eap-ig",
    steps: int = 5,
    points: int = 16,
    max_bytes: int | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The fewest top-scoring edges whose circuit reaches ``faithfulness``, and the curve.

    Edges are ranked by the absolute value of their score (``edges``); the circuit of the top k
    is measured exactly (``patch_edges``). Faithfulness is (metric of the circuit − corrupted) /
    (clean − corrupted), the metrics averaged over pairs: 1 with every edge, 0 with none. The
    curve is measured at ``points`` edge counts spread from 0 to every edge, then the smallest
    count that reaches ``faithfulness`` is searched for by bisection between the last count
    below it and the first above (taking the curve as rising there). ``max_bytes`` bounds what
    ``edges`` and ``patch_edges`` hold at once, as theirs does.

    Parameters
    ----------
    clean, corrupted, metric
        As ``edges`` takes them: a per-pair metric and a scalar one (their mean) give the same
        circuit.
    faithfulness : float
        The fraction of the clean metric's difference from the corrupted one to recover.
    scores : pandas.DataFrame, optional
        ``edges``'s table, where it was computed already; else ``edges`` runs with ``method``
        and ``steps``.

    Returns
    -------
    circuit : pandas.DataFrame
        The chosen edges, ``edges``'s rows, strongest first.
    curve : pandas.DataFrame
        ``edges`` (how many of the top edges are kept), ``total_edges`` and ``faithfulness``,
        by ``edges``; ``attrs["target"]``, ``attrs["chosen"]`` and ``attrs["metric"]`` (its
        form).

    Raises
    ------
    ProbeError
        Where the clean and corrupted inputs score alike (faithfulness is then undefined).
    """
    if not 0 <= faithfulness <= 1:
        raise ProbeError(f"faithfulness must be in [0, 1], not {faithfulness}")
    if points < 2:
        raise ProbeError(f"points must be at least 2 (no edge and every edge), not {points}")
    max_bytes = memory_budget(model, max_bytes)  # once: every call below holds the same
    if scores is None:
        scores = edges(model, clean, corrupted, metric, method, steps, max_bytes=max_bytes)
    total = len(scores)
    order = scores.score.abs().to_numpy().argsort(kind="stable")[::-1].copy()

    def kept_for(counts: list[int]) -> torch.Tensor:
        flags = torch.zeros(len(counts), total, dtype=torch.bool)
        for i, k in enumerate(counts):
            flags[i, torch.from_numpy(order[:k])] = True
        return flags

    clean, corrupted, pairs = as_pairs(clean, corrupted)
    readings = []

    def measure(counts: list[int]) -> dict[int, float]:
        flags = kept_for(counts)
        values = patch_edges(model, clean, corrupted, metric, flags, max_bytes=max_bytes)
        readings.append(values)
        return {k: float(v) for k, v in zip(counts, values.mean(-1), strict=True)}

    ends = measure([total, 0])
    spread = ends[total] - ends[0]
    if abs(spread) < 1e-12:
        raise ProbeError("the clean and corrupted inputs score alike: faithfulness is undefined")
    grid = sorted({round(total * (i / (points - 1)) ** 2) for i in range(points)} - {0, total})
    found = ends | measure(grid)

    def faith(k: int) -> float:
        return (found[k] - ends[0]) / spread

    counts = sorted(found)
    above = next(k for k in counts if faith(k) >= faithfulness or k == total)
    below = max((k for k in counts if k < above), default=0)
    while above - below > 1:
        middle = (above + below) // 2
        found |= measure([middle])
        above, below = (middle, below) if faith(middle) >= faithfulness else (above, middle)
    curve = pd.DataFrame(
        {
            "edges": sorted(found),
            "total_edges": total,
            "faithfulness": [faith(k) for k in sorted(found)],
        }
    )
    curve.attrs = {"target": faithfulness, "chosen": above, "metric": same_form(readings, pairs),
                   "max_bytes": max_bytes}  # fmt: skip
    return scores.iloc[order[:above]], curve
