"""Head ablation: remove chosen heads' contributions, on top of ``probe.hooks``."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from probe.capture.hookpoints import Hook, hook_points, hooks, trace
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
    if spec is not None and spec.encoder_decoder:
        chosen = spec.attention(attention or Attention.ENCODER)  # an unknown one: a clear error
        layers = range(chosen.n_layers)
        names = [hook_name("hook_z", layer, chosen.name) for layer in layers]
        return names, chosen.n_heads
    if attention is not None:
        raise ProbeError(f"attention={attention!r} is for encoder-decoder models")
    with hook_points(model) as points:
        names = [name for name in points if point_of(name) == "hook_z"]
    own = [m for m in model.modules() if hasattr(m, "n_heads") and hasattr(m, "W_O")]
    n_heads = own[0].n_heads if own else spec.n_heads
    return names, n_heads


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


@torch.no_grad()
def head_means(
    model: nn.Module,
    inputs: Iterable[Mapping[str, torch.Tensor]],
    attention: str | None = None,
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

    Returns
    -------
    dict of int to tensor
        Layer to mean z ``[n_heads, d_head]`` (float32).
    """
    names, _ = z_points(model, attention)
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

    with hooks(model, dict.fromkeys(names, add)):
        for batch in inputs:
            mask = batch.get(queries or "attention_mask")
            if mask is None and batch.get("key_padding_mask") is not None:  # MultiHeadAttention
                mask = ~batch["key_padding_mask"]
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


