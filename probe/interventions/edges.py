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

from probe.capture.architectures import architecture, blocks, head_weights
from probe.capture.hookpoints import Hook, hook_points, hooks, trace
from probe.capture.mirror import ungroupable, ungrouped
from probe.capture.names import NORM_POINTS, hook_name, point_of
from probe.capture.spec import describe
from probe.errors import ProbeError
from probe.interventions.gradients import START, clean_start, run
from probe.interventions.pairs import (
    Metric,
    check_pairs,
    copies_of,
    mean_intervals,
    per_pair,
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


def _sender_values(cache: Mapping[str, torch.Tensor], g: Graph) -> torch.Tensor:
    """``[sender, batch, pos, d_model]`` from a cache of the senders' points."""
    values = []
    for _, point, head in g.senders:
        x = cache[point]
        values.append(x if head is None else x[:, :, head])
    return torch.stack(values)


def edges(
    model: nn.Module,
    clean: Mapping[str, Any],
    corrupted: Mapping[str, Any],
    metric: Metric,
    method: str = "eap-ig",
    steps: int = 5,
) -> pd.DataFrame:
    """Score every edge from a sender's output into a receiver's input.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A pre-LayerNorm model (GPT-2, Llama…), with its LM head where the metric reads logits.
    clean, corrupted : dict
        Keyword arguments of ``model`` for a batch of prompt pairs, of the same shapes.
    metric : callable
        ``metric(output)``: one differentiable value per pair ``[pairs]`` (a scalar for one).
    method : {"eap", "eap-ig"}
        Gradient at the corrupted run, or averaged over ``steps`` runs interpolated from the
        corrupted to the clean input (α = k/steps, k = 1…steps).
    steps : int
        EAP-IG's interpolation steps.

    Returns
    -------
    pandas.DataFrame
        One row per edge, in the order of the computation: ``sender`` (``embed``, ``L-H``,
        ``mlpL``), ``receiver`` (``L-H``, ``mlpL``, ``logits``), ``input`` (``q``, ``k``, ``v``
        into a head, empty otherwise), ``score`` (mean over pairs: the estimated change of the
        metric when the edge alone is restored to its clean value in the corrupted run), with
        its 95% interval ``score_low``, ``score_high``. ``attrs``: ``method``, ``steps``,
        ``pairs``, ``clean`` and ``corrupted`` mean metrics.
    """
    if method not in METHODS:
        raise ProbeError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
    if steps < 1:
        raise ProbeError(f"steps must be at least 1, not {steps}")
    pairs = check_pairs(clean, corrupted)
    # Attached once: graph and every run below share it; one key and value head per query head.
    with hook_points(model), ungrouped():
        g = graph(model)
        sender_points = sorted({point for _, point, _ in g.senders})
        receiver_points = sorted({point for *_, point, _ in g.receivers})
        alphas = [k / steps for k in range(1, steps + 1)] if method == "eap-ig" else [0.0]
        # With α = 1 among the steps, that copy of the gradients' run is the clean run.
        folded = len(alphas) > 1
        found, start = {}, None
        for side, inputs in (("clean", clean), ("corrupted", corrupted))[int(folded) :]:
            with torch.no_grad(), trace(model, sender_points) as cache:
                found[side] = float(torch.as_tensor(metric(model(**inputs))).float().mean())
            found[side + "_senders"] = _sender_values(cache, g)
            if side == "clean":  # the embeddings, START, are a sender: the runs' start
                start = clean_start(model, clean, cache)
        # The heads' inputs' gradients come from their projections' (see _head_input_grads).
        layers = range(describe(model).n_layers)
        head_inputs = [p for p in receiver_points if point_of(p) in INPUTS]
        outputs = [hook_name(f"hook_{part}", layer) for layer in layers for part in "qkv"]
        norms = [hook_name(p, layer) for layer in layers for p in _LN1]
        others = [p for p in receiver_points if p not in head_inputs]
        keep = norms + outputs + (sender_points if folded else [])
        values, grads, kept = run(
            model, corrupted, metric, pairs, others + outputs, start, alphas, keep,
            clean=clean if folded else None,
        )  # fmt: skip
        if folded:
            found["clean"] = float(values[-1].mean())
            found["clean_senders"] = _sender_values({p: kept[p][-1] for p in sender_points}, g)
        delta = (found["clean_senders"] - found["corrupted_senders"]).double()
    mean_grads = {point: grads[point].mean(0).double() for point in others}
    mean_grads |= _head_input_grads(model, grads, kept)
    scores = _edge_scores(g, delta, mean_grads, receiver_points, pairs)  # [edge, pairs]
    mean, low, high = mean_intervals(scores)
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
        "clean": found["clean"],
        "corrupted": found["corrupted"],
    }
    return table


