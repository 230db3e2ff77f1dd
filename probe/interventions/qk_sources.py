"""The residual stream a head reads, as a sum of the sources that wrote it, for
``probe.qk_attribution`` (``qk``).

The embeddings, each earlier head, each earlier MLP and the biases, with every norm's scale
frozen at the clean run's value (TransformerLens's ``apply_ln_to_stack`` convention), so that
the stream, and each head's query and key, are linear in them. Each source is kept in the form
cheapest to carry (``Stream``); a post-LayerNorm block's norms are applied to every source
(``next_stream``), a pre-LayerNorm block's norm is folded into the query and key projections
(``folded``). ``projected`` gives every source's part of some heads' queries or keys, rotated
where the model rotates them.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, fields

import torch
from torch import nn

from probe.capture.architectures import architecture, model_part
from probe.capture.names import NORM_POINTS, hook_name
from probe.errors import ProbeError
from probe.heads import HeadId

SCALE = NORM_POINTS[0]  # a norm's hook_scale


@dataclass
class Norm:
    """A norm with its scale frozen at the clean run's: x -> centre(x) * weight / scale."""

    centre: bool
    weight: torch.Tensor  # [d_model]
    scale: torch.Tensor  # [batch, pos, 1]
    bias: torch.Tensor | None  # [d_model]

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """A contribution ``[batch, pos, d_model]`` as the norm passes it on."""
        x = x - x.mean(-1, keepdim=True) if self.centre else x
        return x * self.weight / self.scale

    def basis(self, basis: torch.Tensor) -> torch.Tensor:
        """A fixed map ``[r, d_model]`` into the stream, as the norm passes it on (the scale,
        per position, goes to the source's gain)."""
        basis = basis - basis.mean(-1, keepdim=True) if self.centre else basis
        return basis * self.weight


