"""Where a mirrored model's hook points are: every attention's and block's points, built once per
model (``HookSites``), and the model's modules that the hooks computing them go on, each as a
``Site``: a ``HookKind`` (what the hook on the module does) and the part or points it serves.

The hooks themselves are ``probe.capture.hooks``'s; the points inside the attention are computed
by ``probe.capture.attention_function``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from enum import Enum
from typing import NamedTuple, Protocol

import torch
from torch import nn
from transformers import PreTrainedModel

from probe.capture.architectures import Architecture, architecture, blocks, model_part
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


class HookKind(Enum):
    """What a hook on one of the model's modules does (``probe.capture.hooks.Mirror`` has one
    callback per kind)."""

    ATTENTION = "attention"
    """On the attention module: probe's attention function finds the module's layer by it."""
    RESULT = "result"
    """On the output projection: an edit of hook_result replaces its output."""
    PROJECTION = "projection"
    """hook_q and hook_k on a projection's output (a rotary or query-scaled model's), before the
    rotation; its part is ``"q"``, ``"k"`` or a fused ``"qkv"``."""
    HEAD_INPUTS = "head inputs"
    """hook_attn_in and hook_{q,k,v}_input: a projection's output (part ``"q"``, ``"k"``, ``"v"``
    or a fused ``"qkv"``) recomputed from them where they are edited."""
    RESID_PRE = "resid_pre"
    """hook_resid_pre on the block's input."""
    ATTN_OUT = "attn_out"
    """hook_attn_out, then hook_resid_mid, on the attention's contribution to the stream."""
    NORM = "norm"
    """hook_scale and hook_normalized beside a norm (its part: ``"ln1"``, ``"ln_final"``…)."""
    FUSED_MLP = "fused mlp"
    """mlp.hook_pre and mlp.hook_pre_linear on the halves of one projection's output."""
    INPUTS = "inputs"
    """Points on a module's input, in order (a replacement becomes the input)."""
    OUTPUT = "output"
    """A point on a module's output (a replacement becomes the output)."""

    def at(self, *of: str) -> Site:
        """The site of this kind that serves ``of``: a part, or points."""
        return Site(self, of)


