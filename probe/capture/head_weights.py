"""A model's attention weights split into heads (``HeadWeights``, in the paper's orientation),
the head count they give, and offloaded weights loaded for the moment they are read
(``materialized``).

Where each architecture keeps the projections is ``probe.capture.architectures``'s.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, fields

import torch
from torch import nn

from probe.capture.architectures import Architecture, architecture, blocks, head_dim


@dataclass
class HeadWeights:
    """One layer's attention weights split into heads, in the paper's orientation.

    ``W_Q`` ``[n_heads, d_model, d_head]``; ``W_K``, ``W_V`` ``[n_kv_heads, d_model, d_head]``;
    ``W_O`` ``[n_heads, d_head, d_model]``; biases ``[n_heads or n_kv_heads, d_head]`` and
    ``b_O`` ``[d_model]`` (zeros where the model has none). Query head i reads key/value head
    ``kv_head[i]`` (grouped-query attention; the identity otherwise).
    """

    W_Q: torch.Tensor
    W_K: torch.Tensor
    W_V: torch.Tensor
    W_O: torch.Tensor
    b_Q: torch.Tensor
    b_K: torch.Tensor
    b_V: torch.Tensor
    b_O: torch.Tensor
    kv_head: torch.Tensor

    @property
    def n_heads(self) -> int:
        return self.W_Q.shape[0]


def split_fused(
    x: torch.Tensor, fused: str, n_heads: int, d_head: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the output of a fused Q/K/V projection into per-head queries, keys and values.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., out]``: the projection's output, or its weight as ``[d_model, out]``.
    fused : str
        The layout, ``Architecture.fused``: ``"gpt2"`` and ``"linear"`` [Q | K | V] (K and V
        may have fewer heads), ``"neox"`` per head [q_i | k_i | v_i].
    n_heads, d_head : int
        Query heads and their width.

    Returns
    -------
    tuple of torch.Tensor
        Views of ``x``: q ``[..., n_heads, d_head]``, k and v ``[..., n_kv_heads, d_head]``,
        so that writing into them writes into ``x``.
    """
    if fused == "neox":
        return x.unflatten(-1, (n_heads, 3 * d_head)).split(d_head, dim=-1)
    q_width = n_heads * d_head
    kv_width = (x.shape[-1] - q_width) // 2
    q, k, v = x.split([q_width, kv_width, kv_width], dim=-1)
    return tuple(t.unflatten(-1, (-1, d_head)) for t in (q, k, v))


def _split_in(weight: torch.Tensor, bias: torch.Tensor | None, d_head: int):
    """Split a Linear ``y = x Wᵀ + b`` with n·d_head outputs into n heads.

    Returns W ``[n, d_model, d_head]`` and b ``[n, d_head]``.
    """
    n = weight.shape[0] // d_head
    W = weight.T.reshape(weight.shape[1], n, d_head).transpose(0, 1)
    b = torch.zeros(n, d_head, dtype=weight.dtype) if bias is None else bias.view(n, d_head)
    return W, b


def output_weights(o: nn.Module, d_head: int) -> torch.Tensor:
    """W_O ``[n_heads, d_head, d_model]`` of an output projection (Linear, or GPT-2's Conv1D)."""
    if type(o).__name__ == "Conv1D":  # y = x W + b with W [in, out]
        return o.weight.reshape(-1, d_head, o.weight.shape[1])
    return o.weight.T.reshape(-1, d_head, o.weight.shape[0])


def head_count(model: nn.Module, attention: str | None = None) -> int:
    """Query heads per layer of one attention (see ``architecture``)."""
    arch = architecture(model, attention)
    o = blocks(model, attention)[0].get_submodule(arch.o)
    with materialized(o):
        return output_weights(o, head_dim(model, attention)).shape[0]


@contextmanager
def materialized(module: nn.Module) -> Iterator[bool]:
    """Within the block, the weights of ``module`` that accelerate offloaded (``device_map``
    with CPU or disk offload, where they otherwise sit on the meta device) are loaded where the
    module computes; yields whether any were."""
    offloaded = [m for m in module.modules() if getattr(getattr(m, "_hf_hook", None), "offload", 0)]
    if not offloaded:
        yield False
        return
    from accelerate.utils import align_module_device

    with ExitStack() as stack:
        for m in offloaded:
            stack.enter_context(align_module_device(m))
        yield True


def head_weights(model: nn.Module, attention: str | None = None) -> list[HeadWeights]:
    """Every layer's per-head attention weights, in the layout of ``probe.MultiHeadAttention``.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A supported architecture (see ``probe.capture.architectures.SUPPORTED``).
    attention : str, optional
        Which attention of an encoder-decoder model: ``"encoder.attn"`` (the default),
        ``"decoder.attn"`` or ``"decoder.cross_attn"``, whose W_Q reads the decoder's stream
        and W_K, W_V the encoder's output.

    Returns
    -------
    list of HeadWeights
        One per layer, detached views of the model's parameters (copies, for layers that
        accelerate offloaded; ``iter_head_weights`` holds one layer at a time).
    """
    return list(iter_head_weights(model, attention))


@torch.no_grad()
def iter_head_weights(model: nn.Module, attention: str | None = None) -> Iterator[HeadWeights]:
    """``head_weights`` one layer at a time."""
    arch = architecture(model, attention)
    d_head = head_dim(model, attention)
    for block in blocks(model, attention):
        with materialized(block) as copy:
            weights = _block_weights(block, arch, d_head)
        if copy:  # the offloaded originals go back to the meta device
            weights = HeadWeights(
                **{f.name: getattr(weights, f.name).clone() for f in fields(weights)}
            )
        yield weights


def _block_weights(block: nn.Module, arch: Architecture, d_head: int) -> HeadWeights:
    o = block.get_submodule(arch.o)
    if arch.fused:
        qkv = block.get_submodule(arch.qkv)
        # The weight as [d_model, out] (GPT-2's Conv1D already is), split as the output is.
        w = qkv.weight if arch.fused == "gpt2" else qkv.weight.T
        b = (
            torch.zeros(w.shape[1], dtype=w.dtype, device=w.device)
            if qkv.bias is None
            else qkv.bias
        )
        n_heads = output_weights(o, d_head).shape[0]
        W_Q, W_K, W_V = (W.transpose(0, 1) for W in split_fused(w, arch.fused, n_heads, d_head))
        b_Q, b_K, b_V = split_fused(b, arch.fused, n_heads, d_head)
    else:
        (W_Q, b_Q), (W_K, b_K), (W_V, b_V) = (
            _split_in(p.weight, p.bias, d_head)
            for p in (block.get_submodule(n) for n in (arch.q, arch.k, arch.v))
        )
    n_heads, n_kv = W_Q.shape[0], W_K.shape[0]
    W_O = output_weights(o, d_head)
    return HeadWeights(
        W_Q=W_Q.detach(),
        W_K=W_K.detach(),
        W_V=W_V.detach(),
        W_O=W_O.detach(),
        b_Q=b_Q.detach(),
        b_K=b_K.detach(),
        b_V=b_V.detach(),
        b_O=torch.zeros(W_O.shape[-1], dtype=W_O.dtype) if o.bias is None else o.bias.detach(),
        kv_head=torch.arange(n_heads) // (n_heads // n_kv),
    )
