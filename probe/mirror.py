"""Probe's hook points on pretrained Hugging Face models, through transformers' attention registry.

Instead of re-implementing models, we register one attention function under the name
``"probe"`` (with the eager mask function, so padded batches stay masked) and switch a model
to it for the duration of a ``probe.trace`` or ``probe.hooks`` block. Transformers hands the
function every layer's per-head query, key and value; it computes scores, pattern and z
through the hook points, exactly as the eager implementation would.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from probe.architectures import architecture, blocks, head_dim, materialized, output_weights
from probe.hookpoints import HookPoint

IMPLEMENTATION = "probe"
SUFFIXES = (
    "hook_q",
    "hook_k",
    "hook_v",
    "hook_attn_scores",
    "hook_pattern",
    "hook_z",
    "hook_result",
)


class _Layer(nn.Module):
    """The hook points of one layer, as attributes (``layer.hook_z``)."""

    def __init__(self) -> None:
        super().__init__()
        for suffix in SUFFIXES:
            setattr(self, suffix, HookPoint())


class Mirror:
    """Hook points for every layer of one model, and what is needed to run them."""

    def __init__(self, model: PreTrainedModel) -> None:
        arch = architecture(model)
        self.model = model
        self.d_head = head_dim(model)
        layer_blocks = blocks(model)
        self.layers = [_Layer() for _ in layer_blocks]
        self.points = {
            f"blocks.{i}.attn.{s}": getattr(layer, s)
            for i, layer in enumerate(self.layers)
            for s in SUFFIXES
        }
        self.outputs = [b.get_submodule(arch.o) for b in layer_blocks]
        # A module shared by several layers (ALBERT) learns its layer from its call count.
        self.layers_of: dict[int, list[int]] = {}
        for i, b in enumerate(layer_blocks):
            self.layers_of.setdefault(id(b.get_submodule(arch.attention)), []).append(i)
        self.calls: dict[int, int] = {}
        self.pending: dict[int, torch.Tensor] = {}
        self.users = 0

    def layer(self, module: nn.Module) -> int:
        layers = self.layers_of[id(module)]
        if len(layers) == 1:
            return layers[0]
        n = self.calls.get(id(module), 0)
        self.calls[id(module)] = n + 1
        return layers[n % len(layers)]

    def _start_forward(self, *_) -> None:
        self.calls.clear()
        self.pending.clear()

    def _replace_output(self, module, _inputs, output):
        # hook_result was observed: the layer output is Σ_i result_i + b^O, edits included.
        return self.pending.pop(id(module), output)

    @contextmanager
    def attached(self) -> Iterator[None]:
        model = self.model
        previous = model.config._attn_implementation
        handles = [model.base_model.register_forward_pre_hook(self._start_forward)]
        handles += [o.register_forward_hook(self._replace_output) for o in set(self.outputs)]
        for key in self.layers_of:
            _MIRRORS[key] = self
        try:
            model.set_attn_implementation(IMPLEMENTATION)
            yield
        finally:
            model.set_attn_implementation(previous)
            for h in handles:
                h.remove()
            for key in self.layers_of:
                _MIRRORS.pop(key, None)


_MIRRORS: dict[int, Mirror] = {}  # id(attention module) -> its model's active mirror
_ACTIVE: dict[int, Mirror] = {}  # id(model) -> its active mirror (nested traces share it)


@contextmanager
def mirrored(model: PreTrainedModel) -> Iterator[dict[str, HookPoint]]:
    """Switch ``model`` to probe's attention for the block; yields its hook points by name."""
    mirror = _ACTIVE.get(id(model))
    if mirror is not None:
        yield mirror.points
        return
    mirror = _ACTIVE[id(model)] = Mirror(model)
    try:
        with mirror.attached():
            yield mirror.points
    finally:
        del _ACTIVE[id(model)]


def probe_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention through the hook points of the module's layer.

    Receives query ``[batch, head, q_pos, d_head]`` and key/value ``[batch, kv_head, k_pos,
    d_head]`` from transformers, returns z ``[batch, q_pos, head, d_head]`` and the pattern.
    """
    mirror = _MIRRORS.get(id(module))
    if mirror is None:
        raise RuntimeError(
            "the 'probe' attention implementation runs only inside probe.trace or probe.hooks"
        )
    layer = mirror.layer(module)
    p = mirror.layers[layer]
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling

    # hook_q/k/v are [batch, pos, head, d_head]: transposed views, only when observed.
    if p.hook_q.active:
        query = p.hook_q(query.transpose(1, 2)).transpose(1, 2)
    if p.hook_k.active:
        key = p.hook_k(key.transpose(1, 2)).transpose(1, 2)
    if p.hook_v.active:
        value = p.hook_v(value.transpose(1, 2)).transpose(1, 2)
    group = query.shape[1] // key.shape[1]
    if group > 1:  # grouped-query attention: each K/V head serves `group` query heads
        key = key.repeat_interleave(group, dim=1)
        value = value.repeat_interleave(group, dim=1)

    # In place: the eager implementation's arithmetic, without two more [batch, head, q, k]
    # tensors to allocate (each a fresh memory mapping at this size).
    scores = torch.matmul(query, key.transpose(2, 3)).mul_(scaling)
    if attention_mask is not None:
        scores.add_(attention_mask[:, :, :, : key.shape[-2]])
    scores = p.hook_attn_scores(scores)
    pattern = p.hook_pattern(F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype))
    z = p.hook_z(torch.matmul(F.dropout(pattern, dropout, module.training), value).transpose(1, 2))

    if p.hook_result.active:
        o = mirror.outputs[layer]
        with materialized(o):  # W_O is read before o runs, when accelerate may have offloaded it
            W_O, b_O = output_weights(o, mirror.d_head), 0 if o.bias is None else o.bias
            result = p.hook_result(torch.einsum("bqhk,hkm->bqhm", z, W_O))
            mirror.pending[id(o)] = result.sum(dim=2) + b_O
    return z.contiguous(), pattern


AttentionInterface.register(IMPLEMENTATION, probe_attention)
AttentionMaskInterface.register(IMPLEMENTATION, eager_mask)
