"""Each head's effect ablated alone, many heads in one forward pass: a row per (head, input)
pair, appended at its head's layer as a copy of its input's row there (or of a row ablating the
same heads below), so that the layers below run once (``ablation_effects``), and the readouts
and changes it compares (``hidden_state``, ``next_token_loss``, ``relative_change``,
``difference``). On top of ``ablation``."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from probe.capture.hookpoints import Hook, hooks
from probe.capture.spec import describe
from probe.errors import ProbeError
from probe.interventions.ablation import MODES, check_heads, z_points

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
    needed: torch.Tensor | None = None,
    read: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each head's effect, ablated alone (or each group's, ablated together), on the model's
    output at every position of a batch.

    One forward pass holds the batch's own rows and, after them, a row per (head, input) pair
    that ``needed`` asks for: the input with that head ablated alone, by its mean z
    (``head_means``), by zero, or by another input's z. The layers below a row's head run once,
    on the batch's own rows: the row is appended at its layer's block, a copy of its input's
    row there (where the model's blocks are modules of their own; ALBERT's shared one runs
    every row from the start). A group's row starts higher where another row of its input
    ablates the same heads below (its subset without its highest layer's heads, say): it is
    appended as a copy of that row at the first block where they differ. A pass holds at most
    ``max_rows`` rows (more passes where the pairs need them). A row is its input's own, so its
    effect is the same whatever else shares the pass.

    Parameters
    ----------
    model : nn.Module
        A Hugging Face model (or a module built from ``probe.MultiHeadAttention``).
    inputs : dict
        Keyword arguments of ``model`` for one batch, ``[batch, pos]`` each.
    heads : sequence of (layer, head), or of groups of them
        0-based; the effect of each is returned in this order. An item that is a sequence of
        (layer, head) pairs is a group: its heads ablated together in one row (the row appended
        at its lowest layer's block).
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
        At most this many rows in one forward pass.
    needed : torch.Tensor, optional
        ``[len(heads), batch]`` bool: the pairs to run (default: every head on every input).
    read : torch.Tensor, optional
        ``[batch, pos]`` bool: the positions whose change is wanted (default: every real one).
        Of a model whose output is its last block's, position by position (not an
        encoder-decoder model's), every block's MLP computes only the real tokens (which every
        later attention masks out as keys), and the last block's only these (``_mlp_at``).

    Returns
    -------
    torch.Tensor
        ``[len(heads), batch, pos]`` float32: the change at each position with each head
        ablated; NaN for the pairs not ``needed``, the positions not ``read`` and padding.

    Raises
    ------
    ProbeError
        For an unknown mode, mean ablation without means, a head the model lacks, or a
        ``needed`` of the wrong shape.
    """
    if mode not in (*MODES, "resample"):
        raise ProbeError(f"mode must be 'zero', 'mean' or 'resample', not {mode!r}")
    names, n_heads = z_points(model)
    members = [_members(item) for item in heads]
    by_layer = check_heads([h for m in members for h in m], len(names), n_heads)
    if mode in ("mean", "resample"):
        missing = sorted(set(by_layer) - set(means or {}))
        if missing:
            raise ProbeError(
                f"{mode} ablation needs the heads' mean z (no means for layer {missing[0]}): "
                "pass means=probe.head_means(model, reference_batches)"
            )
    rows = next(iter(inputs.values())).shape[0]
    if needed is None:
        needed = torch.ones(len(heads), rows, dtype=torch.bool)
    if tuple(needed.shape) != (len(heads), rows):
        raise ProbeError(f"needed must be [heads, batch] = [{len(heads)}, {rows}], "
                         f"not {list(needed.shape)}")  # fmt: skip
    width = next(iter(inputs.values())).shape[1]
    if read is not None and tuple(read.shape) != (rows, width):
        raise ProbeError(f"read must be [batch, pos] = [{rows}, {width}], "
                         f"not {list(read.shape)}")  # fmt: skip
    if mode == "resample" and rows < 2:
        raise ProbeError("resample ablation needs a batch of at least 2 inputs")
    stack = _blocks(model, len(names))
    mask = inputs.get("attention_mask")
    effects = None
    for chunk in _chunks(members, needed.bool().cpu(), max(1, max_rows - rows)):
        # each (item, input) pair a row after the batch's own, appended at a block as a copy of
        # a row that agrees with it below, and ablating its heads from that block up
        chunk = _branched(members, chunk, rows, len(names) if stack is not None else 0)
        index = torch.tensor([b for _, b, _, _ in chunk], dtype=torch.long)
        layer_of = [start for _, _, start, _ in chunk]
        source = torch.tensor([copied for *_, copied in chunk], dtype=torch.long)
        every = torch.cat([torch.arange(rows), index])  # the input of each row of the pass
        fns = {names[layer]: _ablate_rows(layer, done, every, rows, mode, means, mask)
               for layer, done in _ablated_at(members, chunk, rows).items()}  # fmt: skip
        gathered = _gathered(inputs, every, rows)
        tokens = None if read is None else read.bool()[every.to(read.device)]
        wanted = _wanted(stack, mask, every, rows, layer_of, tokens)
        with (
            hooks(model, fns),
            _appended(stack, rows, index, source, layer_of),
            _mlp_at(model, stack, wanted),
        ):
            out = readout(model(**(inputs if stack is not None else gathered)), gathered).float()
        intact, ablated = out[:rows], out[rows:]
        if effects is None:
            effects = torch.full((len(heads), *intact.shape[:2]), torch.nan, device=out.device)
        found = change(ablated[None], intact[index.to(out.device)])[0].float()
        kept = wanted[-1] if wanted and wanted[-1] is not None else tokens
        if kept is not None:  # padding, and the tokens not read: their MLPs did not run
            found = found.masked_fill(~kept[rows:].to(found.device), torch.nan)
        effects[[i for i, *_ in chunk], index.to(out.device)] = found
    if effects is None:  # nothing needed: NaN everywhere, of the readout's shape
        out = readout(model(**inputs), inputs)
        effects = torch.full((len(heads), *out.shape[:2]), torch.nan, device=out.device)
    return effects


