"""Hook names, built and parsed here only (TransformerLens does it with ``get_act_name``).

A model's hook points are named as TransformerLens names them:

- an attention's, ``{stack}.{layer}.{attn}.{point}``: ``blocks.3.attn.hook_pattern``,
  ``encoder.0.attn.hook_z``, ``decoder.1.cross_attn.hook_q``;
- the residual stream's, ``{stack}.{layer}.{point}``: ``blocks.3.hook_resid_pre``,
  ``decoder.1.hook_cross_attn_out``;
- a block's layer norms' and MLP's, ``{stack}.{layer}.{part}.{point}``:
  ``blocks.3.ln1.hook_scale``, ``blocks.3.mlp.hook_post``;
- an attention's query and key norms' (Qwen3, Gemma 3), ``{stack}.{layer}.{attn}.{norm}.{point}``:
  ``blocks.3.attn.q_norm.hook_scale``;
- the model's own, the point alone: ``hook_embed`` (the token embedding), ``hook_pos_embed``,
  ``embed_ln.hook_scale``, ``ln_final.hook_scale``, ``hook_unembed``; an encoder-decoder model's
  under its stack's name where each stack has its own: ``decoder_embed_ln.hook_scale``,
  ``encoder_ln_final.hook_scale``;
- a bare ``probe.MultiHeadAttention``'s, the point alone: ``hook_z``.

The stack is ``blocks`` for encoder-only and decoder-only models, ``encoder`` or ``decoder`` for
encoder-decoder ones. An attention is named by its hook prefix without the layer
(``"decoder.cross_attn"``, an ``Attention``): the name ``head_weights``, ``ablate`` and
``Cache.stack`` take.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from enum import StrEnum
from typing import NamedTuple


class Stack(StrEnum):
    """A stack of blocks, the first part of a hook name."""

    BLOCKS = "blocks"
    ENCODER = "encoder"
    DECODER = "decoder"


class Attention(StrEnum):
    """One attention of a model, by its hook prefix without the layer."""

    BLOCKS = "blocks.attn"
    ENCODER = "encoder.attn"
    DECODER = "decoder.attn"
    CROSS = "decoder.cross_attn"  # queries from the decoder, keys and values from the encoder

    @property
    def stack(self) -> Stack:
        """The stack whose blocks hold this attention."""
        return Stack(self.partition(".")[0])

    @property
    def attn(self) -> str:
        """The attention's part of a hook name: ``"attn"`` or ``"cross_attn"``."""
        return self.partition(".")[2]


