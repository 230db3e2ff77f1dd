"""Where each supported Hugging Face architecture keeps its attention, and how its weights split
into heads. The one place to add an architecture."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, fields, replace

import torch
from torch import nn

from probe.capture.names import Attention
from probe.errors import ProbeError


@dataclass(frozen=True)
class Architecture:
    """Where one architecture keeps its attention.

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
    "encoder.layer",
    "attention.self",
    "attention.self.query",
    "attention.self.key",
    "attention.self.value",
    "attention.output.dense",
    mlp="output.dense",
    ln1="attention.output.LayerNorm",
    ln2="output.LayerNorm",
    mlp_pre="intermediate.dense",
    mlp_post="output.dense",
    post_ln=True,
)
_LLAMA = Architecture(
    "layers",
    "self_attn",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    mlp="mlp",
    rotary=True,
    ln1="input_layernorm",
    ln2="post_attention_layernorm",
    mlp_pre="mlp.gate_proj",
    mlp_pre_linear="mlp.up_proj",
    mlp_post="mlp.down_proj",
)
# Gemma normalises the attention's and the MLP's outputs before adding them to the stream.
_GEMMA = replace(
    _LLAMA,
    attn_out="post_attention_layernorm",
    mlp="post_feedforward_layernorm",
    ln2="pre_feedforward_layernorm",
    ln1_post="post_attention_layernorm",
    ln2_post="post_feedforward_layernorm",
)

ARCHITECTURES: dict[str, Architecture] = {
    "bert": _BERT,
    "roberta": _BERT,
    "electra": _BERT,
    "distilbert": Architecture(
        "transformer.layer",
        "attention",
        "attention.q_lin",
        "attention.k_lin",
        "attention.v_lin",
        "attention.out_lin",
        mlp="ffn",
        ln1="sa_layer_norm", ln2="output_layer_norm", mlp_pre="ffn.lin1", mlp_post="ffn.lin2",
        post_ln=True,
    ),
    "albert": Architecture(
        "encoder.albert_layer_groups",
        "attention",
        "attention.query",
        "attention.key",
        "attention.value",
        "attention.dense",
        mlp="ffn_output",
        ln1="attention.LayerNorm", ln2="full_layer_layer_norm", mlp_pre="ffn",
        mlp_post="ffn_output", post_ln=True,
    ),
    "gpt2": Architecture(
        "h", "attn", o="attn.c_proj", qkv="attn.c_attn", fused="gpt2", mlp="mlp", ln1="ln_1",
        ln2="ln_2", mlp_pre="mlp.c_fc", mlp_post="mlp.c_proj",
    ),
    "gpt_neox": Architecture(
        "layers",
        "attention",
        o="attention.dense",
        qkv="attention.query_key_value",
        fused="neox",
        mlp="mlp",
        rotary=True,
        ln1="input_layernorm", ln2="post_attention_layernorm", mlp_pre="mlp.dense_h_to_4h",
        mlp_post="mlp.dense_4h_to_h",
    ),
    "opt": Architecture(
        "decoder.layers",
        "self_attn",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.out_proj",
        mlp="fc2",
        ln1="self_attn_layer_norm", ln2="final_layer_norm", mlp_pre="fc1", mlp_post="fc2",
        q_scaled=True,
    ),
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    # Query and key RMSNorms sit between the projections and the rotary embedding: hook_q and
    # hook_k are before both (as TransformerLens's), hook_rot_q and hook_rot_k after both.
    "qwen3": replace(_LLAMA, q_norm="self_attn.q_norm", k_norm="self_attn.k_norm"),
    # Logit soft-capping and sliding windows happen in the attention function (probe's too).
    "gemma2": _GEMMA,
    "gemma3_text": replace(
        _GEMMA, q_norm="self_attn.q_norm", k_norm="self_attn.k_norm", qk_norm_heads_first=True
    ),
    "phi3": Architecture(
        "layers", "self_attn", o="self_attn.o_proj", qkv="self_attn.qkv_proj", fused="linear",
        mlp="mlp", rotary=True, ln1="input_layernorm", ln2="post_attention_layernorm",
        mlp_pre_fused="mlp.gate_up_proj", mlp_post="mlp.down_proj",
    ),
    # Local (sliding-window) and global layers alternate; the mask tells them apart.
    "modernbert": Architecture(
        "layers", "attn", o="attn.Wo", qkv="attn.Wqkv", fused="linear", mlp="mlp", rotary=True,
        ln1="attn_norm", ln2="mlp_norm", mlp_pre_fused="mlp.Wi", mlp_post="mlp.Wo",
    ),
}  # fmt: skip

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
ENCODER_DECODER: dict[str, dict[Attention, Architecture]] = {
    "bart": _BART,
    "mbart": _MBART,
    "marian": _BART,
    "t5": _T5,  # and Flan-T5: relative position bias, no 1/√d_head scaling
}  # fmt: skip