def _members(item) -> list[tuple[int, int]]:
    """An item of ``ablation_effects``'s heads as its heads, sorted: a (layer, head) pair alone,
    or each (layer, head) of a group ablated together (left as given where it is neither, for
    ``check_heads`` to refuse in one line)."""
    try:
        if all(isinstance(h, tuple | list) for h in item) and len(item):
            return sorted({(int(layer), int(head)) for layer, head in item})
        layer, head = item
        return [(int(layer), int(head))] if (int(layer), int(head)) == tuple(item) else [item]
    except (TypeError, ValueError):
        return [item]


def _chunks(members: list, needed: torch.Tensor, max_rows: int) -> list[list]:
    """The ``needed`` (item index, input) pairs by their item's lowest layer, in chunks of at
    most ``max_rows``."""
    pairs = [(members[i][0][0], i, int(b)) for i in range(len(members))
             for b in torch.nonzero(needed[i]).flatten().tolist()]  # fmt: skip
    pairs = [(i, b) for _, i, b in sorted(pairs)]
    return [pairs[s : s + max_rows] for s in range(0, len(pairs), max_rows)]


def _branched(members: list, chunk: list, rows: int, n_layers: int) -> list:
    """A chunk's (item index, input) pairs as the rows of its pass, by the block each is
    appended at: (item index, input, block, the row of the pass it copies there). A row starts
    at the highest block below which another row of its input, appended lower, ablates the same
    heads (the item without its highest layer's heads, say, for a group's subsets), as a copy of
    that row; else at its lowest layer's block as a copy of its input's own row (``rows`` rows
    come first). So no layer runs twice on the same hidden states. With ``n_layers`` 0 (no
    blocks of their own) every row starts at its lowest layer, from the model's input."""
    start, source = {}, {}
    order = sorted(range(len(chunk)), key=lambda j: (chunk[j][1], members[chunk[j][0]]))
    earlier: dict[int, list[int]] = defaultdict(list)  # input -> its rows placed so far
    for j in order:
        i, b = chunk[j]
        start[j], source[j] = members[i][0][0], None
        # an item whose heads are all in one layer parts from every other row there at once
        spans = members[i][-1][0] > members[i][0][0]
        for r in earlier[b] if n_layers and spans else ():
            below = _agree_below(members[chunk[r][0]], members[i], n_layers)
            if start[r] < below < n_layers and below > start[j]:
                start[j], source[j] = below, r
        earlier[b].append(j)
    placed = sorted(range(len(chunk)), key=start.__getitem__)  # stable: the chunk's order
    position = {j: rows + k for k, j in enumerate(placed)}
    return [(*chunk[j], start[j], chunk[j][1] if source[j] is None else position[source[j]])
            for j in placed]  # fmt: skip