# Each attention's points (hook_rot_q and hook_rot_k on rotary models only), then the residual
# stream's: per block, and the cross-attention's output in a decoder block.
ATTENTION_POINTS = (
    "hook_q",
    "hook_k",
    "hook_v",
    "hook_attn_scores",
    "hook_pattern",
    "hook_z",
    "hook_result",
)
ROTARY_POINTS = ("hook_rot_q", "hook_rot_k")
# Qwen3's and Gemma 3's norms of each head's query and key, between hook_q/hook_k and the
# rotation: their scale and normalised input (as a block's norms'), and their output.
QK_NORMS = ("q_norm", "k_norm")
QK_NORM_POINTS = ("hook_q_normed", "hook_k_normed")
RESIDUAL_POINTS = (
    "hook_resid_pre",
    "hook_attn_out",
    "hook_resid_mid",
    "hook_mlp_in",
    "hook_mlp_out",
    "hook_resid_post",
)
# A decoder block's cross-attention's output, and the stream after its sum (T5's).
CROSS_POINTS = ("hook_cross_attn_out", "hook_resid_mid2")
# The attention's input per head, [batch, pos, head, d_model], before ln1 (TransformerLens's
# use_attn_in and use_split_qkv_input): an edit reaches only that head's query, key or value.
INPUT_POINTS = ("hook_attn_in", "hook_q_input", "hook_k_input", "hook_v_input")
# A layer norm's: sqrt(var + eps) [batch, pos, 1], and its input centred (LayerNorm) and divided
# by it, before the weight and bias. An MLP's: before and after its activation (hook_pre_linear:
# a gated MLP's other input projection).
NORM_POINTS = ("hook_scale", "hook_normalized")
MLP_POINTS = ("hook_pre", "hook_pre_linear", "hook_post")
# Before the attention and the MLP (a decoder block's: before the self-attention, the
# cross-attention and the MLP); Gemma's after the attention and the MLP.
NORMS = ("ln1", "ln2", "ln3", "ln1_post", "ln2_post")
BLOCK_PARTS = dict.fromkeys(NORMS, NORM_POINTS) | {"mlp": MLP_POINTS}
EMBED = "hook_embed"
POS_EMBED = "hook_pos_embed"
UNEMBED = "hook_unembed"
# The model's norms: of the embeddings (BERT's, BART's; an encoder-decoder model's decoder has its
# own) and after the last block (per stack in an encoder-decoder model).
MODEL_NORMS = ("embed_ln", "ln_final", "decoder_embed_ln", "encoder_ln_final", "decoder_ln_final")
MODEL_POINTS = (EMBED, POS_EMBED, *(f"{n}.{p}" for n in MODEL_NORMS for p in NORM_POINTS), UNEMBED)
_IN_QK_NORM = tuple(f"{norm}.{p}" for norm in QK_NORMS for p in NORM_POINTS)
_IN_ATTENTION = frozenset(ATTENTION_POINTS + ROTARY_POINTS + QK_NORM_POINTS + _IN_QK_NORM)
_IN_PART = frozenset(f"{part}.{p}" for part, points in BLOCK_PARTS.items() for p in points)
_IN_BLOCK = frozenset(RESIDUAL_POINTS + CROSS_POINTS + INPUT_POINTS) | _IN_PART
_PARTS = frozenset((*BLOCK_PARTS, *QK_NORMS, *MODEL_NORMS))  # parts named in a point
_KNOWN = (*ATTENTION_POINTS, *ROTARY_POINTS, *QK_NORM_POINTS, *_IN_QK_NORM, *RESIDUAL_POINTS)
_KNOWN += (*CROSS_POINTS, *INPUT_POINTS)
_KNOWN += tuple(_IN_PART)
_KNOWN += MODEL_POINTS
_STACKS = frozenset(s.value for s in Stack)
_ATTENTIONS = frozenset(a.value for a in Attention)


class Point(NamedTuple):
    """What a hook point holds: its shape (TransformerLens's dimension names) and meaning."""

    shape: str
    meaning: str