def _edge_scores(
    g: Graph,
    delta: torch.Tensor,
    mean_grads: Mapping[str, torch.Tensor],
    receiver_points: list[str],
    pairs: int,
) -> torch.Tensor:
    """Each edge's score per pair, ``[edge, pairs]``: δ_sender · gradient_receiver summed over
    positions and d_model, one batched product per receiver point (all its heads at once), with
    the senders upstream of it only (those before the last that feeds it)."""
    delta = delta.transpose(0, 1).flatten(2)  # [pairs, sender, pos·d_model]
    upstream: dict[str, int] = {}
    for s, r in g.edges:
        upstream[g.receivers[r][2]] = max(upstream.get(g.receivers[r][2], 0), s + 1)
    scores = delta.new_zeros(pairs, len(g.senders), len(g.receivers))
    for point in receiver_points:
        x = mean_grads[point]  # the mean over the steps: [(head,) pairs, pos, d_model]
        x = x.flatten(-2) if x.dim() == 4 else x.flatten(-2).unsqueeze(0)
        n = upstream[point]
        columns = [r for r, (*_, p, _) in enumerate(g.receivers) if p == point]
        heads = [g.receivers[r][3] or 0 for r in columns]
        scores[:, :n, columns] = torch.bmm(delta[:, :n], x.permute(1, 2, 0))[:, :, heads]
    s_index = torch.tensor([s for s, _ in g.edges])
    r_index = torch.tensor([r for _, r in g.edges])
    return scores[:, s_index, r_index].T


INPUTS = ("hook_q_input", "hook_k_input", "hook_v_input")