class Site(NamedTuple):
    """One kind of hook and what it serves: the part (``"q"``, ``"ln1"``) or the points, in order,
    that it runs (none for a kind that serves one thing only)."""

    kind: HookKind
    of: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The one part or point the site serves."""
        (name,) = self.of
        return name


class Point(Protocol):
    """What the mirror needs of a hook point (``probe.capture.hookpoints.HookPoint`` is one)."""

    active: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class Points(nn.Module):
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


class HookSites:
    """Hook points for every attention and block of one model, and the model's modules that the
    hooks computing them go on (``probe.capture.hooks.Mirror`` attaches them).

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

    def __init__(self, model: PreTrainedModel, point: Callable[[], Point]) -> None:
        # Kept while the model lives (``probe.capture.mirror``), not longer.
        self._model = weakref.ref(model)
        self.point = point
        self.points: dict[str, Point] = {}
        # A module shared by several layers (ALBERT) learns its layer from its call count: each
        # (site, module) lists the hook holders it serves, in call order.
        self.owners: dict[tuple[Site, int], list[nn.Module]] = {}
        self.by_site: dict[Site, dict[int, nn.Module]] = {}  # site -> the model's modules, once
        self.calls: dict[tuple[Site, int], int] = {}
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
                self._own(HookKind.ATTENTION.at(), block.get_submodule(arch.attention), hooks)
                self._own(HookKind.RESULT.at(), o, hooks)
                if arch.rotary:  # hook_q and hook_k on the projections, before the rotation
                    projections = {"qkv": arch.qkv} if arch.fused else {"q": arch.q, "k": arch.k}
                elif arch.q_scaled:  # hook_q before the scaling
                    projections = {"q": arch.q}
                else:
                    projections = {}
                for part, path in projections.items():
                    self._own(HookKind.PROJECTION.at(part), block.get_submodule(path), hooks)
                hooks.heads_first = arch.qk_norm_heads_first
                for norm, point in zip(qk_norms, QK_NORM_POINTS, strict=False):
                    module = block.get_submodule(qk_norms[norm])
                    # scale and normalized, then the output
                    self._own(HookKind.NORM.at(norm), module, hooks)
                    self._own(HookKind.OUTPUT.at(point), module, hooks)
                if name == Attention.CROSS:
                    points = CROSS_POINTS if arch.stream_after else CROSS_POINTS[:1]
                    holder = self._holder(name.stack, i, points)
                    out = HookKind.OUTPUT.at("hook_cross_attn_out")
                    self._own(out, block.get_submodule(arch.o), holder)
                    if arch.stream_after:  # its input is the stream: an edit flows on
                        after = block.get_submodule(arch.stream_after)
                        self._own(HookKind.INPUTS.at("hook_resid_mid2"), after, holder)
                else:
                    self._block(name, arch, i, block).heads = layout[1:]
        self._model_points()

    @property
    def model(self) -> PreTrainedModel:
        return self._model()

    def _block(self, name: Attention, arch: Architecture, layer: int, block: nn.Module) -> Points:
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
            projection = block.get_submodule(getattr(arch, part))
            self._own(HookKind.HEAD_INPUTS.at(part), projection, holder)
        self._own(HookKind.RESID_PRE.at(), block, holder)
        self._own(HookKind.ATTN_OUT.at(), block.get_submodule(arch.attn_out or arch.o), holder)
        self._own(HookKind.OUTPUT.at("hook_mlp_out"), block.get_submodule(arch.mlp), holder)
        for part, module in norms.items():
            self._own(HookKind.NORM.at(part), module, holder)
        if arch.post_ln:  # the stream after each sum is the input of the norm after it
            cross = bool(arch.ln_cross)  # the MLP's input: after the cross-attention's sum
            mid = ("hook_resid_mid",) if cross else ("hook_resid_mid", "hook_mlp_in")
            self._own(HookKind.INPUTS.at(*mid), norms["ln1"], holder)
            if cross:
                self._own(HookKind.INPUTS.at("hook_mlp_in"), norms["ln2"], holder)
            self._own(HookKind.INPUTS.at("hook_resid_post"), norms[mlp_norm], holder)
        else:
            self._own(HookKind.OUTPUT.at("hook_resid_post"), block, holder)
            if mlp_norm in norms and not parallel:
                self._own(HookKind.INPUTS.at("hook_mlp_in"), norms[mlp_norm], holder)
        if fused is not None:
            self._own(HookKind.FUSED_MLP.at(), fused, holder)
            mlp = {}
        for p, module in mlp.items():
            self._own(HookKind.OUTPUT.at(f"mlp.{p}"), module, holder)
        if post is not None:
            self._own(HookKind.INPUTS.at(post_point), post, holder)
        return holder

    def _model_points(self) -> None:
        """hook_embed, hook_pos_embed, the embeddings' and the final norms' points and
        hook_unembed, where the model has them (``probe.capture.architectures.ModelType.parts``)."""
        model = self.model
        modules = {EMBED: model_part(model, "embed"), POS_EMBED: model_part(model, "pos_embed")}
        modules[UNEMBED] = model.get_output_embeddings()
        modules = {point: m for point, m in modules.items() if m is not None}
        norms = {part: model_part(model, part) for part in MODEL_NORMS}
        norms = {part: m for part, m in norms.items() if _is_norm(m)}
        names = tuple(modules) + tuple(f"{part}.{p}" for part in norms for p in NORM_POINTS)
        self.own = Points(names, self.point)
        self.points |= self.own.points
        for point, module in modules.items():
            self._own(HookKind.OUTPUT.at(point), module, self.own)
        for part, module in norms.items():
            self._own(HookKind.NORM.at(part), module, self.own)

    def _holder(self, site: str, layer: int, names: tuple[str, ...]) -> Points:
        """The points ``names`` of one layer of an attention or a stack, now by full name too."""
        holder = Points(names, self.point)
        self.points |= {hook_name(n, layer, site): holder.points[n] for n in names}
        return holder

    def _own(self, site: Site, module: nn.Module, holder: nn.Module) -> None:
        self.owners.setdefault((site, id(module)), []).append(holder)
        self.by_site.setdefault(site, {})[id(module)] = module

    def owner(self, module: nn.Module, site: Site | None = None) -> nn.Module:
        """The hook holder that ``module`` (an attention module, or one of ``site``) now runs."""
        key = (site or HookKind.ATTENTION.at(), id(module))
        holders = self.owners[key]
        if len(holders) == 1:
            return holders[0]
        n = self.calls.get(key, 0)
        self.calls[key] = n + 1
        return holders[n % len(holders)]

    def modules(self, site: Site) -> list[nn.Module]:
        """The model's modules that ``site``'s hook goes on, each once."""
        return list(self.by_site.get(site, {}).values())

    def sites_of(self, kind: HookKind) -> list[Site]:
        """The sites of one kind of hook, each once, in the order they were found."""
        return [site for site in self.by_site if site.kind is kind]