# Every point's shape and meaning, written here once: the hook reference of the docs is generated
# from this, ``describe`` and the architectures (tests/capture/test_names.py checks the shapes
# against a traced model and that every point has its line).
_POINTS = {
    "hook_q": Point("[batch, pos, head, d_head]", "the queries, x W_Q + b_Q per head, before any "
                    "rotation or query norm (and before OPT's 1/√d_head scaling)"),
    "hook_k": Point("[batch, pos, kv_head, d_head]", "the keys, x W_K + b_K per head, before any "
                    "rotation or key norm; fewer heads than the queries' under grouped-query "
                    "attention; a cross-attention's are over source positions"),
    "hook_v": Point("[batch, pos, kv_head, d_head]", "the values, x W_V + b_V per head (as the "
                    "keys: their own heads, source positions in a cross-attention)"),
    "hook_rot_q": Point("[batch, pos, head, d_head]", "rotary models: the queries after the "
                        "rotation (and the query norm), what meets the keys in the scores"),
    "hook_rot_k": Point("[batch, pos, kv_head, d_head]", "rotary models: the keys after the "
                        "rotation (and the key norm)"),
    "hook_q_normed": Point("[batch, pos, head, d_head]", "Qwen3, Gemma 3: the query norm's "
                           "output, before the rotation"),
    "hook_k_normed": Point("[batch, pos, kv_head, d_head]", "Qwen3, Gemma 3: the key norm's "
                           "output, before the rotation"),
    "hook_attn_scores": Point("[batch, head, q_pos, k_pos]", "the scores, scaled and masked with "
                              "the dtype's minimum, before the softmax (Gemma 2: after the "
                              "soft-capping)"),
    "hook_pattern": Point("[batch, head, q_pos, k_pos]", "the attention weights: each query's row "
                          "sums to 1 over the keys it may see (masked keys, padding and keys "
                          "outside a sliding window get 0)"),
    "hook_z": Point("[batch, pos, head, d_head]", "each head's weighted sum of the values, "
                    "before the output projection"),
    "hook_result": Point("[batch, pos, head, d_model]", "each head's output, z W_O per head: the "
                         "sum over heads, plus b_O, is the attention's output"),
    "hook_resid_pre": Point("[batch, pos, d_model]", "the residual stream entering the block"),
    "hook_attn_out": Point("[batch, pos, d_model]", "the attention's output, added to the stream "
                           "(Gemma: after the norm of the output)"),
    "hook_resid_mid": Point("[batch, pos, d_model]", "resid_pre + attn_out (none in GPT-NeoX's "
                            "parallel blocks)"),
    "hook_mlp_in": Point("[batch, pos, d_model]", "the stream the MLP's norm reads (in a decoder "
                         "block, after the cross-attention)"),
    "hook_mlp_out": Point("[batch, pos, d_model]", "the MLP's output, added to the stream "
                          "(Gemma: after the norm of the output)"),
    "hook_resid_post": Point("[batch, pos, d_model]", "the residual stream leaving the block "
                             "(post-LayerNorm encoders: LN₁(resid_mid) + mlp_out, before LN₂)"),
    "hook_cross_attn_out": Point("[batch, pos, d_model]", "a decoder block's cross-attention's "
                                 "output, added to the stream"),
    "hook_resid_mid2": Point("[batch, pos, d_model]", "T5's decoder blocks: the stream after the "
                             "cross-attention's sum, the MLP's input"),
    "hook_attn_in": Point("[batch, pos, head, d_model]", "the block's input, one copy per head, "
                          "before ln1: an edit reaches only that head's query, key and value"),
    "hook_q_input": Point("[batch, pos, head, d_model]", "the block's input per head for the "
                          "queries alone (TransformerLens's use_split_qkv_input)"),
    "hook_k_input": Point("[batch, pos, kv_head, d_model]", "the block's input per head for the "
                          "keys alone"),
    "hook_v_input": Point("[batch, pos, kv_head, d_model]", "the block's input per head for the "
                          "values alone"),
    "hook_scale": Point("[batch, pos, 1]", "the scale: √(var + ε) for a LayerNorm, √(mean x² + ε) "
                        "for an RMSNorm"),
    "hook_normalized": Point("[batch, pos, d_model]", "the input centred (LayerNorm) and divided "
                             "by the scale, before the weight and bias"),
    "hook_pre": Point("[batch, pos, d_mlp]", "the input projection's output, before the "
                      "activation (a gated MLP's gate)"),
    "hook_pre_linear": Point("[batch, pos, d_mlp]", "a gated MLP's other input projection"),
    "hook_post": Point("[batch, pos, d_mlp]", "the activation, the output projection's input"),
    EMBED: Point("[batch, pos, d_model]", "the token embeddings (an encoder-decoder model's "
                 "encoder's)"),
    POS_EMBED: Point("[batch, pos, d_model]", "the learned position embeddings (GPT-2, BERT, OPT, "
                     "BART); on T5, the encoder's relative position bias, [q_pos, k_pos, head], "
                     "which each layer's scores add"),
    UNEMBED: Point("[batch, pos, d_vocab]", "the logits, on a model with its LM head (before "
                   "BART's, mBART's and Marian's final_logits_bias)"),
}  # fmt: skip
# Where a norm or the MLP sits; its points are ``_POINTS``'s (a query or key norm's per head).
_PART_MEANINGS = {
    "ln1": "the norm before the attention (post-LayerNorm encoders: after its sum)",
    "ln2": "the norm before the MLP (post-LayerNorm encoders: after its sum; a decoder block with "
    "cross-attention: before the cross-attention)",
    "ln3": "a decoder block's norm before the MLP, when it has a cross-attention",
    "ln1_post": "Gemma's norm of the attention's output",
    "ln2_post": "Gemma's norm of the MLP's output",
    "mlp": "the MLP",
    "q_norm": "Qwen3's and Gemma 3's norm of each head's query",
    "k_norm": "Qwen3's and Gemma 3's norm of each head's key",
    "embed_ln": "the embeddings' norm (BERT-like encoders, ModernBERT, BART's encoder)",
    "ln_final": "the norm after the last block",
    "decoder_embed_ln": "the decoder's embeddings' norm (BART, mBART)",
    "encoder_ln_final": "the encoder's final norm (mBART, T5)",
    "decoder_ln_final": "the decoder's final norm (mBART, T5)",
}


