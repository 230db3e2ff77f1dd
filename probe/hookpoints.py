"""Hook points, and the two context managers that read and edit them: `trace` and `hooks`.

A hook point is an identity placed on an intermediate tensor. A hook function attached to it
receives ``(activation, hook)`` and may return a replacement, so the same points serve reading
(caching) and writing (ablation, patching). Functions are attached only inside a ``with``
block and always detached on exit, also when the body raises.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager

import torch
from torch import nn

Names = None | str | Sequence[str] | Callable[[str], bool]


class Hook(str):
    """What a hook function receives besides the tensor: the hook point's full name, a ``str``
    with TransformerLens's ``hook.name`` and ``hook.layer()``, so that TransformerLens hook
    functions ``fn(activation, hook)`` port unchanged and older ``fn(tensor, name)`` still work."""

    __slots__ = ()

    @property
    def name(self) -> str:
        return str(self)

    def layer(self) -> int:
        """The 0-based layer (0 for the points of a bare ``MultiHeadAttention``); for an
        encoder-decoder model, the layer within its stack (``decoder.2.cross_attn.hook_z``: 2)."""
        if self.startswith(("blocks.", "encoder.", "decoder.")):
            return int(self.split(".")[1])
        if self == "hook_embed":
            raise ValueError("hook_embed belongs to no layer")
        return 0


HookFn = Callable[[torch.Tensor, Hook], torch.Tensor | None]


class HookPoint(nn.Module):
    """An identity on one intermediate tensor that runs the hook functions attached to it."""

    def __init__(self) -> None:
        super().__init__()
        self._fns: list[tuple[HookFn, str]] = []

    @property
    def active(self) -> bool:
        """Whether any function is attached (lets callers skip computing unobserved tensors)."""
        return bool(self._fns)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for fn, name in self._fns:
            out = fn(x, name)
            if out is not None:
                if not isinstance(out, torch.Tensor):
                    raise TypeError(
                        f"hook on {name} returned a {type(out).__name__}; return None to only "
                        f"read, or a tensor of shape {tuple(x.shape)}"
                    )
                if out.shape != x.shape:
                    raise ValueError(
                        f"hook on {name} returned shape {tuple(out.shape)}, "
                        f"expected {tuple(x.shape)}"
                    )
                x = out
        return x

    @contextmanager
    def attached(self, fn: HookFn, name: str) -> Iterator[None]:
        entry = (fn, Hook(name))
        self._fns.append(entry)
        try:
            yield
        finally:
            self._fns.remove(entry)


class Cache(dict):
    """Captured tensors by hook name, e.g. ``cache["blocks.0.attn.hook_pattern"]``."""

    def stack(self, suffix: str, dim: int = 0) -> torch.Tensor:
        """Stack one hook point over layers: ``cache.stack("hook_pattern")`` is ``[layer, ...]``.

        Parameters
        ----------
        suffix : str
            The hook's short name, e.g. ``"hook_z"``.
        dim : int
            Where the layer dimension goes (``dim=1`` gives ``[batch, layer, ...]``).

        Returns
        -------
        torch.Tensor
            The captured tensors of every layer that has it, in layer order.
        """
        keys = sorted((k for k in self if k.endswith(suffix)), key=_layer_of)
        if not keys:
            raise KeyError(f"no captured hook ends with {suffix!r}; captured: {sorted(self)}")
        return torch.stack([self[k] for k in keys], dim=dim)


def _layer_of(name: str) -> int:
    parts = name.split(".")
    return int(parts[1]) if len(parts) > 2 and parts[1].isdigit() else 0


@contextmanager
def hook_points(model: nn.Module) -> Iterator[dict[str, HookPoint]]:
    """The hook points of ``model`` by full name, mirrored onto Hugging Face models on the fly."""
    own = {name: m for name, m in model.named_modules() if isinstance(m, HookPoint)}
    if own:
        yield own
        return
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"{type(model).__name__} has no probe hook points: pass a probe.MultiHeadAttention, "
            "a module built from them, or a Hugging Face model"
        )
    from probe.mirror import mirrored

    with mirrored(model) as points:
        yield points


def resolve(names: Names, points: Mapping[str, HookPoint]) -> list[str]:
    """Full hook names selected by ``names``: None (all), full names, suffixes or a predicate."""
    if names is None:
        return list(points)
    if callable(names):
        return [n for n in points if names(n)]
    if isinstance(names, str):
        names = [names]
    chosen: list[str] = []
    for wanted in names:
        hits = [n for n in points if n == wanted or n.endswith("." + wanted)]
        if not hits:
            suffixes = sorted({n.rsplit(".", 1)[-1] for n in points})
            raise KeyError(
                f"unknown hook point {wanted!r}; valid suffixes are {', '.join(suffixes)} "
                f"and full names such as {next(iter(points))!r}"
            )
        chosen += [n for n in hits if n not in chosen]
    return chosen


@contextmanager
def hooks(model: nn.Module, fns: Mapping[str, HookFn]) -> Iterator[None]:
    """Attach hook functions for the duration of a ``with`` block.

    Parameters
    ----------
    model : nn.Module
        A ``probe.MultiHeadAttention``, a module containing them, or a Hugging Face model.
    fns : mapping of str to callable
        Hook name (full, e.g. ``"blocks.3.attn.hook_z"``, or a suffix applied to every layer,
        e.g. ``"hook_pattern"``) to ``fn(activation, hook)``, which returns None to only read,
        or a tensor of the same shape to replace the value flowing on. ``hook`` is the point's
        full name (a ``Hook``: a str with ``hook.name`` and ``hook.layer()``, as in
        TransformerLens).

    Examples
    --------
    >>> def zero_head_2(z, name):  # z: [batch, pos, head, d_head]
    ...     z = z.clone(); z[:, :, 2] = 0; return z
    >>> with probe.hooks(model, {"blocks.0.attn.hook_z": zero_head_2}):
    ...     out = model(**batch)
    """
    with hook_points(model) as points, ExitStack() as stack:
        for key, fn in fns.items():
            for name in resolve(key, points):
                stack.enter_context(points[name].attached(fn, name))
        yield


@contextmanager
def trace(
    model: nn.Module, names: Names = None, *, to_cpu: bool = False, keep_grad: bool = False
) -> Iterator[Cache]:
    """Capture hook points while the body runs the model.

    Parameters
    ----------
    model : nn.Module
        A ``probe.MultiHeadAttention``, a module containing them, or a Hugging Face model.
    names : None, str, sequence of str, or callable
        Which points: None for all; full names or suffixes such as ``"hook_pattern"``; or a
        predicate on the full name.
    to_cpu : bool
        Move captured tensors to the CPU.
    keep_grad : bool
        Keep captured tensors in the autograd graph (default: detached).

    Yields
    ------
    Cache
        Filled as the model runs: name -> tensor, shapes as in DESIGN.md, e.g.
        ``blocks.{l}.attn.hook_pattern`` is ``[batch, head, q_pos, k_pos]``.
    """
    cache = Cache()

    def save(x: torch.Tensor, name: str) -> None:
        if name in cache:  # a second forward pass, or a generation step: never overwrite
            raise RuntimeError(
                f"{name} was reached twice in one trace (the model ran twice?); "
                "capture one forward pass per trace, or use probe.hooks to collect several"
            )
        x = x if keep_grad else x.detach()
        cache[name] = x.cpu() if to_cpu else x

    with hook_points(model) as points, ExitStack() as stack:
        for name in resolve(names, points):
            stack.enter_context(points[name].attached(save, name))
        yield cache
