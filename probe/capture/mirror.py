"""Probe's hook points on pretrained Hugging Face models, through transformers' attention registry.

Instead of re-implementing models, we register one attention function under the name
``"probe"`` (with a mask function that gives the model the mask it would have built for
itself) and switch a model to it for the duration of a ``probe.trace`` or ``probe.hooks``
block. Transformers hands the function every layer's per-head query, key and value; it runs
them through the implementation the model ran before (sdpa, or its modeling file's eager
function), so that a trace that edits nothing changes no bit of the output, and computes the
scores, pattern and per-head results beside it, where they are observed. Only when a hook
edits one of them (or a backward hook needs its gradient) does the output come from them.

On rotary models the query and key reach that function already rotated: there they are
``hook_rot_q`` and ``hook_rot_k``, and ``hook_q`` and ``hook_k`` (before the rotation, and before
Qwen3's and Gemma 3's query and key norms, as TransformerLens has them) are forward hooks on the
projections, so that an edit of them flows through the norms and the rotation. The residual
stream's, the norms' and the MLP's points are hooks on the model's own modules (``Mirror``).

This module does not import ``probe.capture.hookpoints``, which imports it: the hook points are made
by the ``point`` factory that ``mirrored`` is given (``probe.capture.hookpoints.HookPoint``).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from probe.capture.architectures import (
    Architecture,
    architecture,
    blocks,
    materialized,
    model_part,
    output_weights,
    split_fused,
)
from probe.capture.names import (
    ATTENTION_POINTS,
    CROSS_POINTS,
    EMBED,
    INPUT_POINTS,
    MLP_POINTS,
    MODEL_NORMS,
    NORM_POINTS,
    NORMS,
    POS_EMBED,
    QK_NORM_POINTS,
    QK_NORMS,
    RESIDUAL_POINTS,
    ROTARY_POINTS,
    UNEMBED,
    Attention,
    hook_name,
)
from probe.capture.spec import describe
from probe.errors import ProbeError

IMPLEMENTATION = "probe"


class Point(Protocol):
    """What the mirror needs of a hook point (``probe.capture.hookpoints.HookPoint`` is one)."""

    active: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class _Points(nn.Module):
    """One attention's, one block's or the model's own hook points, by name (``points``) and
    as attributes (``attn.hook_z``, the block parts' by name only); an attention's also has
    ``scored``, its points on the queries and keys that meet in the scores."""

    def __init__(self, names: tuple[str, ...], point: Callable[[], Point]) -> None:
        super().__init__()
        self.points = {name: point() for name in names}
        for name, p in self.points.items():
            if "." not in name:  # a block part's ("ln1.hook_scale") only by name
                setattr(self, name, p)


def _is_norm(module: nn.Module | None) -> bool:
    return module is not None and getattr(module, "weight", None) is not None


def _norms(arch: Architecture, block: nn.Module) -> dict[str, nn.Module]:
    """A block's norms by the part their points are named by (``probe.capture.names.NORMS``): a
    decoder block's with a cross-attention are TransformerLens's ln1, ln2 (the cross-attention's)
    and ln3 (the MLP's)."""
    paths = {part: getattr(arch, part, "") for part in NORMS}
    if arch.ln_cross:
        paths |= {"ln2": arch.ln_cross, "ln3": arch.ln2}
    found = {part: _find(block, path) for part, path in paths.items()}
    return {part: m for part, m in found.items() if _is_norm(m)}


def _find(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path) if path else None
    except AttributeError:  # a variant without it (a gated T5's MLP)
        return None


class Mirror:
    """Hook points for every attention and block of one model, and what is needed to run them.

    Names are ``probe.capture.names``'s. An attention's hooks live in probe's attention function,
    but for a rotary model's ``hook_q`` and ``hook_k``: forward hooks on the query and key
    projections (``Architecture.q``/``k``, or the fused ``qkv``). The rest are hooks on the model's
    own modules, so that an edit flows on: ``hook_resid_pre`` on a block's input, ``hook_attn_out``
    (``hook_cross_attn_out``) on the attention's output projection (or the norm after it,
    ``Architecture.attn_out``), ``hook_mlp_out`` on the MLP's last module, ``mlp.hook_pre`` and
    ``mlp.hook_post`` on the MLP's projections, ``ln1``/``ln2``/``ln_final`` on the norms (scale and
    normalised input computed beside them; the norm's output recomputed only when a hook edits
    them). ``hook_resid_mid`` is resid_pre + attn_out (an edit reaches the stream through attn_out)
    in pre-LayerNorm blocks; in post-LayerNorm ones (``Architecture.post_ln``) it and
    ``hook_resid_post`` are the inputs of ``ln1`` and ``ln2``. The model's own points:
    ``hook_embed`` on the token embedding (an encoder-decoder model's encoder's), ``hook_pos_embed``
    on the position embedding, the embeddings' and final norms' (per stack in an encoder-decoder
    model), ``hook_unembed`` on the output embedding. Qwen3's and Gemma 3's query and key norms have
    their points as the blocks' norms do, and ``hook_q_normed``/``hook_k_normed`` on their outputs.
    ``hook_attn_in`` and ``hook_{q,k,v}_input`` are computed from the block's input; an edit
    recomputes the edited heads of the projection's output (of its part of a fused one) from them.
    """

    previous = "eager"  # the model's own attention implementation, read as it is attached

    def __init__(self, model: PreTrainedModel, point: Callable[[], Point]) -> None:
        self._model = weakref.ref(model)  # kept while the model lives (``_mirror_of``), not longer
        self.point = point
        self.points: dict[str, Point] = {}
        # A module shared by several layers (ALBERT) learns its layer from its call count: each
        # (kind, module) lists the hook holders it serves, in call order.
        self.owners: dict[tuple[str, int], list[nn.Module]] = {}
        self.by_kind: dict[str, dict[int, nn.Module]] = {}  # kind -> the model's modules, once
        self.output_of: dict[int, nn.Module] = {}  # id(attention hooks) -> output projection
        # id(attention hooks) -> its layout: (Architecture.fused, query heads, head width)
        self.layout: dict[int, tuple[str, int, int]] = {}
        spec = describe(model)  # derived once, as the model is first mirrored
        for attention in spec.attentions:
            name, arch = Attention(attention.name), architecture(model, attention.name)
            layout = (arch.fused, attention.n_heads, attention.d_head)
            names = ATTENTION_POINTS + (ROTARY_POINTS if arch.rotary else ())
            qk_norms = {n: path for n in QK_NORMS if (path := getattr(arch, n))}
            names += tuple(f"{n}.{p}" for n in qk_norms for p in NORM_POINTS)
            names += QK_NORM_POINTS if qk_norms else ()
            for i, block in enumerate(blocks(model, name)):
                hooks = self._holder(name, i, names)
                # What meets in the scores: the rotated queries and keys, where there are.
                hooks.scored = (
                    (hooks.hook_rot_q, hooks.hook_rot_k)
                    if arch.rotary
                    else (self.point() if arch.q_scaled else hooks.hook_q, hooks.hook_k)
                )
                o = block.get_submodule(arch.o)
                self.output_of[id(hooks)] = o
                self.layout[id(hooks)] = layout
                self._own("attn", block.get_submodule(arch.attention), hooks)
                self._own("output", o, hooks)
                if arch.rotary:  # hook_q and hook_k on the projections, before the rotation
                    projections = {"qkv": arch.qkv} if arch.fused else {"q": arch.q, "k": arch.k}
                elif arch.q_scaled:  # hook_q before the scaling
                    projections = {"q": arch.q}
                else:
                    projections = {}
                for part, path in projections.items():
                    self._own(part, block.get_submodule(path), hooks)
                hooks.heads_first = arch.qk_norm_heads_first
                for norm, point in zip(qk_norms, QK_NORM_POINTS, strict=False):
                    module = block.get_submodule(qk_norms[norm])
                    self._own(norm, module, hooks)  # scale and normalized, then the output
                    self._own(point, module, hooks)
                if name == Attention.CROSS:
                    points = CROSS_POINTS if arch.stream_after else CROSS_POINTS[:1]
                    holder = self._holder(name.stack, i, points)
                    self._own("hook_cross_attn_out", block.get_submodule(arch.o), holder)
                    if arch.stream_after:  # its input is the stream: an edit flows on
                        self._own(
                            "inputs:hook_resid_mid2", block.get_submodule(arch.stream_after), holder
                        )
                else:
                    self._block(name, arch, i, block).heads = layout[1:]
        self._model_points()
        self.calls: dict[tuple[str, int], int] = {}
        self.pending: dict[int, torch.Tensor] = {}
        self.stream: dict[int, torch.Tensor] = {}  # id(block holder) -> its resid_pre
        self.attn_in: dict[int, tuple[torch.Tensor, bool]] = {}  # -> its hook_attn_in, edited
        self.positions = torch.Size()

    @property
    def model(self) -> PreTrainedModel:
        return self._model()

    def _block(self, name: Attention, arch: Architecture, layer: int, block: nn.Module) -> _Points:
        """The residual stream's, the norms' and the MLP's points of one block, which it
        returns."""
        norms = _norms(arch, block)
        mlp_norm = "ln3" if arch.ln_cross else "ln2"
        mlp = {"hook_pre": arch.mlp_pre, "hook_pre_linear": arch.mlp_pre_linear}
        mlp = {p: m for p, path in mlp.items() if (m := _find(block, path)) is not None}
        fused = _find(block, arch.mlp_pre_fused)
        if fused is not None:  # both halves of one projection (Phi-3, ModernBERT)
            mlp = dict.fromkeys(MLP_POINTS[:2], fused)
        post = _find(block, arch.mlp_post)
        parallel = getattr(self.model.config, "use_parallel_residual", False)  # GPT-NeoX
        serial = ("hook_resid_mid", "hook_mlp_in")  # TransformerLens has neither in parallel
        names = tuple(p for p in RESIDUAL_POINTS if not (parallel and p in serial))
        names += tuple(f"{part}.{p}" for part in norms for p in NORM_POINTS)
        post_point = f"mlp.{MLP_POINTS[-1]}"  # hook_post, on the input of the output projection
        names += tuple(f"mlp.{p}" for p in mlp) + ((post_point,) if post else ())
        holder = self._holder(name.stack, layer, names + INPUT_POINTS)
        holder.post_ln = arch.post_ln
        # The per-head inputs pass the norm before the projections (none if post-LN).
        holder.ln1 = None if arch.post_ln else norms.get("ln1")
        holder.fused = arch.fused
        for part in ("qkv",) if arch.fused else "qkv":
            self._own(f"in:{part}", block.get_submodule(getattr(arch, part)), holder)
        self._own("hook_resid_pre", block, holder)
        self._own("hook_attn_out", block.get_submodule(arch.attn_out or arch.o), holder)
        self._own("hook_mlp_out", block.get_submodule(arch.mlp), holder)
        for part, module in norms.items():
            self._own(part, module, holder)
        if arch.post_ln:  # the stream after each sum is the input of the norm after it
            cross = bool(arch.ln_cross)  # the MLP's input: after the cross-attention's sum
            self._own(
                "inputs:hook_resid_mid" + ("" if cross else ",hook_mlp_in"), norms["ln1"], holder
            )
            if cross:
                self._own("inputs:hook_mlp_in", norms["ln2"], holder)
            self._own("inputs:hook_resid_post", norms[mlp_norm], holder)
        else:
            self._own("hook_resid_post", block, holder)
            if mlp_norm in norms and not parallel:
                self._own("inputs:hook_mlp_in", norms[mlp_norm], holder)
        if fused is not None:
            self._own("fused:mlp", fused, holder)
            mlp = {}
        for p, module in mlp.items():
            self._own(f"mlp.{p}", module, holder)
        if post is not None:
            self._own(f"inputs:{post_point}", post, holder)
        return holder

    def _model_points(self) -> None:
        """hook_embed, hook_pos_embed, the embeddings' and the final norms' points and
        hook_unembed, where the model has them (``probe.capture.architectures.MODEL_PARTS``)."""
        model = self.model
        modules = {EMBED: model_part(model, "embed"), POS_EMBED: model_part(model, "pos_embed")}
        modules[UNEMBED] = model.get_output_embeddings()
        modules = {point: m for point, m in modules.items() if m is not None}
        norms = {part: model_part(model, part) for part in MODEL_NORMS}
        norms = {part: m for part, m in norms.items() if _is_norm(m)}
        names = tuple(modules) + tuple(f"{part}.{p}" for part in norms for p in NORM_POINTS)
        self.own = _Points(names, self.point)
        self.points |= self.own.points
        for point, module in modules.items():
            self._own(point, module, self.own)
        for part, module in norms.items():
            self._own(part, module, self.own)

    def _holder(self, site: str, layer: int, names: tuple[str, ...]) -> _Points:
        """The points ``names`` of one layer of an attention or a stack, now by full name too."""
        holder = _Points(names, self.point)
        self.points |= {hook_name(n, layer, site): holder.points[n] for n in names}
        return holder

    def _own(self, kind: str, module: nn.Module, holder: nn.Module) -> None:
        self.owners.setdefault((kind, id(module)), []).append(holder)
        self.by_kind.setdefault(kind, {})[id(module)] = module

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
        return list(self.by_kind.get(kind, {}).values())

    def kinds(self, prefix: str) -> list[str]:
        """The kinds of module hooks that start with ``prefix``, each once."""
        return [kind for kind in self.by_kind if kind.startswith(prefix)]

    def implementation(self, module: nn.Module) -> Callable:
        """The attention function ``module`` ran before the mirror: the registry's, or for
        ``"eager"`` its modeling file's own ``eager_attention_forward``."""
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        return ALL_ATTENTION_FUNCTIONS.get_interface(self.previous, eager or _eager)

    def _start_forward(self, *_) -> None:
        self.calls.clear()
        self.pending.clear()
        self.stream.clear()
        self.attn_in.clear()

    def _replace_output(self, module, _inputs, output):
        # hook_result was edited: the layer output is Σ_i result_i + b^O, edits included.
        return self.pending.pop(id(module), output)

    def _resid_pre(self, module, args, kwargs):
        holder = self.owner(module, "hook_resid_pre")
        x = args[0] if args else kwargs["hidden_states"]
        self.positions = x.shape[:-1]  # [batch, pos]: OPT's MLP works on them flattened
        point = holder.hook_resid_pre
        edited = point(x) if point.active else x
        self.stream[id(holder)] = edited
        if edited is x:
            return None
        if args:
            return (edited, *args[1:]), kwargs
        return args, kwargs | {"hidden_states": edited}

    def _attn_out(self, module, _inputs, output):
        """hook_attn_out, then in a pre-LayerNorm block hook_resid_mid = resid_pre + attn_out
        (the model's own sum); an edit of it reaches the stream as attn_out's difference."""
        holder = self.owner(module, "hook_attn_out")
        out = holder.hook_attn_out(output) if holder.hook_attn_out.active else output
        mid = holder.points.get("hook_resid_mid")
        if mid is not None and mid.active and not holder.post_ln:
            pre = self.stream[id(holder)]
            total = pre + out
            edited = mid(total)
            out = out if edited is total else edited - pre
        return None if out is output else out

    def _inputs_hook(self, kind: str):
        """Points on a module's input (``kind`` is ``"inputs:"`` and their names), in order; a
        replacement becomes the input."""
        names = kind.removeprefix("inputs:").split(",")

        def run(module, args):
            holder = self.owner(module, kind)
            x = self._unflat(args[0])
            y = x
            for name in names:
                point = holder.points.get(name)
                y = point(y) if point is not None and point.active else y
            return None if y is x else (self._flat(y, args[0]), *args[1:])

        return run

    def _unflat(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*self.positions, -1) if x.dim() == 2 else x  # OPT: [batch·pos, d]

    def _flat(self, y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return y.flatten(0, -2) if like.dim() == 2 else y

    def _norm_hook(self, kind: str):
        """A norm's hook_scale and hook_normalized, computed beside it from its input; its output
        is recomputed from them only when a hook edits one."""
        prefix = f"{kind}."

        def run(module, args, output):
            holder = self.owner(module, kind)
            scale_p, normalized_p = (holder.points[prefix + p] for p in NORM_POINTS)
            if not (scale_p.active or normalized_p.active):
                return None
            # Gemma 3's query and key norms see [batch, head, pos, d_head]; the points, heads 2nd.
            heads_first = getattr(holder, "heads_first", False)
            x = (args[0].transpose(1, 2) if heads_first else self._unflat(args[0])).float()
            centred = x - x.mean(-1, keepdim=True) if isinstance(module, nn.LayerNorm) else x
            eps = getattr(module, "eps", None) or getattr(module, "variance_epsilon", 1e-6)
            scale = (centred.pow(2).mean(-1, keepdim=True) + eps).sqrt().to(output.dtype)
            seen_scale = scale_p(scale) if scale_p.active else scale
            normalized = (centred / seen_scale).to(output.dtype)
            seen = normalized_p(normalized) if normalized_p.active else normalized
            if seen_scale is scale and seen is normalized:
                return None
            edited = _affine(module, seen)
            return edited.transpose(1, 2) if heads_first else self._flat(edited, output)

        return run

    def _input_hook(self, part: str):
        """hook_attn_in and hook_{q,k,v}_input: the block's input repeated per head; where a hook
        edits them, the projection's output (``part``: q, k or v) is recomputed head by head from
        them (through ln1 first, in a pre-LayerNorm block). In the ungrouped view (``ungrouped``)
        a key or value projection's output is first repeated for every query head its heads
        serve, as the projection of the model's ungrouped twin would make it."""

        def run(module, _inputs, output):
            holder = self.owner(module, f"in:{part}")
            heads = module.out_features // holder.heads[1]  # fewer for keys and values with GQA
            W = module.weight.T.unflatten(-1, (heads, -1))  # [d_model, head, d_head]
            b = None if module.bias is None else module.bias.view(heads, -1)
            group = holder.heads[0] // heads if UNGROUPED.get() else 1
            if group > 1:  # each query head its own copy of the key/value head it reads
                W = W.repeat_interleave(group, dim=1)
                b = None if b is None else b.repeat_interleave(group, dim=0)
                output = output.unflatten(-1, (heads, -1)).repeat_interleave(group, dim=-2)
                output, heads = output.flatten(-2), heads * group
            out = self._from_head_inputs(holder, part, W, b)
            if out is None:
                return None if group == 1 else output
            merged = output.unflatten(-1, (heads, -1)).clone()
            _replace_heads(merged, *out)
            return merged.flatten(-2)

        return run

    def _fused_input_hook(self, module, _inputs, output):
        """hook_{q,k,v}_input (and hook_attn_in) on a fused projection: the parts whose inputs a
        hook edited are recomputed from them, the others left as the projection made them."""
        holder = self.owner(module, "in:qkv")
        weight = module.weight if holder.fused == "gpt2" else module.weight.T  # [d_model, out]
        Ws = split_fused(weight, holder.fused, *holder.heads)
        bias = module.bias
        bs = (None,) * 3 if bias is None else split_fused(bias, holder.fused, *holder.heads)
        outs = [self._from_head_inputs(holder, *part) for part in zip("qkv", Ws, bs, strict=True)]
        if all(out is None for out in outs):
            return None
        # Built anew, not written into split_fused's views: autograd forbids editing those.
        parts = [
            part if out is None else _with_heads(part, *out)
            for part, out in zip(
                split_fused(output, holder.fused, *holder.heads), outs, strict=True
            )
        ]
        if holder.fused == "neox":  # per head [q_i | k_i | v_i]
            return torch.cat(parts, dim=-1).flatten(-2)
        return torch.cat([part.flatten(-2) for part in parts], dim=-1)

    def _from_head_inputs(self, holder, part: str, W, b):
        """One projection's output per head, ``[batch, pos, head, d_head]``, from its per-head
        inputs (hook_attn_in, then hook_{part}_input) through ln1 and ``W`` ``[d_model, head,
        d_head]`` + ``b`` ``[head, d_head]``, and which heads' inputs a hook changed (bool
        ``[head]``); None where no hook is attached or none edited."""
        own, attn_in = holder.points[f"hook_{part}_input"], holder.points["hook_attn_in"]
        if not (own.active or attn_in.active):
            return None
        source, edited = self._attn_in(holder)
        x = source[:, :, : W.shape[1]]
        seen = own(x) if own.active else x
        if seen is x and not edited:
            return None
        if getattr(own, "_backward", None):  # a backward hook needs every head's gradient
            changed = torch.ones(seen.shape[2], dtype=torch.bool, device=seen.device)
        else:
            stream = self.stream[id(holder)].unsqueeze(2)
            changed = (seen != stream).flatten(3).any(-1).any(1).any(0)
        # Heads first, in one copy: the norm and the per-head product then read it in place,
        # and the gradient comes back in the same order (no copy per step either way).
        by_head = seen.permute(2, 0, 1, 3).contiguous()  # [head, batch, pos, d_model]
        normed = by_head if holder.ln1 is None else normalise(holder.ln1, by_head, affine=True)
        out = torch.bmm(normed.flatten(1, 2), W.transpose(0, 1))
        out = out.unflatten(1, seen.shape[:2]).permute(1, 2, 0, 3)  # [batch, pos, head, d_head]
        return (out if b is None else out + b), changed

    def _attn_in(self, holder) -> tuple[torch.Tensor, bool]:
        """The block's hook_attn_in (once per forward) and whether a hook edited it."""
        key = id(holder)
        if key not in self.attn_in:
            x = self.stream[key].unsqueeze(2).expand(-1, -1, holder.heads[0], -1)
            point = holder.points["hook_attn_in"]
            seen = point(x) if point.active else x
            self.attn_in[key] = seen, seen is not x
        return self.attn_in[key]

    def _fused_mlp(self, module, _inputs, output):
        """mlp.hook_pre and mlp.hook_pre_linear on the halves of one projection's output."""
        holder = self.owner(module, "fused:mlp")
        points = [holder.points[f"mlp.{p}"] for p in MLP_POINTS[:2]]
        if not any(p.active for p in points):
            return None
        halves = self._unflat(output).chunk(2, dim=-1)
        seen = [p(x) if p.active else x for p, x in zip(points, halves, strict=True)]
        if all(y is x for y, x in zip(seen, halves, strict=True)):
            return None
        return self._flat(torch.cat(seen, dim=-1), output)

    def _projection_hook(self, part: str):
        """hook_q and hook_k of a rotary model on a projection's output ``part`` (``"q"``,
        ``"k"`` or a fused ``"qkv"``), before any norm and the rotation; a replacement takes
        the projection's output's place, so that it flows through both."""

        def run(module, _inputs, output):
            p = self.owner(module, part)
            fused, n_heads, d_head = self.layout[id(p)]
            if part != "qkv":
                point = p.hook_q if part == "q" else p.hook_k
                if not point.active:
                    return None
                heads = output.unflatten(-1, (-1, d_head))  # [batch, pos, head, d_head]
                edited = point(heads)
                return None if edited is heads else edited.flatten(-2)
            if not (p.hook_q.active or p.hook_k.active):
                return None
            q, k, _ = split_fused(output, fused, n_heads, d_head)
            edits = [
                (i, edited)
                for i, (point, x) in enumerate(((p.hook_q, q), (p.hook_k, k)))
                if point.active and (edited := point(x)) is not x
            ]
            if not edits:
                return None
            output = output.clone()  # the views of split_fused write into it
            views = split_fused(output, fused, n_heads, d_head)
            for i, edited in edits:
                views[i].copy_(edited)
            return output

        return run

    def _output_hook(self, suffix: str):
        def run(module, _inputs, output):
            holder = self.owner(module, suffix)
            point = holder.points[suffix]
            if suffix == EMBED:
                self.positions = output.shape[:-1]
            if not point.active:
                return None
            if isinstance(output, tuple):
                return (point(output[0]), *output[1:])
            if getattr(holder, "heads_first", False):
                return point(output.transpose(1, 2)).transpose(1, 2)  # Gemma 3's hook_q_normed
            if suffix == POS_EMBED and _spreads(output.shape[:-1], self.positions):
                output = output.expand(*self.positions, -1)  # [1, pos, d] as [batch, pos, d]
            if output.dim() == 2:  # [batch·pos, d_model]
                return point(output.view(*self.positions, -1)).flatten(0, -2)
            return point(output)

        return run

    @contextmanager
    def attached(self) -> Iterator[None]:
        model = self.model
        previous = model.config._attn_implementation
        if previous == IMPLEMENTATION:  # a model sharing this config is mirrored: its previous
            previous = _BY_CONFIG[id(model.config)].previous
        self.previous = previous or "eager"
        handles = [model.base_model.register_forward_pre_hook(self._start_forward)]
        # hook_result's replacement first, so that hook_attn_out sees the edited output.
        handles += [o.register_forward_hook(self._replace_output) for o in self.modules("output")]
        handles += [
            b.register_forward_pre_hook(self._resid_pre, with_kwargs=True)
            for b in self.modules("hook_resid_pre")
        ]
        # The inputs' recomputed projections first, so that hook_q and hook_k see them.
        for part in "qkv":
            hook = self._input_hook(part)
            handles += [m.register_forward_hook(hook) for m in self.modules(f"in:{part}")]
        handles += [m.register_forward_hook(self._fused_input_hook) for m in self.modules("in:qkv")]
        handles += [
            m.register_forward_hook(self._projection_hook(part))
            for part in ("q", "k", "qkv")
            for m in self.modules(part)
        ]
        # A norm's edits first, so that an output hook on the same module (Gemma's attn_out)
        # sees them.
        for kind in (*NORMS, *MODEL_NORMS, *QK_NORMS):
            handles += [m.register_forward_hook(self._norm_hook(kind)) for m in self.modules(kind)]
        handles += [m.register_forward_hook(self._attn_out) for m in self.modules("hook_attn_out")]
        handles += [m.register_forward_hook(self._fused_mlp) for m in self.modules("fused:mlp")]
        for kind in self.kinds("inputs:"):
            handles += [
                m.register_forward_pre_hook(self._inputs_hook(kind)) for m in self.modules(kind)
            ]
        outputs = ("hook_cross_attn_out", "hook_mlp_out", "hook_resid_post", EMBED, POS_EMBED)
        outputs += (UNEMBED, *QK_NORM_POINTS, *self.kinds("mlp."))
        for suffix in outputs:
            handles += [
                m.register_forward_hook(self._output_hook(suffix)) for m in self.modules(suffix)
            ]
        attention = [id(m) for m in self.modules("attn")]
        # A config is a plain attribute, in the module's __dict__ (hasattr would raise and catch
        # an AttributeError on every module without one).
        configs = {id(c) for m in model.modules() if (c := m.__dict__.get("config")) is not None}
        # The mask function finds the mirror by the config it is given.
        try:
            with _registered(self, [(_MIRRORS, attention), (_BY_CONFIG, configs)]):
                model.set_attn_implementation(IMPLEMENTATION)
                yield
        finally:
            model.set_attn_implementation(previous)
            for h in handles:
                h.remove()


@contextmanager
def _registered(mirror: Mirror, keys: list[tuple[dict, Iterable[int]]]) -> Iterator[None]:
    """``mirror`` under the keys of each registry for the block. Models may share a config (one
    built from another's): what a key held before, an outer mirror, is put back after it."""
    before = [(registry, key, registry.get(key)) for registry, ids in keys for key in ids]
    try:
        for registry, key, _ in before:
            registry[key] = mirror
        yield
    finally:
        for registry, key, value in before:
            if value is None:
                registry.pop(key, None)
            else:
                registry[key] = value


def _with_heads(
    heads: torch.Tensor, recomputed: torch.Tensor, changed: torch.Tensor
) -> torch.Tensor:
    """``heads`` with its ``changed`` heads taken from ``recomputed`` (both ``[batch, pos, head,
    d_head]``), out of place: the others keep the projection's own bits."""
    if changed.all():
        return recomputed.to(heads.dtype)
    return torch.where(changed[:, None], recomputed.to(heads.dtype), heads)


def _replace_heads(heads: torch.Tensor, recomputed: torch.Tensor, changed: torch.Tensor) -> None:
    """Write the ``changed`` heads of ``recomputed`` into ``heads`` (both ``[batch, pos, head,
    d_head]``): the others keep the projection's own bits."""
    heads[:, :, changed] = recomputed[:, :, changed].to(heads.dtype)


def normalise(norm: nn.Module, x: torch.Tensor, affine: bool) -> torch.Tensor:
    """``norm`` (LayerNorm or RMSNorm) applied to ``x`` by its own statistics, with its weight
    and bias where ``affine``, without running the module (and the hooks on it)."""
    if type(norm) is nn.LayerNorm and affine:  # torch's own kernel: one pass, as the model
        return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
    centred = x - x.mean(-1, keepdim=True) if isinstance(norm, nn.LayerNorm) else x
    eps = getattr(norm, "eps", None) or getattr(norm, "variance_epsilon", 1e-6)
    normalized = centred / (centred.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    return _affine(norm, normalized) if affine else normalized


def _affine(norm: nn.Module, normalized: torch.Tensor) -> torch.Tensor:
    """A norm's output from its normalised input: its weight (Gemma's 1 + weight) and bias."""
    weight = norm.weight + 1 if "Gemma" in type(norm).__name__ else norm.weight
    bias = getattr(norm, "bias", None)
    out = normalized * weight
    return out if bias is None else out + bias


_MIRRORS: dict[int, Mirror] = {}  # id(attention module) -> its model's active mirror
_BY_CONFIG: dict[int, Mirror] = {}  # id(a config of the model) -> its active mirror
_ACTIVE: dict[int, Mirror] = {}  # id(model) -> its active mirror (nested traces share it)


@contextmanager
def mirrored(model: PreTrainedModel, point: Callable[[], Point]) -> Iterator[dict[str, Point]]:
    """Switch ``model`` to probe's attention for the block; yields its hook points by name.

    Parameters
    ----------
    model : PreTrainedModel
        A supported architecture (``probe.capture.architectures.SUPPORTED``).
    point : callable
        Makes one hook point (``probe.capture.hookpoints.HookPoint``); nested blocks share the
        points of the outermost.
    """
    mirror = _ACTIVE.get(id(model))
    if mirror is not None:
        yield mirror.points
        return
    mirror = _ACTIVE[id(model)] = _mirror_of(model, point)
    try:
        with mirror.attached():
            yield mirror.points
    finally:
        del _ACTIVE[id(model)]


# Each model's mirror, built once for its modules as they are and kept while the model lives:
# building one (a hook point per name, per layer) costs as much as a small batch's forward pass,
# and a trace is one forward pass. A module swapped in or out changes the modules' identities
# (those the mirror hooks are kept alive by it, so their ids are not reused), and a new mirror is
# built.
_BUILT: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, Mirror]] = weakref.WeakKeyDictionary()


def _mirror_of(model: PreTrainedModel, point: Callable[[], Point]) -> Mirror:
    """``model``'s mirror: the one built before if its modules are still the same, else anew."""
    key = (tuple(map(id, model.modules())), point)
    built = _BUILT.get(model)
    if built is not None and built[0] == key:
        return built[1]
    mirror = Mirror(model, point)
    _BUILT[model] = (key, mirror)
    return mirror


def _spreads(shape: torch.Size, positions: torch.Size) -> bool:
    """Whether position embeddings of ``shape`` are shared by the batch's rows (``[1, pos]`` or
    ``[pos]``), to be shown ``[batch, pos]``; T5's relative bias, ``[q_pos, k_pos]``, is not."""
    try:
        return shape != positions and torch.broadcast_shapes(shape, positions) == positions
    except RuntimeError:
        return False


# Set by ``ungrouped``: keys and values per query head, as on the model's ungrouped twin.
UNGROUPED: ContextVar[bool] = ContextVar("probe_ungrouped", default=False)


@contextmanager
def ungrouped() -> Iterator[None]:
    """Within the block, a model with grouped-query attention runs in TransformerLens's ungrouped
    view: each key and value head's projection is repeated for every query head it serves, so
    that ``hook_k``, ``hook_v``, ``hook_{k,v}_input`` and every point after them have one head
    per query head, and an edit of one reaches that query head alone. The model computes what
    its ungrouped twin (its key and value weights repeated, ``num_key_value_heads`` =
    ``num_attention_heads``) computes: the same output, to float rounding. Models whose keys
    and values come out of a fused projection (``Architecture.fused``) cannot be ungrouped: the
    attention raises ``ProbeError`` (``ungroupable`` says so beforehand)."""
    token = UNGROUPED.set(True)
    try:
        yield
    finally:
        UNGROUPED.reset(token)


def ungroupable(model: PreTrainedModel) -> str | None:
    """Why ``model``'s grouped-query attention cannot run ``ungrouped``, or None where it can
    (or has no grouped-query attention)."""
    spec = describe(model).attention()
    if spec.n_kv_heads == spec.n_heads:
        return None
    arch = architecture(model)
    if arch.fused:
        return (
            f"{type(model).__name__} computes its queries, keys and values in one fused "
            f"projection ({arch.qkv}), which probe cannot split into one key and value input per "
            f"query head under grouped-query attention ({spec.n_heads} query heads, "
            f"{spec.n_kv_heads} key/value heads)"
        )
    return None


# Set by ``mixed_from_the_pattern``: where the pattern is computed beside the model's kernel and
# nothing edits it, the layer's output is mixed from it rather than by the kernel again.
MIXED: ContextVar[bool] = ContextVar("probe_mixed", default=False)


@contextmanager
def mixed_from_the_pattern() -> Iterator[None]:
    """Within the block, a layer whose pattern is computed beside the model's kernel (sdpa, say)
    takes its output from that pattern (p·V) instead of running the kernel: the same numbers
    within the kernel's own rounding, for a reader of patterns that needs not the model's
    output bit for bit (the analyses' stream; a trace keeps the kernel's bits)."""
    token = MIXED.set(True)
    try:
        yield
    finally:
        MIXED.reset(token)


def probe_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model's own attention, with the hook points of the module's layer computed beside it.

    Receives query ``[batch, head, q_pos, d_head]`` and key/value ``[batch, kv_head, k_pos,
    d_head]`` from transformers (rotated, on rotary models), returns z ``[batch, q_pos, head,
    d_head]`` and the attention weights. The output comes from the implementation the model
    ran before it was mirrored (sdpa, say), on the queries, keys and values the hooks hand on:
    a trace that edits nothing leaves the model's output bit for bit as it was. Scores and
    pattern are computed beside it, only when observed; only when a hook edits one of them
    does z come from them instead.
    """
    mirror = _MIRRORS.get(id(module))
    if mirror is None:
        raise RuntimeError(
            "the 'probe' attention implementation runs only inside probe.trace or probe.hooks"
        )
    p = mirror.owner(module)

    if UNGROUPED.get() and key.shape[1] != query.shape[1]:
        raise ProbeError(
            f"{type(module).__name__} hands its attention {key.shape[1]} key/value heads for "
            f"{query.shape[1]} query heads: probe cannot split its keys and values per query head"
        )
    # The points are [batch, pos, head, d_head]: transposed views, only when observed. Keys and
    # values keep their own heads (fewer with grouped-query attention), as TransformerLens's
    # (one per query head in its ungrouped view, ``ungrouped``).
    q_point, k_point = p.scored  # hook_rot_q and hook_rot_k on rotary models
    if q_point.active:
        query = q_point(query.transpose(1, 2)).transpose(1, 2)
    if k_point.active:
        key = k_point(key.transpose(1, 2)).transpose(1, 2)
    if p.hook_v.active:
        value = p.hook_v(value.transpose(1, 2)).transpose(1, 2)

    z = weights = None
    if p.hook_pattern.active and not p.hook_attn_scores.active and _returns_pattern(mirror, module):
        z, weights = _pattern_of_eager(mirror, p, module, query, key, value, attention_mask, kwargs)
    elif p.hook_attn_scores.active or p.hook_pattern.active:
        z, weights = _pattern_beside(mirror, p, module, query, key, value, attention_mask, kwargs)
    if z is None and weights is not None and MIXED.get() and not module.training:
        z = _mixed(weights, value)  # the pattern in hand, times V: no second attention
    if z is None:  # nothing edited the scores or the pattern: the model's own kernel
        own = mirror.implementation(module)
        with _one_group(module, query, key):
            z, own_weights = own(module, query, key, value, attention_mask, **kwargs)
        weights = own_weights if own_weights is not None else weights
    z = p.hook_z(z) if p.hook_z.active else z

    if p.hook_result.active:
        o = mirror.output_of[id(p)]
        with materialized(o):  # W_O is read before o runs, when accelerate may have offloaded it
            W_O = output_weights(o, mirror.layout[id(p)][2])
            result = torch.einsum("bqhk,hkm->bqhm", z, W_O)
            edited = p.hook_result(result)
            if edited is not result:  # the layer output becomes Σ_i result_i + b^O, edits and all
                mirror.pending[id(o)] = edited.sum(dim=2) + (0 if o.bias is None else o.bias)
    return z, weights


@contextmanager
def _one_group(module: nn.Module, query: torch.Tensor, key: torch.Tensor) -> Iterator[None]:
    """The model's own kernel given keys and values per query head (``ungrouped``): the module's
    ``num_key_value_groups``, by which the kernel would repeat them again, is 1 for the call."""
    groups = getattr(module, "num_key_value_groups", 1)
    if groups == 1 or key.shape[1] != query.shape[1]:
        yield
        return
    module.num_key_value_groups = 1
    try:
        yield
    finally:
        module.num_key_value_groups = groups


def _mixed(pattern: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """z ``[batch, q_pos, head, d_head]`` from the pattern and the values (each K/V head serving
    its group of query heads), as eager attention mixes them."""
    group = pattern.shape[1] // value.shape[1]
    value = value.repeat_interleave(group, dim=1) if group > 1 else value
    return torch.matmul(pattern, value).transpose(1, 2).contiguous()


def _returns_pattern(mirror, module) -> bool:
    """Whether the model's own kernel computes the pattern and returns it: eager attention, out
    of training (where dropout would have changed what it returns)."""
    return mirror.previous == "eager" and not module.training


def _pattern_of_eager(mirror, p, module, query, key, value, attention_mask, kwargs):
    """The model's eager attention, its own pattern handed to ``hook_pattern``: no second
    computation of what it has just computed. Returns (z, pattern); where a hook edited the
    pattern, z is computed from the edited one."""
    own = mirror.implementation(module)
    with _one_group(module, query, key):
        z, pattern = own(module, query, key, value, attention_mask, **kwargs)
    if pattern is None:  # a kernel that keeps its pattern to itself: compute it beside
        return _pattern_beside(mirror, p, module, query, key, value, attention_mask, kwargs)
    seen = p.hook_pattern(pattern)
    if seen is not pattern:
        group = query.shape[1] // value.shape[1]
        value = value.repeat_interleave(group, dim=1) if group > 1 else value
        z = torch.matmul(seen, value).transpose(1, 2).contiguous()
    return z, seen


def _pattern_beside(mirror, p, module, query, key, value, attention_mask, kwargs):
    """Scores and pattern through their hook points, eagerly; returns (z, pattern) where a hook
    edited either (z is then computed from the edited pattern), else (None, pattern)."""
    scaling = kwargs.get("scaling")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    group = query.shape[1] // key.shape[1]
    if group > 1:  # grouped-query attention: each K/V head serves `group` query heads
        key = key.repeat_interleave(group, dim=1)
        value = value.repeat_interleave(group, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)).mul_(scaling)
    if (softcap := kwargs.get("softcap")) is not None:  # Gemma 2, before the mask (out of
        scores = torch.tanh(scores / softcap) * softcap  # place: tanh's backward needs it)
    if (position_bias := kwargs.get("position_bias")) is not None:  # T5's relative positions
        scores.add_(position_bias)
    mask = _additive(attention_mask, scores, module, kwargs)
    if mask is not None:
        scores.add_(mask[:, :, :, : key.shape[-2]])
    seen = p.hook_attn_scores(scores)
    pattern = F.softmax(seen, dim=-1, dtype=torch.float32).to(query.dtype)
    seen_pattern = p.hook_pattern(pattern)
    if seen is scores and seen_pattern is pattern:
        return None, pattern
    dropout = float(kwargs.get("dropout") or 0.0)
    z = torch.matmul(F.dropout(seen_pattern, dropout, module.training), value)
    return z.transpose(1, 2).contiguous(), seen_pattern


def _additive(mask, scores, module, kwargs) -> torch.Tensor | None:
    """The model's mask as an additive float one (the dtype's minimum where masked): sdpa's
    masks are boolean, or None where sdpa is told the attention is causal instead."""
    if mask is None:
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        if not causal or scores.shape[-2] == 1:
            return None
        q, k = scores.shape[-2:]
        mask = torch.ones(1, 1, q, k, dtype=torch.bool, device=scores.device).tril(k - q)
    if mask.dtype != torch.bool:
        return mask
    full = torch.full(mask.shape, torch.finfo(scores.dtype).min, dtype=scores.dtype)
    return full.to(scores.device).masked_fill_(mask, 0)


def _eager(module, query, key, value, attention_mask, **kwargs):
    """Eager attention, for a modeling file without its own (the scores and pattern path)."""
    group = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(group, dim=1) for t in (key, value))
    scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    mask = _additive(attention_mask, scores, module, kwargs)
    scores = scores if mask is None else scores + mask[:, :, :, : key.shape[-2]]
    pattern = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(pattern, value).transpose(1, 2).contiguous(), pattern


def probe_mask(*args, config=None, **kwargs):
    """The mask of the implementation the model ran before it was mirrored (see ``Mirror``)."""
    mirror = _BY_CONFIG.get(id(config))
    previous = "eager" if mirror is None else mirror.previous
    mask = AttentionMaskInterface._global_mapping.get(previous, eager_mask)
    return mask(*args, config=config, **kwargs)


AttentionInterface.register(IMPLEMENTATION, probe_attention)
AttentionMaskInterface.register(IMPLEMENTATION, probe_mask)
