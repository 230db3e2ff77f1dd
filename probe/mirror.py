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

from probe.architectures import attentions, blocks, head_dim, materialized, output_weights
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


class _Attention(nn.Module):
    """One attention's hook points as attributes: ``attn.hook_z``."""

    def __init__(self) -> None:
        super().__init__()
        for suffix in SUFFIXES:
            setattr(self, suffix, HookPoint())


class _Block(nn.Module):
    """One block's residual-stream hook points as attributes: ``block.hook_mlp_out``."""

    def __init__(self, suffixes: tuple[str, ...]) -> None:
        super().__init__()
        for suffix in suffixes:
            setattr(self, suffix, HookPoint())


class Mirror:
    """Hook points for every attention and block of one model, and what is needed to run them.

    An attention's hooks live in probe's attention function: ``{stack}.{l}.{attn}.hook_*``, with
    stack ``blocks`` (encoder-only and decoder-only models) or ``encoder``/``decoder``, and attn
    ``attn`` or, in a decoder block of an encoder-decoder model, ``cross_attn``. The residual
    stream's hooks are forward hooks on the model's own modules: ``hook_resid_pre`` on a block's
    input and ``hook_resid_post`` on its output, ``hook_attn_out`` (``hook_cross_attn_out``) on
    the attention's output projection (or the norm after it, ``Architecture.attn_out``),
    ``hook_mlp_out`` on the MLP's last module (``Architecture.mlp``), and ``hook_embed`` on what
    enters the first block (of the encoder).
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.embed = HookPoint()
        self.points = {"hook_embed": self.embed}
        # A module shared by several layers (ALBERT) learns its layer from its call count: each
        # (kind, module) lists the hook holders it serves, in call order.
        self.owners: dict[tuple[str, int], list[nn.Module]] = {}
        self.output_of: dict[int, nn.Module] = {}  # id(attention hooks) -> output projection
        self.first_block: nn.Module | None = None
        every = attentions(model)
        self.d_head: dict[int, int] = {}  # id(attention hooks) -> its heads' width
        for name, arch in every.items():
            stack, attn = name.split(".")
            d_head = head_dim(model, name)
            for i, block in enumerate(blocks(model, name)):
                hooks = _Attention()
                self.points |= {f"{stack}.{i}.{attn}.{s}": getattr(hooks, s) for s in SUFFIXES}
                o = block.get_submodule(arch.o)
                self.output_of[id(hooks)] = o
                self.d_head[id(hooks)] = d_head
                self._own("attn", block.get_submodule(arch.attention), hooks)
                self._own("output", o, hooks)
                if attn == "cross_attn":
                    holder = self._block_hooks(stack, i, ("hook_cross_attn_out",))
                    self._own("hook_cross_attn_out", block.get_submodule(arch.o), holder)
                    continue
                holder = self._block_hooks(stack, i, RESIDUAL)
                self.first_block = self.first_block or holder
                self._own("hook_resid_pre", block, holder)
                self._own("hook_resid_post", block, holder)
                self._own("hook_attn_out", block.get_submodule(arch.attn_out or arch.o), holder)
                self._own("hook_mlp_out", block.get_submodule(arch.mlp), holder)
        self.calls: dict[tuple[str, int], int] = {}
        self.pending: dict[int, torch.Tensor] = {}
        self.positions = torch.Size()

    def _block_hooks(self, stack: str, layer: int, suffixes: tuple[str, ...]) -> _Block:
        holder = _Block(suffixes)
        self.points |= {f"{stack}.{layer}.{s}": getattr(holder, s) for s in suffixes}
        return holder

    def _own(self, kind: str, module: nn.Module, holder: nn.Module) -> None:
        self.owners.setdefault((kind, id(module)), []).append(holder)

    def owner(self, module: nn.Module, kind: str = "attn") -> nn.Module:
        """The hook holder that ``module`` (an attention module, or one of ``kind``) now runs."""
        key = (kind, id(module))
        holders = self.owners[key]
        if len(holders) == 1:
            return holders[0]
        n = self.calls.get(key, 0)
        self.calls[key] = n + 1
        return holders[n % len(holders)]

    def modules(self, kind: str) -> list[nn.Module]:
        """The model's modules of one kind, each once."""
        found = {}
        for module in self.model.modules():
            if (kind, id(module)) in self.owners:
                found[id(module)] = module
        return list(found.values())

    def _start_forward(self, *_) -> None:
        self.calls.clear()
        self.pending.clear()

    def _replace_output(self, module, _inputs, output):
        # hook_result was observed: the layer output is Σ_i result_i + b^O, edits included.
        return self.pending.pop(id(module), output)

    def _resid_pre(self, module, args, kwargs):
        holder = self.owner(module, "hook_resid_pre")
        x = args[0] if args else kwargs["hidden_states"]
        self.positions = x.shape[:-1]  # [batch, pos]: OPT's MLP works on them flattened
        first = holder is self.first_block and self.embed.active
        edited = self.embed(x) if first else x
        point = holder.hook_resid_pre
        edited = point(edited) if point.active else edited
        if edited is x:
            return None
        if args:
            return (edited, *args[1:]), kwargs
        return args, kwargs | {"hidden_states": edited}

    def _output_hook(self, suffix: str):
        def run(module, _inputs, output):
            point = getattr(self.owner(module, suffix), suffix)
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
        handles = [model.base_model.register_forward_pre_hook(self._start_forward)]
        # hook_result's replacement first, so that hook_attn_out sees the edited output.
        handles += [o.register_forward_hook(self._replace_output) for o in self.modules("output")]
        handles += [
            b.register_forward_pre_hook(self._resid_pre, with_kwargs=True)
            for b in self.modules("hook_resid_pre")
        ]
        for suffix in ("hook_attn_out", "hook_cross_attn_out", "hook_mlp_out", "hook_resid_post"):
            handles += [
                m.register_forward_hook(self._output_hook(suffix)) for m in self.modules(suffix)
            ]
        attention = [id(m) for m in self.modules("attn")]
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
    position_bias: torch.Tensor | None = None,
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
    p = mirror.owner(module)
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
    if softcap is not None:  # Gemma 2's logit soft-capping, before the mask (out of place:
        scores = torch.tanh(scores / softcap) * softcap  # tanh's backward needs its output)
    if position_bias is not None:  # T5's relative position bias
        scores.add_(position_bias)
    if attention_mask is not None:
        scores.add_(attention_mask[:, :, :, : key.shape[-2]])
    scores = p.hook_attn_scores(scores)
    pattern = p.hook_pattern(F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype))
    z = p.hook_z(torch.matmul(F.dropout(pattern, dropout, module.training), value).transpose(1, 2))

    if p.hook_result.active:
        o = mirror.output_of[id(p)]
        with materialized(o):  # W_O is read before o runs, when accelerate may have offloaded it
            W_O, b_O = output_weights(o, mirror.d_head[id(p)]), 0 if o.bias is None else o.bias
            result = p.hook_result(torch.einsum("bqhk,hkm->bqhm", z, W_O))
            mirror.pending[id(o)] = result.sum(dim=2) + b_O
    return z.contiguous(), pattern


AttentionInterface.register(IMPLEMENTATION, probe_attention)
AttentionMaskInterface.register(IMPLEMENTATION, eager_mask)