def describe(point: str) -> Point:
    """The shape and meaning of a point, as ``point_of`` gives it: ``"hook_z"``,
    ``"ln1.hook_scale"``, ``"q_norm.hook_normalized"``.

    Raises
    ------
    ValueError
        For a point that is not probe's.
    """
    if point not in _KNOWN:
        raise ValueError(unknown(point, _KNOWN))
    part, _, last = point.rpartition(".")
    if not part:
        return _POINTS[point]
    shape, meaning = _POINTS[last]
    if part in QK_NORMS:  # per head, as the queries and keys
        heads = "head" if part == "q_norm" else "kv_head"
        shape = shape.replace("pos, ", f"pos, {heads}, ").replace("d_model", "d_head")
    return Point(shape, f"{_PART_MEANINGS[part]}: {meaning}")


def known_points() -> tuple[str, ...]:
    """Every point probe names, as ``point_of`` gives them, in the order of the reference."""
    parts = tuple(f"{part}.{p}" for part, points in BLOCK_PARTS.items() for p in points)
    ordered = (*_KNOWN[: _KNOWN.index(INPUT_POINTS[-1]) + 1], *parts, *MODEL_POINTS)
    assert set(ordered) == set(_KNOWN), "a point is missing from the reference's order"
    return ordered


class HookName(NamedTuple):
    """A hook name's parts: ``decoder.1.cross_attn.hook_z`` is ``HookName("hook_z", 1,
    Stack.DECODER, "cross_attn")``; ``str()`` gives the name back."""

    point: str
    layer: int | None = None
    stack: Stack | None = None
    attn: str | None = None  # "attn" or "cross_attn" for an attention's points

    @property
    def attention(self) -> Attention | None:
        """The attention the point belongs to (None for the residual stream's points)."""
        if self.stack is None or self.attn is None:
            return None
        return Attention(f"{self.stack}.{self.attn}")

    @property
    def site(self) -> str | None:
        """What the layers of this point are layers of: its attention, or for the residual
        stream's points its stack (None for ``hook_embed`` and a bare attention's points)."""
        return self.attention or self.stack

    def __str__(self) -> str:
        return hook_name(self.point, self.layer, self.site or Stack.BLOCKS)


