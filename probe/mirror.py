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


RESIDUAL = ("hook_resid_pre", "hook_attn_out", "hook_mlp_out", "hook_resid_post")


class _Layer(nn.Module):
    """One layer's hook points as attributes: ``layer.attn.hook_z``, ``layer.hook_mlp_out``."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Module()
        for suffix in SUFFIXES:
            setattr(self.attn, suffix, HookPoint())
        for suffix in RESIDUAL:
            setattr(self, suffix, HookPoint())


class Mirror:
    """Hook points for every layer of one model, and what is needed to run them.

    The attention hooks live in probe's attention function. The residual stream's hooks are
    forward hooks on the model's own modules: ``hook_resid_pre`` on a block's input and
    ``hook_resid_post`` on its output, ``hook_attn_out`` on the attention's output projection
    (or the norm after it, ``Architecture.attn_out``), ``hook_mlp_out`` on the MLP's last module
    (``Architecture.mlp``), and ``hook_embed`` on what enters the first block.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        arch = architecture(model)
        self.model = model
        self.d_head = head_dim(model)
        layer_blocks = blocks(model)
        self.layers = [_Layer() for _ in layer_blocks]
        self.embed = HookPoint()
        self.points = {"hook_embed": self.embed}
        for i, layer in enumerate(self.layers):
            self.points |= {f"blocks.{i}.attn.{s}": getattr(layer.attn, s) for s in SUFFIXES}
            self.points |= {f"blocks.{i}.{s}": getattr(layer, s) for s in RESIDUAL}
        self.outputs = [b.get_submodule(arch.o) for b in layer_blocks]
        self.modules = {
            "attn": [b.get_submodule(arch.attention) for b in layer_blocks],
            "block_in": layer_blocks,
            "block_out": layer_blocks,
            "output": self.outputs,
            "attn_out": [b.get_submodule(arch.attn_out or arch.o) for b in layer_blocks],
            "mlp_out": [b.get_submodule(arch.mlp) for b in layer_blocks],
        }
        # A module shared by several layers (ALBERT) learns its layer from its call count.
        self.layers_of: dict[tuple[str, int], list[int]] = {}
        for kind, modules in self.modules.items():
            for i, m in enumerate(modules):
                self.layers_of.setdefault((kind, id(m)), []).append(i)
        self.calls: dict[tuple[str, int], int] = {}
        self.pending: dict[int, torch.Tensor] = {}
        self.positions = torch.Size()

    def layer(self, module: nn.Module, kind: str = "attn") -> int:
        """The layer that ``module`` (an attention module, or one of ``kind``) now runs."""
        key = (kind, id(module))
        layers = self.layers_of[key]
        if len(layers) == 1:
            return layers[0]
        n = self.calls.get(key, 0)
        self.calls[key] = n + 1
        return layers[n % len(layers)]

    def _start_forward(self, *_) -> None:
        self.calls.clear()
        self.pending.clear()

    def _replace_output(self, module, _inputs, output):
        # hook_result was observed: the layer output is Σ_i result_i + b^O, edits included.
        return self.pending.pop(id(module), output)

    def _resid_pre(self, module, args, kwargs):
        layer = self.layer(module, "block_in")
        x = args[0] if args else kwargs["hidden_states"]
        self.positions = x.shape[:-1]  # [batch, pos]: OPT's MLP works on them flattened
        edited = self.embed(x) if layer == 0 and self.embed.active else x
        point = self.layers[layer].hook_resid_pre
        edited = point(edited) if point.active else edited
        if edited is x:
            return None
        if args:
            return (edited, *args[1:]), kwargs
        return args, kwargs | {"hidden_states": edited}

    def _output_hook(self, kind: str, suffix: str):
        def run(module, _inputs, output):
            point = getattr(self.layers[self.layer(module, kind)], suffix)
            if not point.active:
                return None
            if isinstance(output, tuple):
                return (point(output[0]), *output[1:])
            if output.dim() == 2:  # [batch·pos, d_model]
                return point(output.view(*self.positions, -1)).flatten(0, -2)
            return point(output)

        return run

    @contextmanager
    def attached(self) -> Iterator[None]:
        model = self.model
        previous = model.config._attn_implementation
        unique = {kind: list(dict.fromkeys(ms)) for kind, ms in self.modules.items()}
        handles = [model.base_model.register_forward_pre_hook(self._start_forward)]
        # hook_result's replacement first, so that hook_attn_out sees the edited output.
        handles += [o.register_forward_hook(self._replace_output) for o in unique["output"]]
        handles += [
            b.register_forward_pre_hook(self._resid_pre, with_kwargs=True)
            for b in unique["block_in"]
        ]
        for kind, suffix in (("attn_out", "hook_attn_out"), ("mlp_out", "hook_mlp_out"),
                             ("block_out", "hook_resid_post")):  # fmt: skip
            handles += [
                m.register_forward_hook(self._output_hook(kind, suffix)) for m in unique[kind]
            ]
        attention = [id(m) for m in unique["attn"]]
        for key in attention:
            _MIRRORS[key] = self
        try:
            model.set_attn_implementation(IMPLEMENTATION)
            yield
        finally:
            model.set_attn_implementation(previous)
            for h in handles:
                h.remove()
            for key in attention:
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
    softcap: float | None = None,
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
    p = mirror.layers[layer].attn
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
    if softcap is not None:  # Gemma 2's logit soft-capping, before the mask
        scores = scores.div_(softcap).tanh_().mul_(softcap)
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
