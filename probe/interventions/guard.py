"""The model as it was: patching, attribution, edges and circuits leave it exactly so after every
call, whether the call returns or raises.

A call attaches hooks, switches the attention implementation and takes gradients; each of its
parts undoes what it did, and this guard checks the whole at the door and restores it at the
end, so that a notebook that catches an exception and goes on can trust its model: the same
train or eval mode of every module, ``requires_grad`` flags and ``.grad`` tensors, attention
implementation, and no hook left on any module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ParamSpec, TypeVar

import torch
from torch import nn

from probe.errors import ProbeError

# A module's hook registries (torch.nn.Module's own attributes).
HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)

P = ParamSpec("P")
R = TypeVar("R")


def keeps_model(call: Callable[P, R]) -> Callable[P, R]:
    """``call(model, ...)``, refused in one line where the model cannot give a right answer, and
    with the model restored after it (``model_kept``)."""

    @functools.wraps(call)
    def guarded(*args: P.args, **kwargs: P.kwargs) -> R:
        model = args[0] if args else kwargs.get("model")
        check_model(model)
        with model_kept(model):
            return call(*args, **kwargs)

    return guarded


def check_model(model: Any) -> None:
    """Refuse a model that is not a module, or one in training mode (dropout would make every
    estimate random).

    Raises
    ------
    ProbeError
        Naming what to do.
    """
    if not isinstance(model, nn.Module):
        raise ProbeError(f"model must be a torch.nn.Module, not a {type(model).__name__}")
    training = [name or type(model).__name__ for name, m in model.named_modules() if m.training]
    if training:
        raise ProbeError(
            f"the model is in training mode ({training[0]}{' …' if len(training) > 1 else ''}): "
            "dropout would make every estimate random; call model.eval() first"
        )


@contextmanager
def model_kept(model: nn.Module) -> Iterator[None]:
    """Within the block anything may change the model's modes, flags, gradients, hooks and
    attention implementation; after it, they are as they were."""
    modules = list(model.modules())
    training = [m.training for m in modules]
    hooks = [{name: set(getattr(m, name, {})) for name in HOOK_DICTS} for m in modules]
    parameters = list(model.parameters())
    flags = [p.requires_grad for p in parameters]
    grads = [p.grad for p in parameters]
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    try:
        yield
    finally:
        for m, was, kept in zip(modules, training, hooks, strict=True):
            m.training = was
            for name, keys in kept.items():
                registry = getattr(m, name, None)
                for key in [k for k in registry or () if k not in keys]:
                    del registry[key]
        with torch.no_grad():
            for p, flag, grad in zip(parameters, flags, grads, strict=True):
                if p.requires_grad != flag:
                    p.requires_grad_(flag)
                if p.grad is not grad:
                    p.grad = grad
        if config is not None and getattr(config, "_attn_implementation", None) != implementation:
            model.set_attn_implementation(implementation)