def hook_name(point: str, layer: int | None = None, site: str = Stack.BLOCKS) -> str:
    """The full name of a hook point.

    Parameters
    ----------
    point : str
        The point: ``"hook_pattern"``, or TransformerLens's short form ``"pattern"``; a block
        part's with the part, ``"ln1.hook_scale"``, ``"mlp.hook_pre"``.
    layer : int, optional
        0-based, within the stack; None for the model's own points (``hook_embed``,
        ``ln_final.hook_scale``) and a bare attention's points.
    site : str
        An attention (``"decoder.cross_attn"``) or, for the residual stream's points, a stack
        (``"encoder"``); an attention's point under a stack goes to its self-attention, and a
        residual point under an attention to its stack.

    Returns
    -------
    str
        ``hook_name("pattern", 3)`` is ``"blocks.3.attn.hook_pattern"``,
        ``hook_name("hook_z", 1, "decoder.cross_attn")`` ``"decoder.1.cross_attn.hook_z"``,
        ``hook_name("hook_resid_pre", 0, "encoder")`` ``"encoder.0.hook_resid_pre"``.

    Raises
    ------
    ValueError
        For an unknown point or site, or a layer given to ``hook_embed``.
    """
    part, _, point = point.rpartition(".")
    point = point if point.startswith("hook_") else f"hook_{point}"
    point = f"{part}.{point}" if part else point
    if point not in _KNOWN:
        raise ValueError(unknown(point, _KNOWN))
    if layer is None:
        return point
    if point in MODEL_POINTS:
        raise ValueError(f"{point} belongs to no layer")
    if site not in _STACKS | _ATTENTIONS:
        raise ValueError(
            f"unknown site {site!r}: an attention ({', '.join(Attention)}) or a stack "
            f"({', '.join(Stack)})"
        )
    stack, _, attn = str(site).partition(".")
    if point in _IN_ATTENTION:
        return f"{stack}.{int(layer)}.{attn or 'attn'}.{point}"
    return f"{stack}.{int(layer)}.{point}"


def parse(name: str) -> HookName:
    """A hook name's parts, the inverse of ``hook_name`` (and of ``str(HookName)``).

    Raises
    ------
    ValueError
        For a name that is not probe's, e.g. a point of a model built from
        ``MultiHeadAttention`` modules at other paths (``point_of`` reads those).
    """
    parts = name.split(".")
    if name in _IN_ATTENTION or name in MODEL_POINTS:
        return HookName(name)
    if len(parts) in (3, 4, 5) and parts[0] in _STACKS and parts[1].isdigit():
        stack, layer, point = Stack(parts[0]), int(parts[1]), ".".join(parts[2:])
        if point in _IN_BLOCK:
            return HookName(point, layer, stack)
        point = ".".join(parts[3:])  # "hook_z", or an attention's norm's "q_norm.hook_scale"
        if f"{stack}.{parts[2]}" in _ATTENTIONS and point in _IN_ATTENTION:
            return HookName(point, layer, stack, parts[2])
    raise ValueError(
        f"{name!r} is not a probe hook name such as 'blocks.3.attn.hook_z', "
        "'decoder.1.cross_attn.hook_pattern', 'encoder.0.hook_resid_pre' or 'hook_embed'"
    )


def nearest(name: str, names: Iterable[str]) -> list[str]:
    """The names a misspelt ``name`` most likely meant: those of ``names`` as near to it as the
    nearest (difflib's ratio, at least 0.6), at most three, in ``names``' order."""
    names = list(dict.fromkeys(names))
    ratios = [difflib.SequenceMatcher(None, name, n).ratio() for n in names]
    best = max(ratios, default=0.0)
    return [n for n, r in zip(names, ratios, strict=True) if r >= max(best, 0.6)][:3]


