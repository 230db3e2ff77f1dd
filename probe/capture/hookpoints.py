"""Hook points, and the two context managers that read and edit them: `trace` and `hooks`.

A hook point is an identity placed on an intermediate tensor. A hook function attached to it
receives ``(activation, hook)`` and may return a replacement, so the same points serve reading
(caching) and writing (ablation, patching). Functions are attached only inside a ``with``
block and always detached on exit, also when the body raises.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager

import torch
from torch import nn

from probe.capture.cache import Cache
from probe.capture.names import MODEL_POINTS, parse, unknown
from probe.errors import ProbeError

Names = None | str | Sequence[str] | Callable[[str], bool]


class Hook(str):
    """What a hook function receives besides the tensor: the hook point's full name, a ``str``
    with TransformerLens's ``hook.name``, ``hook.layer()`` and ``hook.ctx`` (a dict the point's
    functions share for the duration of the block), so that TransformerLens hook functions
    ``fn(activation, hook)`` or ``fn(activation, *, hook)`` port unchanged and older
    ``fn(tensor, name)`` still work."""

    ctx: dict

    @property
    def name(self) -> str:
        return str(self)

    def layer(self) -> int:
        """The 0-based layer (0 for the points of a bare ``MultiHeadAttention``); for an
        encoder-decoder model, the layer within its stack (``decoder.2.cross_attn.hook_z``: 2).

        Raises
        ------
        ValueError
            For the model's own points (``hook_embed``, ``ln_final.hook_scale``…), and for a
            name that is not probe's (``probe.capture.names.parse``).
        """
        if self in MODEL_POINTS:
            raise ValueError(f"{self} belongs to no layer")
        layer = parse(self).layer
        return 0 if layer is None else layer


HookFn = Callable[[torch.Tensor, Hook], torch.Tensor | None]


def _caller(fn: HookFn) -> Callable[[torch.Tensor, Hook], torch.Tensor | None]:
    """``fn`` called as TransformerLens calls it, ``fn(x, hook=hook)``, where it has a ``hook``
    parameter (keyword-only ones included); positionally otherwise (``fn(tensor, name)``)."""
    try:
        parameter = inspect.signature(fn).parameters.get("hook")
    except (TypeError, ValueError):  # a builtin without a signature
        parameter = None
    if parameter is not None and parameter.kind != inspect.Parameter.POSITIONAL_ONLY:
        return lambda x, hook: fn(x, hook=hook)
    return fn


class HookPoint(nn.Module):
    """An identity on one intermediate tensor that runs the hook functions attached to it:
    forward functions on the tensor, backward ones on its gradient."""

    def __init__(self) -> None:
        super().__init__()
        self._fns: list[tuple[HookFn, Hook]] = []
        self._backward: list[tuple[HookFn, Hook]] = []
        self.ctx: dict = {}

    @property
    def active(self) -> bool:
        """Whether any function is attached (lets callers skip computing unobserved tensors)."""
        return bool(self._fns or self._backward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for fn, hook in self._fns:
            x = _checked(fn(x, hook), x, hook)
        if self._backward and x.requires_grad:
            # A tensor of its own, which the mirror then treats as an edit: the model's output
            # is computed from it, so that the gradient reaches it.
            x = x.view_as(x)
            x.register_hook(self._run_backward)
        return x

    def _run_backward(self, grad: torch.Tensor) -> torch.Tensor:
        for fn, hook in self._backward:
            grad = _checked(fn(grad, hook), grad, hook)
        return grad

    @contextmanager
    def attached(self, fn: HookFn, name: str, backward: bool = False) -> Iterator[None]:
        hook = Hook(name)
        hook.ctx = self.ctx
        entry = (_caller(fn), hook)
        fns = self._backward if backward else self._fns
        fns.append(entry)
        try:
            yield
        finally:
            fns.remove(entry)
            if not self.active:
                self.ctx.clear()


def _checked(out: torch.Tensor | None, x: torch.Tensor, hook: Hook) -> torch.Tensor:
    """A hook function's replacement for ``x``, checked; ``x`` where it returned None."""
    if out is None:
        return x
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            f"hook on {hook} returned a {type(out).__name__}; return None to only "
            f"read, or a tensor of shape {tuple(x.shape)}"
        )
    if out.shape != x.shape:
        raise ValueError(
            f"hook on {hook} returned shape {tuple(out.shape)}, expected {tuple(x.shape)}"
        )
    return out


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
    from probe.capture.mirror import mirrored  # transformers, only for Hugging Face models

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
            raise KeyError(unknown(wanted, points))
        chosen += [n for n in hits if n not in chosen]
    return chosen


