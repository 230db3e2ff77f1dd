"""One description of a model, derived once and read everywhere after (TransformerLens's
``model.cfg``).

``describe(model)`` reads the facts the rest of probe needs (layers, heads, key/value heads,
head widths, which attentions exist, causal or not, encoder-decoder or not, positions) from the
Hugging Face model through ``architectures``, when the model is loaded or first mirrored, and
keeps them with the model; every later call returns the same frozen ``ModelSpec``.
"""

from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

from probe.capture import architectures as arch
from probe.capture.head_weights import iter_head_weights
from probe.capture.names import Attention
from probe.errors import ProbeError


@dataclass(frozen=True)
class AttentionSpec:
    """One attention of a model: an encoder-decoder model has three."""

    name: str
    """Its hook prefix without the layer: ``blocks.attn``, ``encoder.attn``, ``decoder.attn``
    or ``decoder.cross_attn``."""
    n_layers: int
    """Layers of the stack that holds it (ALBERT's shared block counts once per use)."""
    n_heads: int
    """Query heads per layer."""
    n_kv_heads: int
    """Key and value heads per layer: fewer than ``n_heads`` under grouped-query attention."""
    d_head: int
    """The width of each head."""
    rotary: bool
    """Queries and keys are rotated after their projection (``hook_rot_q``, ``hook_rot_k``)."""


@dataclass(frozen=True)
class ModelSpec:
    """What probe knows about a model, derived once by ``describe``."""

    model_type: str
    """The Hugging Face ``model_type`` (``bert``, ``llama``…)."""
    d_model: int
    """The width of the residual stream."""
    d_vocab: int
    """Rows of the input embedding."""
    n_ctx: int | None
    """The longest input its position table takes, special tokens included; None where its
    positions are rotary or relative (no fixed limit)."""
    causal: bool
    """Each token attends only to itself and earlier tokens (an encoder-decoder model's
    decoder does; the model counts as causal only if it is decoder-only)."""
    encoder_decoder: bool
    """The model has an encoder and a decoder, and so three attentions."""
    rows_unsupported: str | None
    """Why its patterns cannot be computed in blocks of query rows beside its sdpa kernel
    (``probe.capture.rows``), or None where they can."""
    attentions: tuple[AttentionSpec, ...]
    """Every attention, the encoder's first."""

    @property
    def n_layers(self) -> int:
        """Layers of the first attention's stack (an encoder-decoder model's encoder)."""
        return self.attentions[0].n_layers

    @property
    def n_heads(self) -> int:
        """Query heads per layer of the first attention."""
        return self.attentions[0].n_heads

    def attention(self, name: str | None = None) -> AttentionSpec:
        """One attention by name (default: the first).

        Raises
        ------
        ProbeError
            For an attention the model does not have, naming those it has.
        """
        if name is None:
            return self.attentions[0]
        for attention in self.attentions:
            if attention.name == str(name):
                return attention
        have = ", ".join(a.name for a in self.attentions)
        raise ProbeError(f"the model has no attention {name!r}; it has {have}")

    def as_dict(self) -> dict[str, Any]:
        """The description as ``run.json`` holds it."""
        return asdict(self)


_DESCRIBED: weakref.WeakKeyDictionary[nn.Module, ModelSpec] = weakref.WeakKeyDictionary()


def describe(model: nn.Module) -> ModelSpec:
    """The model's description: derived on the first call for this model, then the same one.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A supported architecture (``probe.capture.architectures.SUPPORTED``).

    Raises
    ------
    ProbeError
        For a module that is no Hugging Face model, or an architecture probe does not support.
    """
    base = getattr(model, "base_model", model)  # a language model and its base: one model
    found = _DESCRIBED.get(base)
    if found is None:
        found = _DESCRIBED[base] = _derive(model)
    return found


def _derive(model: nn.Module) -> ModelSpec:
    config = getattr(model, "config", None)
    if config is None:
        raise ProbeError(f"{type(model).__name__} is no Hugging Face model (it has no config); "
                         "give a model from probe.load or transformers")  # fmt: skip
    attentions = tuple(_attention(model, Attention(name)) for name in arch.attentions(model))
    return ModelSpec(
        model_type=config.model_type,
        d_model=int(config.hidden_size),
        d_vocab=int(model.get_input_embeddings().weight.shape[0]),
        n_ctx=arch.max_positions(config),
        causal=arch.is_causal(config),
        encoder_decoder=arch.is_encoder_decoder(config),
        rows_unsupported=_rows_unsupported(config),
        attentions=attentions,
    )


def _attention(model: nn.Module, name: Attention) -> AttentionSpec:
    first = next(iter_head_weights(model, name))  # layer 0's, split into heads
    heads, kv_heads = first.W_Q.shape[0], first.W_K.shape[0]
    if kv_heads < 1 or heads % kv_heads:
        raise arch.UnsupportedModelError(
            f"its {heads} query heads do not divide among its {kv_heads} key/value heads "
            "(grouped-query attention shares each key/value head among as many query heads): "
            "the checkpoint's config.json and weights do not describe a model that can run"
        )
    return AttentionSpec(
        name=str(name),
        n_layers=len(arch.blocks(model, name)),
        n_heads=first.W_Q.shape[0],
        n_kv_heads=first.W_K.shape[0],
        d_head=first.W_Q.shape[-1],
        rotary=arch.architecture(model, name).rotary,
    )


def _rows_unsupported(config) -> str | None:
    if arch.is_encoder_decoder(config):
        return "an encoder-decoder model's three attentions are read whole"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "sdpa cannot soft-cap the scores (Gemma 2)"
    if getattr(config, "model_type", "") in ("t5", "mt5"):
        return "T5's position bias is read whole"
    return None