Readout = Callable[[Any, Mapping[str, torch.Tensor]], torch.Tensor]
Change = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@torch.no_grad()
def ablation_effects(
    model: nn.Module,
    inputs: Mapping[str, torch.Tensor],
    heads: Sequence[tuple[int, int]],
    readout: Readout,
    change: Change,
    *,
    mode: str = "mean",
    means: Mapping[int, torch.Tensor] | None = None,
    max_rows: int = 256,
) -> torch.Tensor:
    """Each head's effect, ablated alone, on the model's output at every position of a batch.

    The heads' ablated copies of the batch run stacked along the batch dimension, as many of one
    layer's heads as fit in ``max_rows`` rows a forward pass (at least one): copy c ablates its
    head alone, by its mean z (``head_means``) or by zero. The layers below run once, on the
    batch's own rows, which are copied at the layer's block (where the model's blocks are modules
    of their own; ALBERT's shared one is copied from the start). Each copy's rows are the batch's
    own, so its effect is the same whatever else shares the pass.

    Parameters
    ----------
    model : nn.Module
        A Hugging Face model (or a module built from ``probe.MultiHeadAttention``).
    inputs : dict
        Keyword arguments of ``model`` for one batch, ``[batch, pos]`` each.
    heads : sequence of (layer, head)
        0-based; the effect of each is returned in this order.
    readout : callable
        ``readout(output, inputs)``: what is compared, ``[rows, pos, k]``, from the model's
        output on ``inputs`` (the stacked rows' own inputs), e.g. ``hidden_state`` or
        ``next_token_loss``.
    change : callable
        ``change(ablated, intact)``: ``[copies, batch, pos, k]`` against ``[batch, pos, k]`` gives
        ``[copies, batch, pos]``, e.g. ``relative_change`` or ``difference``.
    mode : {"mean", "zero", "resample"}
        Resample: each input's z of the head is the one it had on the next input of the batch
        (the last input's, the first's), and its mean where that input has padding.
    means : mapping of layer to tensor ``[n_heads, d_head]``
        For mean and resample ablation: ``head_means(model, reference_batches)``.
    max_rows : int
        At most this many rows (copies × batch) in one forward pass.

    Returns
    -------
    torch.Tensor
        ``[len(heads), batch, pos]`` float32: the change at each position with each head
        ablated (what ``change`` gives at padding is left as it is).

    Raises
    ------
    ProbeError
        For an unknown mode, mean ablation without means, or a head the model lacks.
    """
    if mode not in (*MODES, "resample"):
        raise ProbeError(f"mode must be 'zero', 'mean' or 'resample', not {mode!r}")
    names, n_heads = z_points(model)
    by_layer = check_heads(heads, len(names), n_heads)
    if mode in ("mean", "resample"):
        missing = sorted(set(by_layer) - set(means or {}))
        if missing:
            raise ProbeError(
                f"{mode} ablation needs the heads' mean z (no means for layer {missing[0]}): "
                "pass means=probe.head_means(model, reference_batches)"
            )
    rows = next(iter(inputs.values())).shape[0]
    if mode == "resample":
        if rows < 2:
            raise ProbeError("resample ablation needs a batch of at least 2 inputs")
        wanted = [names[layer] for layer in by_layer]
        with trace(model, wanted) as cache:
            intact = readout(model(**inputs), inputs).float()
        means = _resampled(cache, names, by_layer, means, inputs.get("attention_mask"))
    else:
        intact = readout(model(**inputs), inputs).float()
    copies = max(1, max_rows // rows)
    stack = _blocks(model, len(names))
    # Chunks of one layer's heads each (where the rows are copied from that layer on).
    by_layer: dict[int, list[int]] = defaultdict(list)
    for i, (layer, _) in enumerate(heads):
        by_layer[int(layer) if stack is not None else 0].append(i)
    chunks = [own[s : s + copies] for _, own in sorted(by_layer.items())
              for s in range(0, len(own), copies)]  # fmt: skip
    effects = torch.zeros(len(heads), *intact.shape[:2], device=intact.device)
    for chosen in chunks:
        chunk = [tuple(int(i) for i in heads[i]) for i in chosen]
        stacked = _stacked(inputs, len(chunk), rows)
        todo: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for copy, (layer, head) in enumerate(chunk):
            todo[layer].append((copy, head))
        fns = {names[layer]: _ablate_copies(layer, done, rows, mode, means)
               for layer, done in todo.items()}  # fmt: skip
        # The layers below the chunk's lowest run once on the batch's own rows; from that one
        # on, the rows are copied (where the model's blocks are its own modules).
        first = min(todo) if stack is not None else None
        with hooks(model, fns), _copied_from(stack, first, len(chunk), rows):
            ablated = readout(model(**(stacked if first is None else inputs)), stacked).float()
        ablated = ablated.reshape(len(chunk), rows, *ablated.shape[1:])
        effects[chosen] = change(ablated, intact).float()
    return effects


def _stacked(inputs: Mapping[str, Any], copies: int, rows: int) -> dict[str, Any]:
    """``inputs`` repeated ``copies`` times along the batch: copy c is rows c·rows…(c+1)·rows."""
    return {key: _repeat(value, copies, rows) for key, value in inputs.items()}


def _repeat(value: Any, copies: int, rows: int) -> Any:
    """A tensor of ``rows`` rows (or a tuple of them) repeated ``copies`` times along dim 0."""
    if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows:
        return value.repeat(copies, *(1,) * (value.dim() - 1))
    if isinstance(value, tuple):
        return tuple(_repeat(v, copies, rows) for v in value)
    return value


def _blocks(model: nn.Module, n_layers: int) -> list[nn.Module] | None:
    """The model's blocks, one per layer, where each is a module of its own (not ALBERT's shared
    one) and there is one per ``hook_z`` point; else None (the copies then run from the start)."""
    from probe.capture.architectures import blocks

    try:
        found = blocks(model)
    except Exception:  # a module probe describes by its hook points only
        return None
    if len(found) != n_layers or len({id(b) for b in found}) != len(found):
        return None
    return found


@contextmanager
def _copied_from(stack: list[nn.Module] | None, first: int | None, copies: int, rows: int):
    """While the block runs, the inputs of block ``first`` and of every later block (its hidden
    states, mask, position embeddings: whatever has the batch's ``rows`` rows) repeated
    ``copies`` times along the batch; nothing where ``first`` is None."""
    if first is None or stack is None or copies == 1:
        yield
        return

    def copy(module, args, kwargs):
        return _repeat(tuple(args), copies, rows), {
            key: _repeat(value, copies, rows) for key, value in kwargs.items()
        }

    handles = [b.register_forward_pre_hook(copy, with_kwargs=True) for b in stack[first:]]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _ablate_copies(layer: int, todo, rows: int, mode: str, means):
    """A ``hook_z`` function that ablates, in copy c of a stacked batch, head h, for each
    (c, h) of ``todo``: by zero, its mean ``means[layer][h]`` ``[d_head]``, or (resample) the
    z it had on another input, ``means[layer][:, :, h]`` ``[batch, pos, d_head]``."""

    def fn(z: torch.Tensor, hook: Hook) -> torch.Tensor:  # z: [copies·batch, pos, head, d_head]
        z = z.clone()
        for copy, head in todo:
            rows_of = slice(copy * rows, (copy + 1) * rows)
            if mode == "zero":
                z[rows_of, :, head] = 0
            elif mode == "mean":
                z[rows_of, :, head] = means[layer][head].to(z)
            else:
                z[rows_of, :, head] = means[layer][:, :, head].to(z)
        return z

    return fn


def _resampled(cache, names, by_layer, means, mask) -> dict[int, torch.Tensor]:
    """Per layer, each input's z taken from the next input of the batch (the last from the
    first) ``[batch, pos, head, d_head]``; where that input has padding, the head's mean z."""
    out = {}
    for layer in by_layer:
        z = cache[names[layer]].float()
        source = z.roll(-1, dims=0)
        if mask is not None:
            real = mask.roll(-1, dims=0).bool()[:, :, None, None].to(z.device)
            source = torch.where(real, source, means[layer].to(z)[None, None])
        out[layer] = source
    return out


def hidden_state(output: Any, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The last hidden state ``[rows, pos, d_model]`` (a ``readout`` for ``ablation_effects``)."""
    states = getattr(output, "last_hidden_state", None)
    if states is None:
        states = output.hidden_states[-1] if getattr(output, "hidden_states", None) else output[0]
    return states.float()


def next_token_loss(output: Any, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """−log p(token t+1) read at position t, ``[rows, pos, 1]`` (a ``readout`` for
    ``ablation_effects``); the last position, which predicts nothing here, holds NaN."""
    logp = output.logits.float().log_softmax(-1)
    ids = inputs["input_ids"]
    loss = torch.full(ids.shape, float("nan"), device=logp.device)
    loss[:, :-1] = -logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    return loss[..., None]


def relative_change(ablated: torch.Tensor, intact: torch.Tensor) -> torch.Tensor:
    """‖h′ − h‖₂ / ‖h‖₂ over the last dimension (a ``change`` for ``ablation_effects``)."""
    return (ablated - intact).norm(dim=-1) / intact.norm(dim=-1).clamp(min=1e-12)


def difference(ablated: torch.Tensor, intact: torch.Tensor) -> torch.Tensor:
    """ablated − intact of a one-value readout (a ``change`` for ``ablation_effects``): the
    rise of the loss, with ``next_token_loss``."""
    return (ablated - intact)[..., 0]