def _ablated_at(members: list, chunk: list, rows: int) -> dict[int, list[tuple[int, int]]]:
    """Per layer, the (row of the pass, head) pairs ablated there: each of ``_branched``'s
    rows (after the batch's ``rows``) ablates its item's heads from the block it starts at."""
    todo: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for row, (i, _, start, _) in enumerate(chunk):
        for layer, head in members[i]:
            if layer >= start:
                todo[layer].append((rows + row, head))
    return todo


def _agree_below(one: list, other: list, n_layers: int) -> int:
    """The lowest layer at which two items ablate different heads (``n_layers`` where none)."""
    layers = sorted({layer for layer, _ in one} | {layer for layer, _ in other})
    for layer in layers:
        if {h for k, h in one if k == layer} != {h for k, h in other if k == layer}:
            return layer
    return n_layers


def _gathered(inputs: Mapping[str, Any], index: torch.Tensor, rows: int) -> dict[str, Any]:
    """``inputs``' rows ``index`` (row r of the result is input ``index[r]``)."""
    return {key: _gather(value, index, rows) for key, value in inputs.items()}


def _gather(value: Any, index: torch.Tensor, rows: int) -> Any:
    """A tensor of ``rows`` rows (or a tuple of them) at rows ``index`` along dim 0."""
    if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows:
        return value[index.to(value.device)]
    if isinstance(value, tuple):
        return tuple(_gather(v, index, rows) for v in value)
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
def _appended(stack: list[nn.Module] | None, rows: int, index: torch.Tensor,
              source: torch.Tensor, layer_of: list[int]):  # fmt: skip
    """While the block runs, at the input of block l, the rows of layer l (``index``'s inputs
    where ``layer_of`` is l) appended to its hidden states, copies of the rows of the pass
    ``source`` names there (the batch's own, or rows appended below); every block's other
    inputs (mask, position embeddings: whatever has the batch's ``rows`` rows, made once by the
    model) gathered for all the rows so far. The blocks below the lowest
    layer run on the batch's own rows alone. Nothing where ``stack`` is None (every row then
    runs from the model's input). The hooks run before any other pre-hook: the mirror's reads
    the rows."""
    if stack is None:
        yield
        return
    counts = torch.bincount(torch.tensor(layer_of), minlength=len(stack))
    ends = rows + torch.cumsum(counts, 0)  # block l's rows: its hidden states' after appending
    every = torch.cat([torch.arange(rows), index])

    def grow(layer: int):
        def hook(module, args, kwargs):
            new = source[int(ends[layer] - rows) - int(counts[layer]) : int(ends[layer] - rows)]
            hidden = args[0] if args else kwargs["hidden_states"]
            if len(new):
                hidden = torch.cat([hidden, hidden[new.to(hidden.device)]])
            upto = every[: int(ends[layer])]
            args = tuple(hidden if i == 0 else _gather(a, upto, rows) for i, a in enumerate(args))
            kwargs = {key: hidden if key == "hidden_states" else _gather(value, upto, rows)
                      for key, value in kwargs.items()}  # fmt: skip
            return args, kwargs

        return hook

    first = min(layer_of)
    handles = [block.register_forward_pre_hook(grow(layer), with_kwargs=True, prepend=True)
               for layer, block in enumerate(stack) if layer >= first]  # fmt: skip
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _wanted(stack, mask, every: torch.Tensor, rows: int, layer_of: list[int], tokens):
    """Per block, the tokens its MLP computes (``_mlp_at``): the real ones of the rows there
    (the batch's own and those appended so far, ``_appended``), and in the last block those
    read (``tokens``) where some are; None for every one."""
    if stack is None:
        return []
    ends = rows + torch.cumsum(torch.bincount(torch.tensor(layer_of), minlength=len(stack)), 0)
    real = None if mask is None else mask.bool()[every.to(mask.device)]  # [rows of the pass, pos]
    wanted = [None if real is None else real[: int(end)] for end in ends]
    if tokens is not None:
        wanted[-1] = tokens if real is None else tokens & real
    return wanted