Fns = Mapping[str, HookFn] | Sequence[tuple[str | Callable[[str], bool], HookFn]]


def _length_checked(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Refuse, before the model runs, an input longer than its positions (``check_length``)."""
    from probe.capture.architectures import check_length

    for key in ("input_ids", "inputs_embeds", "decoder_input_ids", "decoder_inputs_embeds"):
        x = kwargs.get(key)
        if x is None and key == "input_ids" and args:
            x = args[0]
        if isinstance(x, torch.Tensor) and x.dim() >= 2:
            check_length(model, x.shape[1])


@contextmanager
def hooks(model: nn.Module, fns: Fns = (), *, backward: Fns = ()) -> Iterator[None]:
    """Attach hook functions for the duration of a ``with`` block.

    Parameters
    ----------
    model : nn.Module
        A ``probe.MultiHeadAttention``, a module containing them, or a Hugging Face model.
    fns : mapping of str to callable, or a list of (name, fn) pairs
        Hook name (full, e.g. ``"blocks.3.attn.hook_z"``, a suffix applied to every layer,
        e.g. ``"hook_pattern"``, or as TransformerLens's ``fwd_hooks`` also a predicate on the
        full name) to ``fn(activation, hook)``, which returns None to only read, or a tensor of
        the same shape to replace the value flowing on. ``hook`` is the point's full name (a
        ``Hook``: a str with ``hook.name``, ``hook.layer()`` and ``hook.ctx``, as in
        TransformerLens); a function with a ``hook`` parameter gets it by keyword.
    backward : the same
        Functions on the gradient of the loss with respect to the point's tensor, ``fn(grad,
        hook)``, run when ``backward()`` passes it (TransformerLens's ``bwd_hooks``); a
        replacement gradient flows on.

    Examples
    --------
    >>> def zero_head_2(z, name):  # z: [batch, pos, head, d_head]
    ...     z = z.clone(); z[:, :, 2] = 0; return z
    >>> with probe.hooks(model, {"blocks.0.attn.hook_z": zero_head_2}):
    ...     out = model(**batch)
    """
    with hook_points(model) as points, ExitStack() as stack:
        for is_backward, pairs in ((False, fns), (True, backward)):
            pairs = pairs.items() if isinstance(pairs, Mapping) else pairs
            for key, fn in pairs:
                for name in resolve(key, points):
                    stack.enter_context(points[name].attached(fn, name, is_backward))
        yield


@contextmanager
def trace(
    model: nn.Module,
    names: Names = None,
    *,
    to_cpu: bool = False,
    keep_grad: bool = False,
    incl_bwd: bool = False,
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
    incl_bwd : bool
        Also capture each point's gradient when the body calls ``backward()``, under the
        point's name + ``"_grad"`` (TransformerLens's ``run_with_cache(incl_bwd=True)``).

    Yields
    ------
    Cache
        Filled as the model runs: name -> tensor, shapes as in DESIGN.md, e.g.
        ``blocks.{l}.attn.hook_pattern`` is ``[batch, head, q_pos, k_pos]``; with
        TransformerLens's indexing (``cache["pattern", 0]``) and residual-stream methods.
    """
    cache = Cache(model=model if hasattr(model, "config") else None)

    def save(x: torch.Tensor, name: str) -> None:
        if name in cache:  # a second forward pass, or a generation step: never overwrite
            raise RuntimeError(
                f"{name} was reached twice in one trace (the model ran twice?); "
                "capture one forward pass per trace, or use probe.hooks to collect several"
            )
        x = x if keep_grad else x.detach()
        cache[name] = x.cpu() if to_cpu else x

    def save_grad(grad: torch.Tensor, name: str) -> None:
        save(grad, f"{name}_grad")

    with hook_points(model) as points, ExitStack() as stack:
        for name in resolve(names, points):
            stack.enter_context(points[name].attached(save, name))
            if incl_bwd:
                stack.enter_context(points[name].attached(save_grad, name, backward=True))
        if hasattr(model, "config"):  # an input past the position table: one line, not torch's
            stack.callback(model.register_forward_pre_hook(_length_checked, with_kwargs=True)
                           .remove)  # fmt: skip
        yield cache
