"""The checks the public functions make at the door: each raises ``TypeError`` or ``ValueError``
naming the argument (or ``ProbeError`` for a model that cannot be used), before anything runs,
so that a wrong argument is never answered from deep inside torch or transformers, nor with a
table of NaN or numbers read from the wrong tokens.

Each check is a small function of its argument, so that entry points combine those they need.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from probe.errors import ProbeError

if TYPE_CHECKING:
    from torch import nn


def module(model: object, function: str) -> None:
    """``model`` is a torch module."""
    from torch import nn

    if not isinstance(model, nn.Module):
        raise TypeError(f"{function}: model must be a torch.nn.Module, not {type(model).__name__}")


def whole_number(value: object, name: str, at_least: int = 0) -> int:
    """``value`` is an ``int`` (not a bool), at least ``at_least``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__} {value!r}")
    if value < at_least:
        raise ValueError(f"{name} must be at least {at_least}, not {value}")
    return value


def token_ids(model: nn.Module, ids: object, name: str = "input_ids") -> torch.Tensor:
    """``ids`` as ``[batch, pos]``: an integer tensor of one or two dimensions, neither empty,
    every id within the model's vocabulary.

    Raises
    ------
    TypeError
        For what is not an integer tensor.
    ValueError
        For a shape that holds no token, or an id outside the vocabulary.
    """
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of token ids, not {type(ids).__name__}")
    if ids.dtype == torch.bool or ids.dtype.is_floating_point or ids.dtype.is_complex:
        raise TypeError(f"{name} must hold token ids (an integer tensor, e.g. torch.long), not "
                        f"{ids.dtype}")  # fmt: skip
    if ids.dim() not in (1, 2):
        raise ValueError(f"{name} must be [pos] or [batch, pos], not of shape {list(ids.shape)}")
    if ids.numel() == 0:
        raise ValueError(f"{name} of shape {list(ids.shape)} holds no token; give at least one")
    ids = ids if ids.dim() == 2 else ids[None]
    vocabulary = vocabulary_size(model)
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (vocabulary is not None and high >= vocabulary):
        bad = low if low < 0 else high
        raise ValueError(f"{name} holds the id {bad}, outside the model's vocabulary "
                         f"(0…{(vocabulary or 0) - 1})")  # fmt: skip
    return ids.long()  # what embeddings take, whatever integer type was given


def vocabulary_size(model: nn.Module) -> int | None:
    """The rows of the model's input embedding, or None for a module without one."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        embedding = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        embedding = None
    size = getattr(embedding, "num_embeddings", None)
    return size if isinstance(size, int) else None


def attention_mask(mask: object, ids: torch.Tensor, name: str = "attention_mask") -> torch.Tensor:
    """``mask`` for ``ids`` (``[batch, pos]``): of ``ids``' shape (or ``[pos]`` for one text), of
    0 and 1 only, at least one real token in each row; all real when None.

    Raises
    ------
    TypeError
        For what is not a tensor.
    ValueError
        For another shape (even of the same size: it would mask the wrong tokens), a value
        other than 0 or 1, or a row with no real token (its statistics would be NaN).
    """
    if mask is None:
        return torch.ones_like(ids)
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of 0 and 1, not {type(mask).__name__}")
    if mask.dim() == 1 and ids.shape[0] == 1:
        mask = mask[None]
    if mask.shape != ids.shape:
        raise ValueError(f"{name} of shape {list(mask.shape)} does not match input_ids "
                         f"{list(ids.shape)}; give one 0 or 1 per token")  # fmt: skip
    if mask.is_complex() or not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(f"{name} must hold 0 (padding) and 1 (a real token) only")
    empty = (mask == 0).all(-1).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"{name} row {empty[0]} has no real token (all 0); every text needs "
                         "at least one")  # fmt: skip
    return mask.long()


def repeated(sequences: torch.Tensor, n: int, name: str = "sequences") -> None:
    """``sequences`` (``[batch, pos]``) are laid out for ``n``: a first token, n tokens, the
    same n again.

    Raises
    ------
    ValueError
        When they are too short for two copies of n, or their tokens n+1…2n do not repeat
        tokens 1…n (sequences built for another n).
    """
    if sequences.shape[1] < 2 * n + 1:
        raise ValueError(f"{name} of {sequences.shape[1]} positions cannot hold a first token "
                         f"and two copies of n={n} tokens; give n ≤ "
                         f"{(sequences.shape[1] - 1) // 2}")  # fmt: skip
    first, second = sequences[:, 1 : n + 1], sequences[:, n + 1 : 2 * n + 1]
    differ = (first != second).any(-1).nonzero().flatten().tolist()
    if differ:
        raise ValueError(f"{name} row {differ[0]}: tokens {n + 1}…{2 * n} do not repeat tokens "
                         f"1…{n}; give the n the sequences were built with")  # fmt: skip


def same_shape(other: torch.Tensor, sequences: torch.Tensor, name: str) -> None:
    if other.shape != sequences.shape:
        raise ValueError(f"{name} of shape {list(other.shape)} must have the shape of sequences, "
                         f"{list(sequences.shape)}")  # fmt: skip


def query_rows(rows: object) -> None:
    """``rows`` is a slice of ints (its range is checked against the positions where they are
    known)."""
    if not isinstance(rows, slice):
        raise TypeError(f"rows must be a slice of query positions, e.g. slice(0, 64), not "
                        f"{type(rows).__name__} {rows!r}")  # fmt: skip
    for part in (rows.start, rows.stop, rows.step):
        if part is not None and (isinstance(part, bool) or not isinstance(part, int)):
            raise TypeError(f"rows must be a slice of ints, not {rows!r}")


def embedded(model: nn.Module, function: str) -> None:
    """``model`` is a whole model, with its embeddings and config (not one attention module).

    Raises
    ------
    ProbeError
        For a module without them.
    """
    if not hasattr(model, "config") or vocabulary_size(model) is None:
        raise ProbeError(f"{function} reads the model's embeddings and config; "
                         f"{type(model).__name__} has none: give the whole model (e.g. "
                         "probe.load's), not one of its modules")  # fmt: skip
