"""The gradient of the metric at every head's query, key and value input (``hook_{q,k,v}_input``),
worked out for every head at once from the gradient at its projection, through the attention
norm, and kept small (``HeadInput``): what edge scoring multiplies an edge into a head by.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from probe.capture.architectures import architecture, blocks, norm_gain
from probe.capture.head_weights import head_weights
from probe.capture.names import hook_name
from probe.interventions.graph import LN1_POINTS


@dataclass
class HeadInput:
    """∂metric/∂``hook_{q,k,v}_input`` of one layer, kept small: its mean over the runs is, per
    head, γ ⊙ (W ḡ) − m · ḡ − Σ_runs a x̂ (see ``add_head_input_grads``), formed a chunk of
    positions at a time."""

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


def head_inputs(model: nn.Module) -> dict[str, HeadInput]:
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
            found[hook_name(f"hook_{part}_input", layer)] = receiver = HeadInput(
                W, kv_head, gain, None, torch.zeros(()), [], []
            )
            if isinstance(norm, nn.LayerNorm):
                W = receiver.W
                receiver.centre = torch.einsum("d,hde->he", torch.as_tensor(gain).expand(
                    W.shape[1]), W.float()) / W.shape[1]  # fmt: skip
    return found


def add_head_input_grads(
    model: nn.Module,
    heads: Mapping[str, HeadInput],
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
    / σ; ``HeadInput.chunk`` forms the gradient from them.
    """
    arch = architecture(model)
    for layer, (weights, block) in enumerate(zip(head_weights(model), blocks(model), strict=True)):
        norm = block.get_submodule(arch.ln1)
        shift = getattr(norm, "bias", None)
        scale = kept[hook_name(LN1_POINTS[0], layer)][0].float().unsqueeze(-1)
        normalized = kept[hook_name(LN1_POINTS[1], layer)][0].float()
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
