"""Probe's hook points on pretrained Hugging Face models, through transformers' attention registry.

Instead of re-implementing models, we register one attention function under the name
``"probe"`` (with a mask function that gives the model the mask it would have built for
itself) and switch a model to it for the duration of a ``probe.trace`` or ``probe.hooks``
block (``mirrored``). Transformers hands the function every layer's per-head query, key and
value; it runs them through the implementation the model ran before (sdpa, or its modeling
file's eager function), so that a trace that edits nothing changes no bit of the output, and
computes the scores, pattern and per-head results beside it, where they are observed. Only when a
hook edits one of them (or a backward hook needs its gradient) does the output come from them.

On rotary models the query and key reach that function already rotated: there they are
``hook_rot_q`` and ``hook_rot_k``, and ``hook_q`` and ``hook_k`` (before the rotation, and before
Qwen3's and Gemma 3's query and key norms, as TransformerLens has them) are forward hooks on the
projections, so that an edit of them flows through the norms and the rotation. The residual
stream's, the norms' and the MLP's points are hooks on the model's own modules.

The mirror is in parts, each a module: where the points and their hooks go
(``probe.capture.sites``), the hooks and attaching them (``probe.capture.hooks``), the attention
and mask functions (``probe.capture.attention_function``), the norms' arithmetic
(``probe.capture.norms``) and the ungrouped and mixed modes (``probe.capture.modes``). This module
attaches a model's mirror for a block, built once per model.

This module does not import ``probe.capture.hookpoints``, which imports it: the hook points are made
by the ``point`` factory that ``mirrored`` is given (``probe.capture.hookpoints.HookPoint``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import nn
from transformers import PreTrainedModel

from probe.capture.hooks import Mirror
from probe.capture.modes import (  # re-export for one release (#62): moved to probe.capture.modes
    mixed_from_the_pattern,
    ungroupable,
    ungrouped,
)
from probe.capture.sites import Point

__all__ = ["mirrored", "mixed_from_the_pattern", "ungroupable", "ungrouped"]

_ACTIVE: dict[int, Mirror] = {}  # id(model) -> its active mirror (nested traces share it)


@contextmanager
def mirrored(model: PreTrainedModel, point: Callable[[], Point]) -> Iterator[dict[str, Point]]:
    """Switch ``model`` to probe's attention for the block; yields its hook points by name.

    Parameters
    ----------
    model : PreTrainedModel
        A supported architecture (``probe.capture.architectures.SUPPORTED``).
    point : callable
        Makes one hook point (``probe.capture.hookpoints.HookPoint``); nested blocks share the
        points of the outermost.
    """
    mirror = _ACTIVE.get(id(model))
    if mirror is not None:
        yield mirror.points
        return
    mirror = _ACTIVE[id(model)] = _mirror_of(model, point)
    try:
        with mirror.attached():
            yield mirror.points
    finally:
        del _ACTIVE[id(model)]


# Each model's mirror, built once for its modules as they are and kept while the model lives:
# building one (a hook point per name, per layer) costs as much as a small batch's forward pass,
# and a trace is one forward pass. A module swapped in or out changes the modules' identities
# (those the mirror hooks are kept alive by it, so their ids are not reused), and a new mirror is
# built.
_BUILT: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, Mirror]] = weakref.WeakKeyDictionary()


def _mirror_of(model: PreTrainedModel, point: Callable[[], Point]) -> Mirror:
    """``model``'s mirror: the one built before if its modules are still the same, else anew."""
    key = (tuple(map(id, model.modules())), point)
    built = _BUILT.get(model)
    if built is not None and built[0] == key:
        return built[1]
    mirror = Mirror(model, point)
    _BUILT[model] = (key, mirror)
    return mirror