def unknown(name: str, names: Iterable[str]) -> str:
    """One line for a hook name that is none of ``names`` (a model's full names, or points):
    the names nearest to it, as a misspelling's ("did you mean 'hook_pattern'?"); for a layer
    the model lacks, its layers; for a point of probe's the model lacks, what the point is.

    Examples
    --------
    >>> unknown("blocks.0.attn.hook_patern", ["blocks.0.attn.hook_pattern", "blocks.0.hook_z"])
    "unknown hook point 'blocks.0.attn.hook_patern'; did you mean 'blocks.0.attn.hook_pattern'?"
    """
    names = list(names)
    try:
        wanted = parse(name)
    except ValueError:
        wanted = None
    if wanted is not None and wanted.layer is not None:
        layers = {p.layer for p in map(_parsed, names) if p and p.stack == wanted.stack}
        layers.discard(None)
        if layers and wanted.layer not in layers:
            return (f"unknown hook point {name!r}: the model's {wanted.stack} are layers "
                    f"{min(layers)} to {max(layers)}")  # fmt: skip
    point = point_of(name)
    if point in _KNOWN and names and not any(point_of(n) == point for n in names):
        return f"unknown hook point {name!r}: this model has no {point} ({describe(point).meaning})"
    close = nearest(name, [*names, *(point_of(n) for n in names)])
    if close:
        return f"unknown hook point {name!r}; did you mean {' or '.join(map(repr, close))}?"
    return (f"unknown hook point {name!r}; a point is named in full ('blocks.0.attn.hook_z') or "
            "by its last part ('hook_z'), as the hook reference lists them")  # fmt: skip


def _parsed(name: str) -> HookName | None:
    try:
        return parse(name)
    except ValueError:
        return None


def point_of(name: str) -> str:
    """The point of any hook name: its last part (``"hook_z"``), with a block part's part
    (``"ln1.hook_scale"``); unlike ``parse``, also for models built from ``MultiHeadAttention``
    modules, whose points are named by module path."""
    rest, _, point = name.rpartition(".")
    part = rest.rpartition(".")[2]
    return f"{part}.{point}" if part in _PARTS else point


# TransformerLens's short names for a block's parts, in ``act_name``.
_NAME_ALIASES = {"attn": "pattern", "attn_logits": "attn_scores", "key": "k", "query": "q"}
_NAME_ALIASES |= {"value": "v", "mlp_pre": "pre", "mlp_post": "post"}
_PART_ALIASES = {"a": "attn", "attention": "attn", "m": "mlp", "b": "", "block": "", "blocks": ""}


def act_name(name: str, layer: int | None = None, part: str | None = None) -> str:
    """A full hook name from TransformerLens's short form (its ``get_act_name``, and the keys
    of ``cache[name, layer, part]``).

    Parameters
    ----------
    name : str
        ``"pattern"``, ``"hook_resid_pre"``, ``"scale"``… or a full name, returned as it is.
    layer : int, optional
        0-based layer; None for the model's own points: ``act_name("scale")`` is
        ``"ln_final.hook_scale"``.
    part : str, optional
        ``"ln1"``, ``"ln2"`` (``"ln3"`` in a decoder block with cross-attention, Gemma's
        ``"ln1_post"``…) for ``scale`` and ``normalized``; ``"attn"``, ``"mlp"`` or the
        block (``"b"``) where the name does not say (TransformerLens's aliases: a, m, b).

    Returns
    -------
    str
        ``act_name("q", 1, "attn")`` is ``"blocks.1.attn.hook_q"``, ``act_name("pre", 0)``
        ``"blocks.0.mlp.hook_pre"``, ``act_name("scale", 2, "ln1")`` ``"blocks.2.ln1.hook_scale"``.
    """
    if "." in name:
        return name
    name = _NAME_ALIASES.get(name, name)
    point = name if name.startswith("hook_") else f"hook_{name}"
    part = _PART_ALIASES.get(part, part) if part is not None else None
    if point in NORM_POINTS and layer is None:
        return f"ln_final.{point}"
    if point in NORM_POINTS:
        if part not in NORMS:
            raise ValueError(f"{name} of layer {layer}: say which norm, e.g. ({name!r}, 0, 'ln1')")
        return hook_name(f"{part}.{point}", layer)
    if point in MLP_POINTS and layer is not None:
        return hook_name(f"mlp.{point}", layer)
    return hook_name(point, layer)