def _head_input_grads(
    model: nn.Module, grads: Mapping[str, torch.Tensor], kept: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The mean over the copies of ∂metric/∂``hook_{q,k,v}_input``, heads first: ``[head,
    pairs, pos, d_model]`` float64, from ∂metric/∂``hook_{q,k,v}`` in ``grads``, and
    ``hook_{q,k,v}`` and ``ln1``'s ``hook_scale`` and ``hook_normalized`` in ``kept`` (all
    ``[copies, pairs, ...]``).

    A head's query input reaches the metric only through ``ln1`` and the head's slice of W_Q
    (key and value alike), so its gradient is the vector-Jacobian product of ∂metric/∂q through
    them, worked out here for every head at once instead of autograd running the norm and the
    projection once per head. With x̂ and σ the norm's normalised input and scale and W' = γ W_Q
    (γ its weight; for LayerNorm centred over d_model, which takes the place of its −mean
    term): ∂metric/∂x = (W' ∂q − x̂ (x̂ · W' ∂q) / d_model) / σ, exactly for LayerNorm and
    RMSNorm (eps included). x̂ · W' ∂q is (x̂ W') · ∂q, and x̂ W' is the query less what the
    norm's bias and the projection's add (β W_Q + b_Q): no product with W' per copy.
    """
    arch = architecture(model)
    found = {}
    for layer, (weights, block) in enumerate(zip(head_weights(model), blocks(model), strict=True)):
        norm = block.get_submodule(arch.ln1)
        gain = 1.0 if norm.weight is None else norm.weight.detach().float()
        gain = gain + 1 if "Gemma" in type(norm).__name__ else gain  # Gemma's 1 + weight
        gain = torch.as_tensor(gain).reshape(-1, 1)
        shift = getattr(norm, "bias", None)
        scale = kept[hook_name(_LN1[0], layer)].float().unsqueeze(-1)
        normalized = kept[hook_name(_LN1[1], layer)].float()
        parts = zip(
            "qkv",
            (weights.W_Q, weights.W_K, weights.W_V),
            (weights.b_Q, weights.b_K, weights.b_V),
            strict=True,
        )
        for part, W, b in parts:
            W, b = W.float(), b.float()  # [head, d_model, d_head], [head, d_head]
            if len(W) != len(weights.W_Q):  # grouped keys and values, ungrouped (``ungrouped``)
                W, b = W[weights.kv_head], b[weights.kv_head]
            offset = (
                b if shift is None else b + torch.einsum("d,hde->he", shift.detach().float(), W)
            )
            W = W * gain
            if isinstance(norm, nn.LayerNorm):
                W = W - W.mean(-2, keepdim=True)
            g = grads[hook_name(f"hook_{part}", layer)].float()  # [copies, n, pos, head, e]
            copies, pairs, pos, heads, _ = g.shape
            g = g / (scale * copies)  # the mean over the copies, on the small side
            # W' ∂q / σ, its mean over the copies first (W' is alike in all): [head, n·pos, d].
            total = torch.bmm(g.sum(0).flatten(0, 1).transpose(0, 1), W.transpose(1, 2))
            seen = kept[hook_name(f"hook_{part}", layer)].float() - offset  # x̂ W'
            along = (seen * g).sum(-1) / normalized.shape[-1]  # [c, n, pos, head]
            total -= torch.einsum("cnph,cnpd->hnpd", along, normalized).flatten(1, 2)
            found[hook_name(f"hook_{part}_input", layer)] = total.view(
                heads, pairs, pos, -1
            ).double()
    return found


@torch.no_grad()
def patch_edges(
    model: nn.Module,
    clean: Mapping[str, Any],
    corrupted: Mapping[str, Any],
    metric: Metric,
    kept: Sequence[Sequence[bool]],
    max_rows: int = 256,
) -> torch.Tensor:
    """The metric with only the ``kept`` edges carrying their clean values, exactly.

    The model runs on the clean input; each receiver's input has, for every edge not kept, the
    sender's value in this run replaced by its corrupted value. Several sets of edges run in one
    forward pass, as stacked copies.

    Parameters
    ----------
    kept : ``[sets, edges]`` bool
        Per set of edges, which of ``graph(model).edges`` (the rows of ``edges``) are kept.

    Returns
    -------
    ``[sets, pairs]`` float: the metric of each pair with each set.
    """
    pairs = check_pairs(clean, corrupted)
    g = graph(model)
    kept = torch.as_tensor(kept, dtype=torch.bool)
    if kept.dim() != 2 or kept.shape[1] != len(g.edges):
        raise ProbeError(f"kept must be [sets, {len(g.edges)}] (one flag per edge)")
    sender_points = sorted({point for _, point, _ in g.senders})
    # removed[set, sender, receiver]: the edge's receiver sees the sender's corrupted value.
    removed = torch.zeros(len(kept), len(g.senders), len(g.receivers))
    s_index = torch.tensor([s for s, _ in g.edges])
    r_index = torch.tensor([r for _, r in g.edges])
    removed[:, s_index, r_index] = (~kept).float()
    by_point: dict[str, list[int]] = {}
    for r, (*_, point, _) in enumerate(g.receivers):
        by_point.setdefault(point, []).append(r)
    senders_of = {p: [i for i, (_, q, _) in enumerate(g.senders) if q == p] for p in sender_points}
    out = []
    with hook_points(model), ungrouped():
        with trace(model, sender_points) as cache:
            model(**corrupted)
        corrupted_values = _sender_values(cache, g)  # [sender, pairs, pos, d_model]
        copies = max(1, max_rows // pairs)
        for begin in range(0, len(kept), copies):
            chunk = removed[begin : begin + copies]
            n = len(chunk)
            current: dict[int, torch.Tensor] = {}  # sender -> its value in this run

            def record(x: torch.Tensor, hook: Hook, n=n, current=current) -> None:
                for i in senders_of[str(hook)]:
                    head = g.senders[i][2]
                    value = x if head is None else x[:, :, head]
                    current[i] = value.unflatten(0, (n, pairs))

            def replace(x: torch.Tensor, hook: Hook, chunk=chunk, current=current) -> torch.Tensor:
                receivers = by_point[str(hook)]
                available = sorted(current)
                diff = torch.stack([current[i] - corrupted_values[i] for i in available])
                mask = chunk[:, available][:, :, receivers].to(diff)  # [copy, sender, receiver]
                fix = torch.einsum("scbpd,csr->cbprd", diff, mask).flatten(0, 1)
                return x - (fix if x.dim() == 4 else fix[:, :, 0])

            fns = [(p, record) for p in sender_points] + [(p, replace) for p in by_point]
            with hooks(model, fns):
                output = model(**stacked(clean, n, pairs))
            for seen in copies_of(output, n, pairs):
                out.append(per_pair(metric(seen), pairs))
    return torch.stack(out).float()


def circuit(
    model: nn.Module,
    clean: Mapping[str, Any],
    corrupted: Mapping[str, Any],
    metric: Metric,
    faithfulness: float = 0.8,
    *,
    scores: pd.DataFrame | None = None,
    method: str = "eap-ig",
    steps: int = 5,
    points: int = 16,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The fewest top-scoring edges whose circuit reaches ``faithfulness``, and the curve.

    Edges are ranked by the absolute value of their score (``edges``); the circuit of the top k
    is measured exactly (``patch_edges``). Faithfulness is (metric of the circuit − corrupted) /
    (clean − corrupted), the metrics averaged over pairs: 1 with every edge, 0 with none. The
    curve is measured at ``points`` edge counts spread from 0 to every edge, then the smallest
    count that reaches ``faithfulness`` is searched for by bisection between the last count
    below it and the first above (taking the curve as rising there).

    Returns
    -------
    circuit : pandas.DataFrame
        The chosen edges, ``edges``'s rows, strongest first.
    curve : pandas.DataFrame
        ``edges`` (how many of the top edges are kept), ``total_edges`` and ``faithfulness``,
        by ``edges``; ``attrs["target"]`` and ``attrs["chosen"]``.

    Raises
    ------
    ProbeError
        Where the clean and corrupted inputs score alike (faithfulness is then undefined).
    """
    if scores is None:
        scores = edges(model, clean, corrupted, metric, method=method, steps=steps)
    total = len(scores)
    order = scores.score.abs().to_numpy().argsort(kind="stable")[::-1].copy()

    def kept_for(counts: list[int]) -> torch.Tensor:
        flags = torch.zeros(len(counts), total, dtype=torch.bool)
        for i, k in enumerate(counts):
            flags[i, torch.from_numpy(order[:k])] = True
        return flags

    def measure(counts: list[int]) -> dict[int, float]:
        values = patch_edges(model, clean, corrupted, metric, kept_for(counts)).mean(-1)
        return {k: float(v) for k, v in zip(counts, values, strict=True)}

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
    curve.attrs = {"target": faithfulness, "chosen": above}
    return scores.iloc[order[:above]], curve