@contextmanager
def _mlp_at(model: nn.Module, stack: list[nn.Module] | None, wanted: list[torch.Tensor | None]):
    """While the pass runs, each block's MLP computes only the tokens ``wanted[block]`` names
    (``[rows at that block, pos]`` bool; None: every one), and gives 0 at the others, whose
    values nothing reads: a padding token, which every later attention masks out as a key, or
    in the last block a token not read, past which a model that is not an encoder-decoder has
    only position-wise parts (a final norm, an unembedding). Every token wanted is what it was
    (to float rounding: fewer rows in the MLP's products), and the MLP is two thirds of a
    block's products. Nothing where the model's MLP is not named (``probe.capture.
    architectures``: its input projections, each of whose outputs feeds only the output
    projection) or ``stack`` is None."""
    from probe.capture.architectures import architecture

    if stack is None or describe(model).encoder_decoder or all(w is None for w in wanted):
        yield
        return
    try:
        arch = architecture(model)
    except (ProbeError, AttributeError):  # a module probe describes by its hook points only
        yield
        return
    handles = []
    names = [name for name in (arch.mlp_pre, arch.mlp_pre_linear, arch.mlp_pre_fused) if name]
    try:
        for block, tokens in zip(stack, wanted, strict=True):
            if tokens is None or bool(tokens.all()):
                continue
            try:
                inputs = [block.get_submodule(name) for name in names]
                output = block.get_submodule(arch.mlp_post) if inputs and arch.mlp_post else None
            except AttributeError:
                continue
            if output is not None:
                select, scatter = _cut(tokens)
                handles += [m.register_forward_pre_hook(select) for m in inputs]
                handles.append(output.register_forward_hook(scatter))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _cut(tokens: torch.Tensor):
    """The pre-hook of an MLP's input projections that takes ``tokens`` (``[rows, pos]`` bool)
    alone, and the hook of its output projection that puts them back in place, 0 elsewhere."""
    flat = tokens.flatten()
    chosen: list[tuple] = []  # per projection called: the leading shape of its input, if cut

    def select(module, args):
        hidden = args[0]  # [rows, pos, d_model]; OPT's [rows·pos, d_model]; else left whole
        lead = tuple(hidden.shape[:-1])
        if lead not in (tuple(tokens.shape), (flat.numel(),)):  # a chunked MLP: left whole
            return None
        chosen.append(lead)
        return (hidden.reshape(-1, hidden.shape[-1])[flat.to(hidden.device)], *args[1:])

    def scatter(module, args, out):  # out: [tokens wanted, d_model] -> the input's shape
        taken, chosen[:] = chosen[:1], []
        if not taken:
            return None
        whole = out.new_zeros((flat.numel(), out.shape[-1]))
        whole[flat.to(out.device)] = out
        return whole.view(*taken[0], out.shape[-1])

    return select, scatter


def _ablate_rows(layer: int, todo, every: torch.Tensor, rows: int, mode: str, means, mask):
    """A ``hook_z`` function that ablates, in row r of the pass (input ``every[r]``), head h,
    for each (r, h) of ``todo``: by zero, by its mean ``means[layer][h]`` ``[d_head]``, or
    (resample) by the z the batch's next input had there (the last input's, the first's), read
    from the batch's own rows, which come first, and its mean where that input is padding."""
    by_head: dict[int, list[int]] = defaultdict(list)
    for row, head in todo:
        by_head[head].append(row)

    def fn(z: torch.Tensor, hook: Hook) -> torch.Tensor:  # z: [pass rows, pos, head, d_head]
        out = z.clone()
        for head, chosen in by_head.items():
            at = torch.tensor(chosen, device=z.device)
            value = means[layer][head].to(z) if mode != "zero" else torch.zeros((), dtype=z.dtype)
            if mode == "resample":
                source = every[chosen].add(1).remainder(rows).to(z.device)  # the next input
                value = z[:rows, :, head][source]
                if mask is not None:
                    real = mask.to(z.device)[source].bool()[..., None]
                    value = torch.where(real, value, means[layer][head].to(z))
            out[at, :, head] = value
        return out

    return fn


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
