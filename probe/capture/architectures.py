"""Every fact probe keeps about each supported Hugging Face architecture, one row per model type
(``MODEL_TYPES``): where each attention, norm and MLP lives, the model's own modules, whether it
is causal, its position table and its norms' gain. The one place to add an architecture: one
entry there.

How the attention weights split into heads is ``probe.capture.head_weights``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn

from probe.capture.names import Attention
from probe.errors import ProbeError


@dataclass(frozen=True)
class Architecture:
    """Where one architecture keeps one of its attentions (and that attention's block's norms and
    MLP): each attention of a ``ModelType`` row.

    ``blocks`` is relative to the model's ``base_model``; the others are relative to a block.

    ``qkv`` names a fused projection instead of ``q``/``k``/``v``: ``"gpt2"`` is a Conv1D whose
    output is [Q | K | V]; ``"linear"`` a Linear whose output is [Q | K | V] (K and V with
    ``n_kv_heads`` heads: Phi-3, ModernBERT); ``"neox"`` a Linear whose output is per head
    [q_i | k_i | v_i].

    ``rotary``: queries and keys are rotated (rotary position embedding) after their projection
    (and, on Qwen3 and Gemma 3, their norms), before they meet in the scores.

    ``ln1`` and ``ln2`` are the norms before the attention and before the MLP (pre-LayerNorm
    blocks), or after each sum (``post_ln``: BERT's, where ``ln1``'s input is the stream after
    the attention and ``ln2``'s after the MLP). ``mlp_pre`` is the MLP's input projection
    (a gated MLP's gate), ``mlp_pre_linear`` a gated MLP's other, ``mlp_post`` the projection
    whose input is the activation. Empty where the architecture has none that TransformerLens
    would hook (a fused gate and input projection).
    """

    blocks: str
    attention: str
    q: str = ""
    k: str = ""
    v: str = ""
    o: str = ""
    qkv: str = ""
    fused: str = ""
    # The modules whose outputs are the attention's and the MLP's contributions to the residual
    # stream (before the LayerNorm that follows the sum in post-LayerNorm encoders such as BERT;
    # after the norm that Gemma applies to each before the sum). The attention's is ``o`` unless
    # named.
    mlp: str = ""
    attn_out: str = ""
    rotary: bool = False
    ln1: str = ""
    ln2: str = ""
    ln1_post: str = ""  # Gemma's norms of the attention's and the MLP's outputs
    ln2_post: str = ""
    mlp_pre: str = ""
    mlp_pre_linear: str = ""
    mlp_post: str = ""
    mlp_pre_fused: str = ""  # one projection whose output is [mlp_pre's | mlp_pre_linear's]
    post_ln: bool = False
    # The query projection's output is scaled by 1/√d_head before the attention (OPT): hook_q
    # is then on the projection, unscaled, as TransformerLens has it.
    q_scaled: bool = False
    # Each head's query and key normalised before the rotation (Qwen3, Gemma 3); Gemma 3's norms
    # see them as [batch, head, pos, d_head], Qwen3's as [batch, pos, head, d_head].
    q_norm: str = ""
    k_norm: str = ""
    qk_norm_heads_first: bool = False
    # A decoder block's norm of its cross-attention (before it, or after its sum if post_ln). Its
    # points are then TransformerLens's ln2, and the MLP's norm's (``ln2`` here) ln3.
    ln_cross: str = ""
    # A cross-attention's: the module whose input is the stream after its sum (T5's MLP sublayer),
    # for TransformerLens's hook_resid_mid2.
    stream_after: str = ""


_BERT = Architecture(
    "encoder.layer", "attention.self", "attention.self.query", "attention.self.key",
    "attention.self.value", "attention.output.dense", mlp="output.dense",
    ln1="attention.output.LayerNorm", ln2="output.LayerNorm", mlp_pre="intermediate.dense",
    mlp_post="output.dense", post_ln=True,
)  # fmt: skip
_LLAMA = Architecture(
    "layers", "self_attn", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
    "self_attn.o_proj", mlp="mlp", rotary=True, ln1="input_layernorm",
    ln2="post_attention_layernorm", mlp_pre="mlp.gate_proj", mlp_pre_linear="mlp.up_proj",
    mlp_post="mlp.down_proj",
)  # fmt: skip
# Gemma normalises the attention's and the MLP's outputs before adding them to the stream.
_GEMMA = replace(
    _LLAMA,
    attn_out="post_attention_layernorm",
    mlp="post_feedforward_layernorm",
    ln2="pre_feedforward_layernorm",
    ln1_post="post_attention_layernorm",
    ln2_post="post_feedforward_layernorm",
)

_DISTILBERT = Architecture(
    "transformer.layer",
    "attention",
    "attention.q_lin",
    "attention.k_lin",
    "attention.v_lin",
    "attention.out_lin",
    mlp="ffn",
    ln1="sa_layer_norm", ln2="output_layer_norm", mlp_pre="ffn.lin1", mlp_post="ffn.lin2",
    post_ln=True,
)  # fmt: skip
_ALBERT = Architecture(
    "encoder.albert_layer_groups",
    "attention",
    "attention.query",
    "attention.key",
    "attention.value",
    "attention.dense",
    mlp="ffn_output",
    ln1="attention.LayerNorm", ln2="full_layer_layer_norm", mlp_pre="ffn",
    mlp_post="ffn_output", post_ln=True,
)  # fmt: skip
_GPT2 = Architecture(
    "h", "attn", o="attn.c_proj", qkv="attn.c_attn", fused="gpt2", mlp="mlp", ln1="ln_1",
    ln2="ln_2", mlp_pre="mlp.c_fc", mlp_post="mlp.c_proj",
)  # fmt: skip
_GPT_NEOX = Architecture(
    "layers",
    "attention",
    o="attention.dense",
    qkv="attention.query_key_value",
    fused="neox",
    mlp="mlp",
    rotary=True,
    ln1="input_layernorm", ln2="post_attention_layernorm", mlp_pre="mlp.dense_h_to_4h",
    mlp_post="mlp.dense_4h_to_h",
)  # fmt: skip
_OPT = Architecture(
    "decoder.layers",
    "self_attn",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.out_proj",
    mlp="fc2",
    ln1="self_attn_layer_norm", ln2="final_layer_norm", mlp_pre="fc1", mlp_post="fc2",
    q_scaled=True,
)  # fmt: skip
# Query and key RMSNorms sit between the projections and the rotary embedding: hook_q and
# hook_k are before both (as TransformerLens's), hook_rot_q and hook_rot_k after both.
_QWEN3 = replace(_LLAMA, q_norm="self_attn.q_norm", k_norm="self_attn.k_norm")
_GEMMA3 = replace(
    _GEMMA, q_norm="self_attn.q_norm", k_norm="self_attn.k_norm", qk_norm_heads_first=True
)
_PHI3 = Architecture(
    "layers", "self_attn", o="self_attn.o_proj", qkv="self_attn.qkv_proj", fused="linear",
    mlp="mlp", rotary=True, ln1="input_layernorm", ln2="post_attention_layernorm",
    mlp_pre_fused="mlp.gate_up_proj", mlp_post="mlp.down_proj",
)  # fmt: skip
_MODERNBERT = Architecture(
    "layers", "attn", o="attn.Wo", qkv="attn.Wqkv", fused="linear", mlp="mlp", rotary=True,
    ln1="attn_norm", ln2="mlp_norm", mlp_pre_fused="mlp.Wi", mlp_post="mlp.Wo",
)  # fmt: skip

# Encoder-decoder models: each attention by its hook prefix without the layer. Cross-attention
# reads queries from the decoder's stream and keys and values from the encoder's output.
_BART_SELF = Architecture(
    "encoder.layers",
    "self_attn",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.out_proj",
    mlp="fc2",
    ln1="self_attn_layer_norm",
    ln2="final_layer_norm",
    mlp_pre="fc1",
    mlp_post="fc2",
    post_ln=True,
)
_BART = {
    Attention.ENCODER: _BART_SELF,
    Attention.DECODER: replace(
        _BART_SELF, blocks="decoder.layers", ln_cross="encoder_attn_layer_norm"
    ),
    Attention.CROSS: Architecture(
        "decoder.layers",
        "encoder_attn",
        "encoder_attn.q_proj",
        "encoder_attn.k_proj",
        "encoder_attn.v_proj",
        "encoder_attn.out_proj",
    ),
}
_T5_SELF = Architecture(
    "encoder.block",
    "layer.0.SelfAttention",
    "layer.0.SelfAttention.q",
    "layer.0.SelfAttention.k",
    "layer.0.SelfAttention.v",
    "layer.0.SelfAttention.o",
    mlp="layer.1.DenseReluDense",
    ln1="layer.0.layer_norm",
    ln2="layer.1.layer_norm",
    mlp_pre="layer.1.DenseReluDense.wi",  # absent from gated ones (Flan-T5: wi_0 and wi_1)
    mlp_post="layer.1.DenseReluDense.wo",
)
_T5 = {
    Attention.ENCODER: _T5_SELF,
    Attention.DECODER: replace(
        _T5_SELF,
        blocks="decoder.block",
        mlp="layer.2.DenseReluDense",
        ln2="layer.2.layer_norm",
        ln_cross="layer.1.layer_norm",
        mlp_pre="layer.2.DenseReluDense.wi",
        mlp_post="layer.2.DenseReluDense.wo",
    ),
    Attention.CROSS: Architecture(
        "decoder.block",
        "layer.1.EncDecAttention",
        "layer.1.EncDecAttention.q",
        "layer.1.EncDecAttention.k",
        "layer.1.EncDecAttention.v",
        "layer.1.EncDecAttention.o",
        stream_after="layer.2",
    ),
}
# mBART normalises before each sublayer, as decoders do.
_MBART = {a: replace(arch, post_ln=False) for a, arch in _BART.items()}

# The model's own modules shared by several rows (``ModelType.parts``).
_BERT_MODEL = {
    "embed": "embeddings.word_embeddings", "pos_embed": "embeddings.position_embeddings",
    "embed_ln": "embeddings.LayerNorm",
}  # fmt: skip
_BART_MODEL = {
    "embed": "encoder.embed_tokens", "pos_embed": "encoder.embed_positions",
    "embed_ln": "encoder.layernorm_embedding", "decoder_embed_ln": "decoder.layernorm_embedding",
}  # fmt: skip
_DECODER_MODEL = {"embed": "embed_tokens", "ln_final": "norm"}


@dataclass(frozen=True)
class ModelType:
    """Every fact probe keeps about one model type (a config's ``model_type``): one row of
    ``MODEL_TYPES``."""

    attentions: dict[Attention, Architecture]
    """Each attention by its hook prefix without the layer (``blocks.attn``; an encoder-decoder
    model's ``encoder.attn``, ``decoder.attn`` and ``decoder.cross_attn``), where it lives."""
    parts: dict[str, str] = field(default_factory=dict)
    """The model's own modules (paths from its base model, else from the model: an LM head's
    norm): the token and position embeddings, the embeddings' norm and the final norm, by the
    name of their points (an encoder-decoder model's ``embed`` and ``pos_embed`` are the
    encoder's)."""
    causal: bool = False
    """Each token attends only to itself and earlier tokens."""
    position_offset: int | None = None
    """Where the positions are a learned (or fixed) table of ``max_position_embeddings`` rows,
    which an input longer than that runs past: the rows the table leaves to padding (RoBERTa
    counts from its padding index + 1). None where the positions are rotary or relative, with
    no such limit."""
    norm_weight_offset: int = 0
    """What the norms add to their weight to make their gain, the factor of the normalised input
    (``norm_gain``): Gemma's scale by 1 + weight."""

    @property
    def encoder_decoder(self) -> bool:
        """Whether the model has an encoder, a decoder and a cross-attention between them."""
        return Attention.CROSS in self.attentions


def _only(arch: Architecture) -> dict[Attention, Architecture]:
    """An encoder-only or decoder-only model's one attention."""
    return {Attention.BLOCKS: arch}


MODEL_TYPES: dict[str, ModelType] = {
    "bert": ModelType(
        _only(_BERT), _BERT_MODEL | {"ln_final": "cls.predictions.transform.LayerNorm"},
        position_offset=0,
    ),
    "roberta": ModelType(
        _only(_BERT), _BERT_MODEL | {"ln_final": "lm_head.layer_norm"}, position_offset=2
    ),
    "electra": ModelType(_only(_BERT), _BERT_MODEL, position_offset=0),
    "distilbert": ModelType(
        _only(_DISTILBERT), _BERT_MODEL | {"ln_final": "vocab_layer_norm"}, position_offset=0
    ),
    "albert": ModelType(_only(_ALBERT), _BERT_MODEL, position_offset=0),
    "gpt2": ModelType(
        _only(_GPT2), {"embed": "wte", "pos_embed": "wpe", "ln_final": "ln_f"}, causal=True,
        position_offset=0,
    ),
    "gpt_neox": ModelType(
        _only(_GPT_NEOX), {"embed": "embed_in", "ln_final": "final_layer_norm"}, causal=True
    ),
    "opt": ModelType(
        _only(_OPT),
        {
            "embed": "decoder.embed_tokens", "pos_embed": "decoder.embed_positions",
            "ln_final": "decoder.final_layer_norm",
        },
        causal=True,
        position_offset=0,
    ),
    "llama": ModelType(_only(_LLAMA), _DECODER_MODEL, causal=True),
    "mistral": ModelType(_only(_LLAMA), _DECODER_MODEL, causal=True),
    "qwen2": ModelType(_only(_LLAMA), _DECODER_MODEL, causal=True),
    "qwen3": ModelType(_only(_QWEN3), _DECODER_MODEL, causal=True),
    # Logit soft-capping and sliding windows happen in the attention function (probe's too).
    "gemma2": ModelType(_only(_GEMMA), _DECODER_MODEL, causal=True, norm_weight_offset=1),
    "gemma3_text": ModelType(_only(_GEMMA3), _DECODER_MODEL, causal=True, norm_weight_offset=1),
    "phi3": ModelType(_only(_PHI3), _DECODER_MODEL, causal=True),
    # Local (sliding-window) and global layers alternate; the mask tells them apart.
    "modernbert": ModelType(
        _only(_MODERNBERT),
        {
            "embed": "embeddings.tok_embeddings", "embed_ln": "embeddings.norm",
            "ln_final": "final_norm",
        },
    ),
    "bart": ModelType(_BART, _BART_MODEL, position_offset=0),
    "mbart": ModelType(
        _MBART,
        _BART_MODEL | {
            "encoder_ln_final": "encoder.layer_norm", "decoder_ln_final": "decoder.layer_norm",
        },
        position_offset=0,
    ),
    "marian": ModelType(
        _BART, {"embed": "encoder.embed_tokens", "pos_embed": "encoder.embed_positions"},
        position_offset=0,
    ),
    "t5": ModelType(  # and Flan-T5: relative position bias, no 1/√d_head scaling
        _T5,
        {  # its positions are a learned bias per head and relative distance (bucketed)
            "embed": "encoder.embed_tokens",
            "pos_embed": "encoder.block.0.layer.0.SelfAttention.relative_attention_bias",
            "encoder_ln_final": "encoder.final_layer_norm",
            "decoder_ln_final": "decoder.final_layer_norm",
        },
    ),
}  # fmt: skip


def model_part(model: nn.Module, part: str) -> nn.Module | None:
    """The model's module ``part`` (``"embed"``, ``"pos_embed"``, ``"ln_final"``; see
    ``ModelType.parts``), or None where the model has none (a base model without its LM head)."""
    row = MODEL_TYPES.get(model.config.model_type)
    path = None if row is None else row.parts.get(part)
    for root in (model.base_model, model):
        if path:
            try:
                return root.get_submodule(path)
            except AttributeError:
                continue
    return None


SUPPORTED = ", ".join(sorted(MODEL_TYPES))


class UnsupportedModelError(ProbeError, ValueError):
    """The model's attention cannot be mirrored."""


def attentions(model: nn.Module) -> dict[Attention, Architecture]:
    """Every attention of a Hugging Face model by hook prefix without the layer (an
    ``Attention``, a str): ``"blocks.attn"`` for encoder-only and decoder-only models;
    ``"encoder.attn"``, ``"decoder.attn"`` and ``"decoder.cross_attn"`` for encoder-decoder
    models. A clear error names what is supported.
    """
    config = model.config
    kind = getattr(config, "model_type", type(model).__name__)
    if kind not in MODEL_TYPES:
        raise UnsupportedModelError(
            f"architecture {kind!r} is not supported (its attention is not mirrored by probe); "
            f"supported: {SUPPORTED}"
        )
    if kind == "albert" and config.inner_group_num != 1:
        raise UnsupportedModelError("ALBERT with inner_group_num > 1 is not supported")
    return dict(MODEL_TYPES[kind].attentions)


def architecture(model: nn.Module, attention: str | None = None) -> Architecture:
    """Where one attention of the model lives (see ``attentions``); by default the first: the
    only one, or an encoder-decoder model's encoder self-attention."""
    every = attentions(model)
    if attention is None:
        return next(iter(every.values()))
    if attention not in every:
        raise UnsupportedModelError(
            f"{model.config.model_type} has no attention {attention!r}; it has {', '.join(every)}"
        )
    return every[attention]


def _row(model_or_config) -> ModelType | None:
    """The row of the model (or of a model with this config), or None where it is unsupported."""
    return MODEL_TYPES.get(_config(model_or_config).model_type)


def is_encoder_decoder(model) -> bool:
    """Whether the model (or its config) is a supported encoder-decoder model, whose attentions
    are ``encoder.attn``, ``decoder.attn`` and ``decoder.cross_attn``."""
    row = _row(model)
    return row is not None and row.encoder_decoder


def is_causal(model) -> bool:
    """Whether each token of the model (or of a model with this config) attends only to itself
    and earlier tokens (an encoder-decoder model's encoder does not)."""
    row = _row(model)
    return (row is not None and row.causal) or bool(getattr(_config(model), "is_decoder", False))


def is_rotary(model: nn.Module, attention: str | None = None) -> bool:
    """Whether one attention (see ``architecture``) rotates its queries and keys: then its
    ``hook_q`` and ``hook_k`` are before the rotation and ``hook_rot_q`` and ``hook_rot_k``
    after it."""
    return architecture(model, attention).rotary


def norm_gain(model, weight: torch.Tensor) -> torch.Tensor:
    """What a norm of the model (or of a model with this config) multiplies its normalised input
    by, from the norm's ``weight``: the weight itself, or Gemma's 1 + weight
    (``ModelType.norm_weight_offset``)."""
    row = _row(model)
    offset = 0 if row is None else row.norm_weight_offset
    return weight + offset if offset else weight


def max_positions(model) -> int | None:
    """The longest input the model (or a model with this config) takes, special tokens included:
    the rows of its position table; None where its positions are rotary or relative."""
    config = _config(model)
    row = MODEL_TYPES.get(getattr(config, "model_type", None))
    if row is None or row.position_offset is None:
        return None
    return int(config.max_position_embeddings) - row.position_offset


def check_length(model, length: int) -> None:
    """Refuse an input longer than the model's position table, in one line (the model itself
    would fail deep inside with a tensor-size error that names no position).

    Raises
    ------
    ProbeError
        Saying the limit, the length, and what to do.
    """
    limit = max_positions(model)
    if limit is not None and length > limit:
        name = getattr(_config(model), "_name_or_path", "") or _config(model).model_type
        raise ProbeError(
            f"the input is {length} tokens long, but {name} has {limit} positions; give a shorter "
            "input, cut it into windows (--context on the command line), or use a model with "
            "more positions (rotary ones, such as Llama's, have no fixed limit)"
        )


def head_dim(model: nn.Module, attention: str | None = None) -> int:
    """The width of each head of one attention (see ``architecture``): the attention module's
    own, where it states it (an encoder-decoder model's decoder may have other heads than its
    encoder), otherwise the config's."""
    arch = architecture(model, attention)
    module = blocks(model, attention)[0].get_submodule(arch.attention)
    for name in ("head_dim", "key_value_proj_dim", "attention_head_size"):  # T5, BERT
        d_head = getattr(module, name, None)
        if isinstance(d_head, int):
            return d_head
    config = model.config
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _config(model_or_config):
    return getattr(model_or_config, "config", model_or_config)


def blocks(model: nn.Module, attention: str | None = None) -> list[nn.Module]:
    """One block per layer, in order (ALBERT's shared blocks repeat), of the stack that holds
    ``attention`` (see ``architecture``)."""
    arch = architecture(model, attention)
    stack = model.base_model.get_submodule(arch.blocks)
    config = model.config
    if config.model_type == "albert":
        n, groups = config.num_hidden_layers, config.num_hidden_groups
        return [stack[int(i / (n / groups))].albert_layers[0] for i in range(n)]
    return list(stack)
