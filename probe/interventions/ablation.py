"""Head ablation: remove chosen heads' contributions (``ablate``), by zero or by their mean z
over a reference set (``head_means``), on top of ``probe.hooks``."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from numbers import Integral

import torch
from torch import nn

from probe.capture.hookpoints import Hook, hook_points, hooks
from probe.capture.names import Attention, Stack, hook_name, point_of
from probe.capture.spec import describe
from probe.errors import ProbeError

MODES = ("zero", "mean")


def z_points(model: nn.Module, attention: str | None = None) -> tuple[list[str], int]:
    """The ``hook_z`` points of ``model``, one per layer in order, and its number of heads.

    ``attention`` picks one attention of an encoder-decoder model: ``"encoder.attn"`` (the
    default), ``"decoder.attn"`` or ``"decoder.cross_attn"``.
    """
    spec = describe(model) if getattr(model, "config", None) is not None else None
    if attention is not None and not (spec is not None and spec.encoder_decoder):
        raise ProbeError(f"attention={attention!r} is for encoder-decoder models")
    if spec is None:  # probe's own modules: the points their mirror lists
        with hook_points(model) as points:
            names = [name for name in points if point_of(name) == "hook_z"]
        own = [m for m in model.modules() if hasattr(m, "n_heads") and hasattr(m, "W_O")]
        return names, own[0].n_heads
    # named from the description, with no mirror built to list them; an unknown attention: a
    # clear error
    chosen = spec.attention((attention or Attention.ENCODER) if spec.encoder_decoder else None)
    names = [hook_name("hook_z", layer, chosen.name) for layer in range(chosen.n_layers)]
    return names, chosen.n_heads


def check_heads(heads: Iterable, n_layers: int, n_heads: int) -> dict[int, list[int]]:
    """Heads as ``{layer: [head, …]}``, each (layer, head) checked against the model.

    Raises
    ------
    ProbeError
        For an item that is not a (layer, head) pair of integers, or one out of range.
    """
    by_layer: dict[int, list[int]] = defaultdict(list)
    for item in heads:
        try:
            layer, head = (int(i) for i in item)
            if (layer, head) != tuple(item):
                raise TypeError
        except (TypeError, ValueError):
            raise ProbeError(
                f"heads are (layer, head) pairs of integers, 0-based; got {item!r}"
            ) from None
        if not (0 <= layer < n_layers and 0 <= head < n_heads):
            raise ProbeError(
                f"no head ({layer}, {head}): the model has layers 0…{n_layers - 1} and heads "
                f"0…{n_heads - 1} (0-based)"
            )
        if head not in by_layer[layer]:
            by_layer[layer].append(head)
    return dict(by_layer)


class _Stop(Exception):  # noqa: N818 (a signal, not an error)
    """Raised by a hook to end a forward pass whose remaining blocks hold nothing wanted."""


@torch.no_grad()
def head_means(
    model: nn.Module,
    inputs: Iterable[Mapping[str, torch.Tensor]],
    attention: str | None = None,
    layers: Iterable[int] | None = None,
) -> dict[int, torch.Tensor]:
    """Every head's mean z over the real tokens of a reference set, for mean ablation.

    Padding never counts, so the means, and what mean ablation does to a sentence, do not depend
    on how the reference set or the ablated inputs were batched.

    Parameters
    ----------
    model : nn.Module
        A Hugging Face model, a ``probe.MultiHeadAttention`` or a module built from them.
    inputs : iterable of dict
        Keyword arguments of ``model`` per batch (``input_ids``, ``attention_mask``…); real
        tokens are those where ``attention_mask`` is 1 (``decoder_attention_mask`` for a
        decoder's attention; for a ``MultiHeadAttention``, where ``key_padding_mask`` is False;
        every position without either).
    attention : str, optional
        For an encoder-decoder model, which attention (see ``z_points``).
    layers : iterable of int, optional
        The layers whose means are wanted (default: every one). Each forward pass stops after
        the highest: the blocks above it do not run (as TransformerLens's ``stop_at_layer``).

    Returns
    -------
    dict of int to tensor
        Layer to mean z ``[n_heads, d_head]`` (float32), for each layer wanted.
    """
    names, _ = z_points(model, attention)
    wanted = sorted(set(range(len(names)) if layers is None else layers))
    if not wanted or not all(isinstance(k, Integral) and 0 <= k < len(names) for k in wanted):
        raise ProbeError(f"layers are 0-based layers of the model, 0…{len(names) - 1}; "
                         f"got {wanted}")  # fmt: skip
    top = names[wanted[-1]]
    decoder = attention is not None and Attention(attention).stack == Stack.DECODER
    queries = "decoder_attention_mask" if decoder else None
    sums: dict[int, torch.Tensor] = {}
    counts: dict[int, float] = defaultdict(float)
    mask: torch.Tensor | None = None

    def add(z: torch.Tensor, hook: Hook) -> None:  # z: [batch, pos, head, d_head]
        real = torch.ones(z.shape[:2], device=z.device) if mask is None else mask.to(z)
        layer = names.index(hook)
        sums[layer] = sums.get(layer, 0) + torch.einsum("bphd,bp->hd", z.float(), real.float())
        counts[layer] += float(real.sum())
        if hook == top and top != names[-1]:
            raise _Stop

    with hooks(model, {names[layer]: add for layer in wanted}):
        for batch in inputs:
            mask = batch.get(queries or "attention_mask")
            if mask is None and batch.get("key_padding_mask") is not None:  # MultiHeadAttention
                mask = ~batch["key_padding_mask"]
            with suppress(_Stop):
                model(**batch)
    if not sums or not all(counts.values()):
        raise ProbeError("head_means needs at least one batch with a real token")
    return {layer: total / counts[layer] for layer, total in sums.items()}


@contextmanager
def ablate(
    model: nn.Module,
    heads: Iterable[tuple[int, int]],
    mode: str = "zero",
    means: Mapping[int, torch.Tensor] | None = None,
    attention: str | None = None,
) -> Iterator[None]:
    """Ablate heads while the ``with`` block runs, by replacing their ``hook_z``.

    Zero ablation removes head i's term head_i W_i^O from the layer output exactly. Mean
    ablation replaces head i's z by its mean over a reference set (``head_means``), so the
    layer keeps the head's average contribution but loses its dependence on the input.

    Parameters
    ----------
    model : nn.Module
        A Hugging Face model, a ``probe.MultiHeadAttention`` (layer 0) or a module built from
        them (layers in the order of their ``hook_z`` points).
    heads : iterable of (layer, head)
        0-based.
    mode : {"zero", "mean"}
    means : mapping of layer to tensor ``[n_heads, d_head]``
        For mean ablation: ``probe.head_means(model, reference_batches)``.
    attention : str, optional
        For an encoder-decoder model, which attention the heads belong to: ``"encoder.attn"``
        (the default), ``"decoder.attn"`` or ``"decoder.cross_attn"``.

    Raises
    ------
    ProbeError
        For an unknown mode, mean ablation without means, or a head the model does not have.
    """
    if mode not in MODES:
        raise ProbeError(f"mode must be 'zero' or 'mean', not {mode!r}")
    names, n_heads = z_points(model, attention)
    by_layer = check_heads(heads, len(names), n_heads)
    if mode == "mean":
        missing = sorted(set(by_layer) - set(means or {}))
        if missing:
            raise ProbeError(
                f"mean ablation needs the heads' mean z (no means for layer {missing[0]}): "
                "pass means=probe.head_means(model, reference_batches)"
            )

    def replace(layer: int):
        chosen = by_layer[layer]

        def fn(z: torch.Tensor, hook: Hook) -> torch.Tensor:  # z: [batch, pos, head, d_head]
            z = z.clone()
            z[:, :, chosen] = 0 if mode == "zero" else means[layer][chosen].to(z)
            return z

        return fn

    with hooks(model, {names[layer]: replace(layer) for layer in by_layer}):
        yield
