"""The hooks that compute a mirrored model's points on its own modules, and attaching them for a
block (``Mirror.attached``).

The residual stream's, the norms' and the MLP's points (and a rotary model's ``hook_q`` and
``hook_k``) are hooks on the model's own modules, where ``probe.capture.sites`` found them, so that
an edit flows on through the model's own code; the points inside the attention are computed by
``probe.capture.attention_function``, to which attaching switches the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.utils.hooks import RemovableHandle
from transformers import PreTrainedModel

from probe.capture.attention_function import (
    IMPLEMENTATION,
    previous_implementation,
    registered,
)
from probe.capture.head_weights import split_fused
from probe.capture.modes import UNGROUPED
from probe.capture.names import (
    EMBED,
    MLP_POINTS,
    MODEL_NORMS,
    NORM_POINTS,
    NORMS,
    POS_EMBED,
    QK_NORM_POINTS,
    QK_NORMS,
    UNEMBED,
)
from probe.capture.norms import affine, centred, normalise, scale
from probe.capture.sites import HookKind, HookSites, Point, Site


class Mirror(HookSites):
    """A model's hook sites with the hooks that compute their points (see ``HookSites``), and
    what they keep during one forward pass."""

    previous = "eager"  # the model's own attention implementation, read as it is attached

    def __init__(self, model: PreTrainedModel, point: Callable[[], Point]) -> None:
        super().__init__(model, point)
        self.pending: dict[int, torch.Tensor] = {}
        self.stream: dict[int, torch.Tensor] = {}  # id(block holder) -> its resid_pre
        self.attn_in: dict[int, tuple[torch.Tensor, bool]] = {}  # -> its hook_attn_in, edited
        self.positions = torch.Size()

    def _start_forward(self, *_) -> None:
        self.calls.clear()
        self.pending.clear()
        self.stream.clear()
        self.attn_in.clear()

    def _replace_output(self, module, _inputs, output):
        # hook_result was edited: the layer output is Σ_i result_i + b^O, edits included.
        return self.pending.pop(id(module), output)

    def _resid_pre(self, module, args, kwargs):
        holder = self.owner(module, HookKind.RESID_PRE.at())
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
        holder = self.owner(module, HookKind.ATTN_OUT.at())
        out = holder.hook_attn_out(output) if holder.hook_attn_out.active else output
        mid = holder.points.get("hook_resid_mid")
        if mid is not None and mid.active and not holder.post_ln:
            pre = self.stream[id(holder)]
            total = pre + out
            edited = mid(total)
            out = out if edited is total else edited - pre
        return None if out is output else out

    def _inputs_hook(self, site: Site):
        """Points on a module's input (``site.of``), in order; a replacement becomes the input."""

        def run(module, args):
            holder = self.owner(module, site)
            points = [holder.points.get(name) for name in site.of]
            points = [point for point in points if point is not None and point.active]
            if not points:  # nothing to see: the input left as it is, whatever its shape
                return None
            x = self._unflat(args[0])
            y = x
            for point in points:
                y = point(y)
            return None if y is x else (self._flat(y, args[0]), *args[1:])

        return run

    def _unflat(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*self.positions, -1) if x.dim() == 2 else x  # OPT: [batch·pos, d]

    def _flat(self, y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return y.flatten(0, -2) if like.dim() == 2 else y

    def _norm_hook(self, site: Site):
        """A norm's hook_scale and hook_normalized, computed beside it from its input; its output
        is recomputed from them only when a hook edits one."""
        prefix = f"{site.name}."

        def run(module, args, output):
            holder = self.owner(module, site)
            scale_p, normalized_p = (holder.points[prefix + p] for p in NORM_POINTS)
            if not (scale_p.active or normalized_p.active):
                return None
            # Gemma 3's query and key norms see [batch, head, pos, d_head]; the points, heads 2nd.
            heads_first = getattr(holder, "heads_first", False)
            x = (args[0].transpose(1, 2) if heads_first else self._unflat(args[0])).float()
            x = centred(module, x)
            its_scale = scale(module, x).to(output.dtype)
            seen_scale = scale_p(its_scale) if scale_p.active else its_scale
            normalized = (x / seen_scale).to(output.dtype)
            seen = normalized_p(normalized) if normalized_p.active else normalized
            if seen_scale is its_scale and seen is normalized:
                return None
            edited = affine(self.model, module, seen)
            return edited.transpose(1, 2) if heads_first else self._flat(edited, output)

        return run

    def _input_hook(self, part: str):
        """hook_attn_in and hook_{q,k,v}_input: the block's input repeated per head; where a hook
        edits them, the projection's output (``part``: q, k or v) is recomputed head by head from
        them (through ln1 first, in a pre-LayerNorm block). In the ungrouped view (``ungrouped``)
        a key or value projection's output is first repeated for every query head its heads
        serve, as the projection of the model's ungrouped twin would make it."""

        def run(module, _inputs, output):
            holder = self.owner(module, HookKind.HEAD_INPUTS.at(part))
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
        holder = self.owner(module, HookKind.HEAD_INPUTS.at("qkv"))
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
        normed = by_head if holder.ln1 is None else normalise(self.model, holder.ln1, by_head)
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
        holder = self.owner(module, HookKind.FUSED_MLP.at())
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
            p = self.owner(module, HookKind.PROJECTION.at(part))
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
        """A point on a module's output (``suffix``, its name); a replacement becomes the
        output."""
        site = HookKind.OUTPUT.at(suffix)

        def run(module, _inputs, output):
            holder = self.owner(module, site)
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
        """Within the block, the hooks are on the model's modules and the model runs probe's
        attention function; after it, both are as they were."""
        model = self.model
        previous = model.config._attn_implementation
        if previous == IMPLEMENTATION:  # a model sharing this config is mirrored: its previous
            previous = previous_implementation(model.config)
        self.previous = previous or "eager"
        handles = self._hooked()
        attention = [id(m) for m in self.modules(HookKind.ATTENTION.at())]
        # A config is a plain attribute, in the module's __dict__ (hasattr would raise and catch
        # an AttributeError on every module without one).
        configs = {id(c) for m in model.modules() if (c := m.__dict__.get("config")) is not None}
        # The mask function finds the mirror by the config it is given.
        try:
            with registered(self, attention, configs):
                model.set_attn_implementation(IMPLEMENTATION)
                yield
        finally:
            model.set_attn_implementation(previous)
            for h in handles:
                h.remove()

    def _hooked(self) -> list[RemovableHandle]:
        """Every hook put on the model's modules, in the order that hooks on one module run."""
        handles = [self.model.base_model.register_forward_pre_hook(self._start_forward)]

        def after(site: Site, hook: Callable) -> None:  # a forward hook on the site's modules
            handles.extend(m.register_forward_hook(hook) for m in self.modules(site))

        # hook_result's replacement first, so that hook_attn_out sees the edited output.
        after(HookKind.RESULT.at(), self._replace_output)
        handles += [
            b.register_forward_pre_hook(self._resid_pre, with_kwargs=True)
            for b in self.modules(HookKind.RESID_PRE.at())
        ]
        # The inputs' recomputed projections first, so that hook_q and hook_k see them.
        for part in "qkv":
            after(HookKind.HEAD_INPUTS.at(part), self._input_hook(part))
        after(HookKind.HEAD_INPUTS.at("qkv"), self._fused_input_hook)
        for part in ("q", "k", "qkv"):
            after(HookKind.PROJECTION.at(part), self._projection_hook(part))
        # A norm's edits first, so that an output hook on the same module (Gemma's attn_out)
        # sees them.
        for part in (*NORMS, *MODEL_NORMS, *QK_NORMS):
            after(HookKind.NORM.at(part), self._norm_hook(HookKind.NORM.at(part)))
        after(HookKind.ATTN_OUT.at(), self._attn_out)
        after(HookKind.FUSED_MLP.at(), self._fused_mlp)
        for site in self.sites_of(HookKind.INPUTS):
            hook = self._inputs_hook(site)
            handles += [m.register_forward_pre_hook(hook) for m in self.modules(site)]
        # The outputs in this order, then the MLP's points (the order of hooks on one module).
        first = ("hook_cross_attn_out", "hook_mlp_out", "hook_resid_post", EMBED, POS_EMBED)
        first += (UNEMBED, *QK_NORM_POINTS)
        outputs = [*first, *(s.name for s in self.sites_of(HookKind.OUTPUT) if s.name not in first)]
        for suffix in outputs:
            after(HookKind.OUTPUT.at(suffix), self._output_hook(suffix))
        return handles


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


def _spreads(shape: torch.Size, positions: torch.Size) -> bool:
    """Whether position embeddings of ``shape`` are shared by the batch's rows (``[1, pos]`` or
    ``[pos]``), to be shown ``[batch, pos]``; T5's relative bias, ``[q_pos, k_pos]``, is not."""
    try:
        return shape != positions and torch.broadcast_shapes(shape, positions) == positions
    except RuntimeError:
        return False
