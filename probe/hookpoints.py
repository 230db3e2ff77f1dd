"""Hook points, and the two context managers that read and edit them: `trace` and `hooks`.

A hook point is an identity placed on an intermediate tensor. A hook function attached to it
receives ``(activation, hook)`` and may return a replacement, so the same points serve reading
(caching) and writing (ablation, patching). Functions are attached only inside a ``with``
block and always detached on exit, also when the body raises.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager

import torch
from torch import nn

from probe.errors import ProbeError
from probe.names import EMBED, Attention, HookName, parse, point_of

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
        encoder-decoder model, the layer within its stack (``decoder.2.cross_attn.hook_z``: 2).

        Raises
        ------
        ValueError
            For ``hook_embed``, and for a name that is not probe's (``probe.names.parse``).
        """
        if self == EMBED:
            raise ValueError("hook_embed belongs to no layer")
        layer = parse(self).layer
        return 0 if layer is None else layer


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

    def stack(self, suffix: str, dim: int = 0, *, attention: str | None = None) -> torch.Tensor:
        """Stack one hook point over layers: ``cache.stack("hook_pattern")`` is ``[layer, ...]``.

        Parameters
        ----------
        suffix : str
            The hook's short name, e.g. ``"hook_z"``.
        dim : int
            Where the layer dimension goes (``dim=1`` gives ``[batch, layer, ...]``).
        attention : str, optional
            Whose layers, where the cache holds several attentions (an encoder-decoder model):
            ``"encoder.attn"``, ``"decoder.attn"`` or ``"decoder.cross_attn"``; for the
            residual stream's points, the stack (``"encoder"``, or an attention of it).

        Returns
        -------
        torch.Tensor
            The captured tensors of every layer that has it, in layer order, e.g.
            ``[layer, batch, head, q_pos, k_pos]`` for ``hook_pattern``.

        Raises
        ------
        KeyError
            When no captured point (of ``attention``) is ``suffix``.
        ProbeError
            When the points are of several attentions or stacks and ``attention`` is not given:
            their layers would be stacked together.
        """
        names = [name for name in self if point_of(name) == suffix]
        if not names:
            raise KeyError(f"no captured hook is {suffix!r}; captured: {sorted(self)}")
        # Names that are not probe's (modules at other paths) keep the order they ran in.
        parsed = {name: _parsed(name) for name in names}
        sites = list(dict.fromkeys(str(p.site) for p in parsed.values() if p.site))
        if attention is not None:
            names = [n for n in names if _belongs(parsed[n], attention)]
            if not names:
                raise KeyError(f"no captured {suffix} of {attention!r}; captured: {sites}")
        elif len(sites) > 1:
            raise ProbeError(
                f"cache.stack({suffix!r}) would stack the layers of {', '.join(sites)} together; "
                f"name one, e.g. cache.stack({suffix!r}, attention={sites[-1]!r})"
            )
        names.sort(key=lambda n: parsed[n].layer or 0)
        return torch.stack([self[n] for n in names], dim=dim)


def _parsed(name: str) -> HookName:
    try:
        return parse(name)
    except ValueError:
        return HookName(point_of(name))


def _belongs(name: HookName, attention: str) -> bool:
    """Whether a point is of ``attention``, or for a residual point, of its stack."""
    if name.attention is not None:
        return name.attention == attention
    stack = Attention(attention).stack if attention in set(Attention) else attention
    return name.stack is not None and name.stack == stack


_owners: weakref.WeakKeyDictionary[nn.Module, tuple[int, int]] = weakref.WeakKeyDictionary()
_owners_lock = threading.Lock()


@contextmanager
def _one_thread(model: nn.Module) -> Iterator[None]:
    """Hold ``model``'s hook points for this thread (nested blocks of the same thread are
    fine). The points, and a mirrored model's attention, are shared by every thread: a second
    thread's forward pass would run the first's hook functions, and their caches would mix."""
    me = threading.get_ident()
    with _owners_lock:
        owner, depth = _owners.get(model, (me, 0))
        if owner != me:
            raise ProbeError(
                f"this {type(model).__name__} is being traced or hooked in another thread, and "
                "its hook points are shared: trace it from one thread at a time, or give each "
                "thread its own copy (copy.deepcopy(model))"
            )
        _owners[model] = (me, depth + 1)
    try:
        yield
    finally:
        with _owners_lock:
            if depth == 0:
                del _owners[model]
            else:
                _owners[model] = (me, depth)


@contextmanager
def hook_points(model: nn.Module) -> Iterator[dict[str, HookPoint]]:
    """The hook points of ``model`` by full name, mirrored onto Hugging Face models on the fly;
    one thread at a time (another raises ``ProbeError`` at once)."""
    with _one_thread(model), _points(model) as points:
        yield points


@contextmanager
def _points(model: nn.Module) -> Iterator[dict[str, HookPoint]]:
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
    from probe.mirror import mirrored  # transformers, only for Hugging Face models

    with mirrored(model, HookPoint) as points:
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
            suffixes = sorted({point_of(n) for n in points})
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
