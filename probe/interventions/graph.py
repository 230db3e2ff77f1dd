"""The graph of edges between components: its nodes, the senders and receivers, and the edges from
every sender into every receiver downstream of it.

In a pre-LayerNorm model every component reads the residual stream, the sum of what the
embeddings, the heads and the MLPs before it wrote (plus biases, alike in every run). So each
receiver's input is a sum over senders, and an edge is one sender's term in one receiver's input.
Nodes: ``embed`` (the first block's input), ``L-H`` (head H of layer L, 0-based: its
``hook_result``), ``mlpL`` (``hook_mlp_out``) and ``logits`` (the last block's output, before the
final norm). Receivers: a head through its query, key or value input (``hook_q_input``,
``hook_k_input``, ``hook_v_input``), an MLP (``hook_mlp_in``) and the logits. Under grouped-query
attention every query head receives its own key and value inputs, as on the model's ungrouped
twin (its key and value weights repeated per query head): edge scoring (``edge_scores``) and
edge patching (``edge_patching``) run in TransformerLens's ungrouped view
(``probe.capture.modes.ungrouped``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from probe.capture.architectures import architecture
from probe.capture.hookpoints import hook_points
from probe.capture.modes import ungroupable
from probe.capture.names import NORM_POINTS, hook_name
from probe.capture.spec import describe
from probe.errors import ProbeError
from probe.interventions.gradients import START

# The attention norm's points, scale and normalised input, that the heads' input gradients read.
LN1_POINTS = tuple(f"ln1.{p}" for p in NORM_POINTS)


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
        apart per query head (``probe.capture.modes.ungroupable``).

    Under grouped-query attention every query head is a receiver with its own query, key and
    value inputs, as on the model's ungrouped twin (TransformerLens's ungrouped view,
    ``probe.capture.modes.ungrouped``, in which ``edges`` and ``patch_edges`` run the model):
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
        needed += [hook_name(LN1_POINTS[0], layer) for layer in layers]
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


def sender_points(g: Graph) -> tuple[list[str], dict[str, str]]:
    """The points a run records for the senders (``hook_z`` for the heads), and each head
    sender's ``hook_result`` point's ``hook_z``."""
    whole = sorted({point for _, point, head in g.senders if head is None})
    z_of = {
        point: point[: -len("hook_result")] + "hook_z"
        for _, point, head in g.senders
        if head is not None
    }
    return whole + sorted(set(z_of.values())), z_of


def result_points(model: nn.Module) -> list[str]:
    """Each layer's ``hook_result`` point, where its heads send from, in the order of the layers."""
    return [hook_name("hook_result", layer) for layer in range(describe(model).n_layers)]