@dataclass
class Stream:
    """The residual stream as a sum of sources, of three kinds, each kept in the form cheapest
    to carry: dense ones ``[batch, pos, d_model]`` (embeddings, MLP outputs); a bias, a fixed
    vector ``[d_model]`` times a gain per position (the frozen norms' 1/scale since it was
    added); a head's, its z ``[batch, pos, d_head]`` times a fixed ``[d_head, d_model]`` map
    (its W_O and the norms since) times a gain per position."""

    dense_names: list[str] = field(default_factory=list)
    dense: list[torch.Tensor] = field(default_factory=list)
    bias_names: list[str] = field(default_factory=list)
    vectors: list[torch.Tensor] = field(default_factory=list)
    bias_gain: list[torch.Tensor | None] = field(default_factory=list)
    head_names: list[str] = field(default_factory=list)
    z: list[torch.Tensor] = field(default_factory=list)
    basis: list[torch.Tensor] = field(default_factory=list)
    gain: list[torch.Tensor | None] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return self.dense_names + self.bias_names + self.head_names

    def add(self, name: str, x: torch.Tensor) -> None:
        self.dense_names.append(name)
        self.dense.append(x)

    def add_bias(self, name: str, vector: torch.Tensor) -> None:
        self.bias_names.append(name)
        self.vectors.append(vector)
        self.bias_gain.append(None)

    def add_head(self, name: str, z: torch.Tensor, basis: torch.Tensor) -> None:
        self.head_names.append(name)
        self.z.append(z)
        self.basis.append(basis)
        self.gain.append(None)

    def __add__(self, other: Stream) -> Stream:
        return Stream(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def normed(self, norm: Norm, bias_name: str) -> Stream:
        """The stream as ``norm`` (frozen) passes it on, its bias a source of its own."""

        def gained(g):
            return 1 / norm.scale if g is None else g / norm.scale

        out = Stream(
            list(self.dense_names), [norm.dense(x) for x in self.dense],
            list(self.bias_names), [norm.basis(v) for v in self.vectors],
            [gained(g) for g in self.bias_gain],
            list(self.head_names), list(self.z), [norm.basis(b) for b in self.basis],
            [gained(g) for g in self.gain],
        )  # fmt: skip
        if norm.bias is not None:
            out.add_bias(bias_name, norm.bias)
        return out

    def stacked(self) -> Stream:
        """The same stream with each kind's sources stacked once (``[source, batch, pos,
        width]``, gains ``[source, batch, pos, 1]``), so that a chunk gathers its rows in one
        indexing."""
        out = Stream(*(getattr(self, f.name) for f in fields(self)))
        ones = torch.ones_like(self.dense[0][..., :1])

        def gains(found):
            return [torch.stack([ones if g is None else g.expand_as(ones) for g in found])]

        out.dense = [torch.stack(self.dense)]  # the embeddings at least
        if self.vectors:
            out.vectors, out.bias_gain = [torch.stack(self.vectors)], gains(self.bias_gain)
        if self.z:
            out.z, out.basis = [torch.stack(self.z)], [torch.stack(self.basis)]
            out.gain = gains(self.gain)
        return out

    def maps(self, W: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A ``stacked`` stream's biases and head maps through ``W [d_model, width]``: ``[bias,
        width]`` and ``[head source, d_head, width]`` (None where it has none)."""
        vectors = self.vectors[0] @ W if self.vectors else None
        return vectors, (self.basis[0] @ W if self.z else None)

    def parts(self, b, i, W, maps, out: torch.Tensor, scale: torch.Tensor | None) -> None:
        """Each source's part of ``x W`` at rows ``(b, i)`` (``[rows]`` each), ``W [d_model,
        head * d_head]`` and ``maps`` its ``maps(W)``, of a ``stacked`` stream, divided by
        ``scale`` ``[rows]`` where given (a frozen norm's), written into ``out`` ``[source, rows,
        head, d_head]`` (each product written there directly where it is contiguous) in the
        order of ``names``."""
        dense, biases = len(self.dense_names), len(self.bias_names)
        rows, shape = len(b), out.shape[1:]
        inverse = None if scale is None else scale.reciprocal().view(1, rows, 1)

        def gained(gain):  # a kind's gains [source, rows, 1] at the rows, with the norm's
            g = gain[:, b, i]
            return g if inverse is None else g * inverse

        def write(found: torch.Tensor, into: torch.Tensor) -> None:
            # [source, rows, head * d_head] into ``into``: straight from the product where it
            # is contiguous (one chunk of rows), else copied
            if into.is_contiguous():
                into.view(found.shape).copy_(found)
            else:
                into.copy_(found.view(into.shape))

        x = self.dense[0][:, b, i]  # [source, rows, d_model]
        if inverse is not None:
            x = x * inverse
        if out[:dense].is_contiguous():
            torch.matmul(x, W, out=out[:dense].view(dense, rows, W.shape[1]))
        else:
            write(x @ W, out[:dense])
        if self.vectors:
            vectors = maps[0][:, None].expand(biases, rows, W.shape[1])
            g = gained(self.bias_gain[0])
            torch.mul(
                vectors.view(biases, *shape), g.unsqueeze(-1), out=out[dense : dense + biases]
            )
        if self.z:
            z = self.z[0][:, b, i] * gained(self.gain[0])  # the gain on d_head, not head * d_head
            into = out[dense + biases :]
            if into.is_contiguous():
                torch.bmm(z, maps[1], out=into.view(len(z), rows, W.shape[1]))
            else:
                write(torch.bmm(z, maps[1]), into)


def frozen_norm(module: nn.Module, scale: torch.Tensor, dtype) -> Norm:
    weight = module.weight.to(dtype)
    weight = weight + 1 if "Gemma" in type(module).__name__ else weight  # Gemma's 1 + weight
    bias = getattr(module, "bias", None)
    bias = None if bias is None or not bias.any() else bias.to(dtype)
    return Norm(isinstance(module, nn.LayerNorm), weight, scale.to(dtype), bias)


def first_stream(model, spec, cache, dtype, ids) -> Stream:
    """The stream entering layer 0, as a sum of its sources."""
    arch = architecture(model)
    site = spec.attention().name
    stream = Stream()
    resid = cache[hook_name("hook_resid_pre", 0, site)].to(dtype)
    pos_name = hook_name("hook_pos_embed")
    relative = spec.model_type == "t5"  # its hook_pos_embed is the bias of the scores
    pos = None if relative or pos_name not in cache else cache[pos_name].to(dtype)
    pos = None if pos is None else pos.expand_as(resid)
    if not arch.post_ln:
        if pos is not None:
            stream.add("embed", resid - pos)  # the token embedding as the model scaled it
            stream.add("pos_embed", pos)
        else:
            stream.add("embed", resid)
        return stream
    embed_ln = model_part(model, "embed_ln")
    if embed_ln is None:
        raise ProbeError(f"qk_attribution cannot split {spec.model_type}'s embeddings")
    norm = frozen_norm(embed_ln, cache[hook_name(f"embed_ln.{SCALE}")], dtype)
    stream.add("embed", norm.dense(cache[hook_name("hook_embed")].to(dtype)))
    if pos is not None:
        stream.add("pos_embed", norm.dense(pos))
    if norm.bias is not None:
        stream.add_bias("embed_ln_bias", norm.bias)
    embeddings = getattr(model.base_model, "embeddings", None)
    if getattr(embeddings, "token_type_embeddings", None) is not None:
        # What the norm made of the token types: the rest of the stream, exactly.
        stream.add("token_type_embed", resid - sum(stream.dense) - sum(stream.vectors))
    return stream


def scale_of(cache, part: str, layer: int, site: str) -> torch.Tensor:
    return cache[hook_name(f"{part}.{SCALE}", layer, site)]


def next_stream(model, arch, cache, site, layer, block, weights, stream, dtype) -> Stream:
    """The stream entering layer + 1: this layer's heads (z times W_O), its attention bias and
    its MLP added, and in post-LayerNorm blocks both norms (frozen) after their sums."""
    z = cache[hook_name("hook_z", layer, site)].to(dtype)
    attn = Stream()
    for h in range(weights.n_heads):
        attn.add_head(str(HeadId(layer, h)), z[:, :, h], weights.W_O[h].to(dtype))
    if weights.b_O.any():
        attn.add_bias(f"attn_bias{layer}", weights.b_O.to(dtype))
    if arch.ln1_post:  # Gemma: the attention's output normalised before its sum
        scale = scale_of(cache, "ln1_post", layer, site)
        post = frozen_norm(block.get_submodule(arch.ln1_post), scale, dtype)
        attn = attn.normed(post, f"ln1_post_bias{layer}")
    stream = stream + attn
    if arch.post_ln:
        ln1 = frozen_norm(block.get_submodule(arch.ln1), scale_of(cache, "ln1", layer, site), dtype)
        stream = stream.normed(ln1, f"ln1_bias{layer}")
    stream.add(f"mlp{layer}", cache[hook_name("hook_mlp_out", layer, site)].to(dtype))
    if arch.post_ln:
        ln2 = frozen_norm(block.get_submodule(arch.ln2), scale_of(cache, "ln2", layer, site), dtype)
        stream = stream.normed(ln2, f"ln2_bias{layer}")
    return stream


def rotation(module: nn.Module, cos_sin, dtype):
    """A function rotating parts ``[source, rows, head, d_head]`` at rows (b, i), as the
    model's own ``apply_rotary_pos_emb`` rotates its queries and keys."""
    if cos_sin is None:
        raise ProbeError(
            f"qk_attribution did not see {type(module).__name__}'s rotary position embeddings"
        )
    apply = getattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb", None)
    if apply is None:
        raise ProbeError(f"qk_attribution cannot rotate {type(module).__name__}'s queries")
    cos, sin = (t.to(dtype) for t in cos_sin)
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]

    def rotate(parts: torch.Tensor, b: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        c, s = cos[b % cos.shape[0], i], sin[b % sin.shape[0], i]  # [rows, rotary dims]
        return apply(parts, parts, c, s, unsqueeze_dim=1)[0]  # one rotation per row, all heads

    return rotate


def _empty(shape, dtype, device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def folded(norm: Norm | None, W: torch.Tensor) -> torch.Tensor:
    """``W [head, d_model, d_head]`` with the frozen norm's centring and weight folded in:
    centre(x) * w @ W is x @ folded(W) (the scale, per position, is applied to the rows)."""
    if norm is None:
        return W
    W = W * norm.weight[None, :, None]
    return W - W.mean(1, keepdim=True) if norm.centre else W


class Reserved:
    """Memory for the parts ``projected`` writes, kept from one layer to the next: one buffer
    a side (queries, keys), reserved on the CPU for the largest size a later layer can need
    (``bound`` elements, at most ``limit``). A fresh allocation this large is mapped from the
    operating system and each of its pages zeroed at first touch, once a layer otherwise: on
    MiniLM some 130,000 page faults, 0.2-0.35 s of a 2 s call, measured. Pages of the
    reservation never written are never touched, so they take no memory."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def empty(self, side: str, shape, dtype, device, bound: int, limit: int) -> torch.Tensor:
        """An uninitialised tensor of ``shape``, a view of ``side``'s buffer."""
        n = math.prod(shape)
        buffer = self.buffers.get(side)
        if buffer is None or buffer.numel() < n or buffer.dtype != dtype or buffer.device != device:
            self.buffers.pop(side, None)  # freed before the next is taken
            cpu = torch.device(device).type == "cpu"  # elsewhere, the device's own allocator
            buffer = torch.empty(max(n, min(bound, limit)) if cpu else n, dtype=dtype,
                                 device=device)  # fmt: skip
            self.buffers[side] = buffer
        return buffer[:n].view(shape)


def projected(read, rows, T, W, consts, norm, rotate, chunk, out=None) -> torch.Tensor:
    """Every source's part of the queries (or keys) of some heads at flat rows ``rows`` (input
    ``rows // T``, position ``rows % T``): ``[source, rows, head, d_head]``, the sources of
    ``read`` and then ``consts`` (each ``[head, d_head]``: the projection's bias, and the norm's
    through it), rotated where the model rotates. ``W`` ``[head, d_model, d_head]``; ``norm``:
    the frozen norm between the stream and ``W`` (pre-LayerNorm blocks), or None. Rows ``chunk``
    at a time (a chunk's dense sources are gathered whole). A head's parts are read as
    ``out[:, :, head].transpose(0, 1)`` (``[rows, source, d_head]``): its terms gather their
    rows from there, so nothing is copied to lay them out. ``out``: a callable giving the
    (uninitialised) result for its shape, dtype and device (default ``torch.empty``)."""
    b, i = (rows // T).to(W.device), (rows % T).to(W.device)
    flat = folded(norm, W).permute(1, 0, 2).flatten(1)  # [d_model, head * d_head]
    maps = read.maps(flat)  # once for every chunk
    n = len(read.names)
    shape = (n + len(consts), len(b), W.shape[0], W.shape[2])
    out = (out or _empty)(shape, W.dtype, W.device)
    for start in range(0, len(b), chunk):
        at = slice(start, start + chunk)
        part = out[:, at]
        scale = None if norm is None else norm.scale[b[at], i[at]].view(-1)
        read.parts(b[at], i[at], flat, maps, part[:n], scale)
        for c, const in enumerate(consts):
            part[n + c] = const
        if rotate is not None:
            part.copy_(rotate(part, b[at], i[at]))
    return out