# The model's own modules (paths from its base model, else from the model: an LM head's norm):
# the token and position embeddings, the embeddings' norm and the final norm, by the name of
# their points (an encoder-decoder model's hook_embed and hook_pos_embed are the encoder's).
_BERT_MODEL = {
    "embed": "embeddings.word_embeddings", "pos_embed": "embeddings.position_embeddings",
    "embed_ln": "embeddings.LayerNorm",
}  # fmt: skip
_BART_MODEL = {
    "embed": "encoder.embed_tokens", "pos_embed": "encoder.embed_positions",
    "embed_ln": "encoder.layernorm_embedding", "decoder_embed_ln": "decoder.layernorm_embedding",
}  # fmt: skip
_DECODER_MODEL = {"embed": "embed_tokens", "ln_final": "norm"}
MODEL_PARTS: dict[str, dict[str, str]] = {
    "bert": _BERT_MODEL | {"ln_final": "cls.predictions.transform.LayerNorm"},
    "roberta": _BERT_MODEL | {"ln_final": "lm_head.layer_norm"},
    "electra": _BERT_MODEL,
    "albert": _BERT_MODEL,
    "distilbert": _BERT_MODEL | {"ln_final": "vocab_layer_norm"},
    "bart": _BART_MODEL,
    "mbart": _BART_MODEL | {
        "encoder_ln_final": "encoder.layer_norm", "decoder_ln_final": "decoder.layer_norm",
    },
    "marian": {"embed": "encoder.embed_tokens", "pos_embed": "encoder.embed_positions"},
    "t5": {  # its positions are a learned bias per head and relative distance (bucketed)
        "embed": "encoder.embed_tokens",
        "pos_embed": "encoder.block.0.layer.0.SelfAttention.relative_attention_bias",
        "encoder_ln_final": "encoder.final_layer_norm",
        "decoder_ln_final": "decoder.final_layer_norm",
    },
    "gpt2": {"embed": "wte", "pos_embed": "wpe", "ln_final": "ln_f"},
    "gpt_neox": {"embed": "embed_in", "ln_final": "final_layer_norm"},
    "opt": {
        "embed": "decoder.embed_tokens", "pos_embed": "decoder.embed_positions",
        "ln_final": "decoder.final_layer_norm",
    },
    "modernbert": {
        "embed": "embeddings.tok_embeddings", "embed_ln": "embeddings.norm",
        "ln_final": "final_norm",
    },
}  # fmt: skip
for _kind in ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"):
    MODEL_PARTS[_kind] = _DECODER_MODEL


def model_part(model: nn.Module, part: str) -> nn.Module | None:
    """The model's module ``part`` (``"embed"``, ``"pos_embed"``, ``"ln_final"``; see
    ``MODEL_PARTS``), or None where the model has none (a base model without its LM head)."""
    path = MODEL_PARTS.get(model.config.model_type, {}).get(part)
    for root in (model.base_model, model):
        if path:
            try:
                return root.get_submodule(path)
            except AttributeError:
                continue
    return None


SUPPORTED = ", ".join(sorted([*ARCHITECTURES, *ENCODER_DECODER]))
CAUSAL = {
    "gpt2", "gpt_neox", "opt", "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text",
    "phi3",
}  # fmt: skip


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
    if kind in ENCODER_DECODER:
        return ENCODER_DECODER[kind]
    if kind not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {kind!r} is not supported (its attention is not mirrored by probe); "
            f"supported: {SUPPORTED}"
        )
    if kind == "albert" and config.inner_group_num != 1:
        raise UnsupportedModelError("ALBERT with inner_group_num > 1 is not supported")
    return {Attention.BLOCKS: ARCHITECTURES[kind]}


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


def is_encoder_decoder(model) -> bool:
    """Whether the model (or its config) is a supported encoder-decoder model, whose attentions
    are ``encoder.attn``, ``decoder.attn`` and ``decoder.cross_attn``."""
    return _config(model).model_type in ENCODER_DECODER


def is_causal(model) -> bool:
    """Whether each token of the model (or of a model with this config) attends only to itself
    and earlier tokens (an encoder-decoder model's encoder does not)."""
    config = _config(model)
    return config.model_type in CAUSAL or bool(getattr(config, "is_decoder", False))


def is_rotary(model: nn.Module, attention: str | None = None) -> bool:
    """Whether one attention (see ``architecture``) rotates its queries and keys: then its
    ``hook_q`` and ``hook_k`` are before the rotation and ``hook_rot_q`` and ``hook_rot_k``
    after it."""
    return architecture(model, attention).rotary


# Architectures whose positions are a learned (or fixed) table of ``max_position_embeddings``
# rows, which an input longer than that runs past: tokens each table leaves to padding (RoBERTa
# counts from its padding index + 1). Rotary and relative positions have no such limit.
POSITION_TABLES = {"bert": 0, "roberta": 2, "distilbert": 0, "electra": 0, "albert": 0, "gpt2": 0,
                   "opt": 0, "bart": 0, "mbart": 0, "marian": 0}  # fmt: skip


def max_positions(model) -> int | None:
    """The longest input the model (or a model with this config) takes, special tokens included:
    the rows of its position table; None where its positions are rotary or relative."""
    config = _config(model)
    if getattr(config, "model_type", None) not in POSITION_TABLES:
        return None
    return int(config.max_position_embeddings) - POSITION_TABLES[config.model_type]


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
