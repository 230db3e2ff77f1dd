"""probe's attention function and mask function, registered with transformers as ``"probe"``
(``AttentionInterface``, ``AttentionMaskInterface``), and the registries by which they find the
mirror of the module or config they are called for.

Transformers hands the attention function every layer's per-head query, key and value; it runs
them through the implementation the model ran before it was mirrored (sdpa, or its modeling
file's eager function), so that a trace that edits nothing changes no bit of the output, and
computes the scores, pattern and per-head results beside it, where they are observed. Only when a
hook edits one of them (or a backward hook needs its gradient) does the output come from them.
The mask function gives the model the mask that implementation would have built.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from probe.capture.head_weights import materialized, output_weights
from probe.capture.modes import MIXED, UNGROUPED
from probe.errors import ProbeError

IMPLEMENTATION = "probe"

# The active mirrors (``probe.capture.hooks.Mirror``): the functions are handed a module or a
# config, and find its model's mirror here.
_MIRRORS: dict[int, Any] = {}  # id(attention module) -> its model's active mirror
_BY_CONFIG: dict[int, Any] = {}  # id(a config of the model) -> its active mirror


@contextmanager
def registered(mirror, attention: Iterable[int], configs: Iterable[int]) -> Iterator[None]:
    """``mirror`` under the ids of its model's attention modules and configs for the block.
    Models may share a config (one built from another's): what a key held before, an outer
    mirror, is put back after it."""
    keys = [(_MIRRORS, attention), (_BY_CONFIG, configs)]
    before = [(registry, key, registry.get(key)) for registry, ids in keys for key in ids]
    try:
        for registry, key, _ in before:
            registry[key] = mirror
        yield
    finally:
        for registry, key, value in before:
            if value is None:
                registry.pop(key, None)
            else:
                registry[key] = value


def previous_implementation(config) -> str:
    """The attention implementation that the active mirror of a model with this config replaced
    (a model sharing the config is mirrored, so the config names ``"probe"``)."""
    return _BY_CONFIG[id(config)].previous


def _own_kernel(mirror, module: nn.Module) -> Callable:
    """The attention function ``module`` ran before the mirror: the registry's, or for
    ``"eager"`` its modeling file's own ``eager_attention_forward``."""
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    return ALL_ATTENTION_FUNCTIONS.get_interface(mirror.previous, eager or _eager)


def probe_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model's own attention, with the hook points of the module's layer computed beside it.

    Receives query ``[batch, head, q_pos, d_head]`` and key/value ``[batch, kv_head, k_pos,
    d_head]`` from transformers (rotated, on rotary models), returns z ``[batch, q_pos, head,
    d_head]`` and the attention weights. The output comes from the implementation the model
    ran before it was mirrored (sdpa, say), on the queries, keys and values the hooks hand on:
    a trace that edits nothing leaves the model's output bit for bit as it was. Scores and
    pattern are computed beside it, only when observed; only when a hook edits one of them
    does z come from them instead.
    """
    mirror = _MIRRORS.get(id(module))
    if mirror is None:
        raise RuntimeError(
            "the 'probe' attention implementation runs only inside probe.trace or probe.hooks"
        )
    p = mirror.owner(module)

    if UNGROUPED.get() and key.shape[1] != query.shape[1]:
        raise ProbeError(
            f"{type(module).__name__} hands its attention {key.shape[1]} key/value heads for "
            f"{query.shape[1]} query heads: probe cannot split its keys and values per query head"
        )
    # The points are [batch, pos, head, d_head]: transposed views, only when observed. Keys and
    # values keep their own heads (fewer with grouped-query attention), as TransformerLens's
    # (one per query head in its ungrouped view, ``ungrouped``).
    q_point, k_point = p.scored  # hook_rot_q and hook_rot_k on rotary models
    if q_point.active:
        query = q_point(query.transpose(1, 2)).transpose(1, 2)
    if k_point.active:
        key = k_point(key.transpose(1, 2)).transpose(1, 2)
    if p.hook_v.active:
        value = p.hook_v(value.transpose(1, 2)).transpose(1, 2)

    z = weights = None
    if p.hook_pattern.active and not p.hook_attn_scores.active and _returns_pattern(mirror, module):
        z, weights = _pattern_of_eager(mirror, p, module, query, key, value, attention_mask, kwargs)
    elif p.hook_attn_scores.active or p.hook_pattern.active:
        z, weights = _pattern_beside(mirror, p, module, query, key, value, attention_mask, kwargs)
    if z is None and weights is not None and MIXED.get() and not module.training:
        z = _mixed(weights, value)  # the pattern in hand, times V: no second attention
    if z is None:  # nothing edited the scores or the pattern: the model's own kernel
        own = _own_kernel(mirror, module)
        with _one_group(module, query, key):
            z, own_weights = own(module, query, key, value, attention_mask, **kwargs)
        weights = own_weights if own_weights is not None else weights
    z = p.hook_z(z) if p.hook_z.active else z

    if p.hook_result.active:
        o = mirror.output_of[id(p)]
        with materialized(o):  # W_O is read before o runs, when accelerate may have offloaded it
            W_O = output_weights(o, mirror.layout[id(p)][2])
            result = torch.einsum("bqhk,hkm->bqhm", z, W_O)
            edited = p.hook_result(result)
            if edited is not result:  # the layer output becomes Σ_i result_i + b^O, edits and all
                mirror.pending[id(o)] = edited.sum(dim=2) + (0 if o.bias is None else o.bias)
    return z, weights


@contextmanager
def _one_group(module: nn.Module, query: torch.Tensor, key: torch.Tensor) -> Iterator[None]:
    """The model's own kernel given keys and values per query head (``ungrouped``): the module's
    ``num_key_value_groups``, by which the kernel would repeat them again, is 1 for the call."""
    groups = getattr(module, "num_key_value_groups", 1)
    if groups == 1 or key.shape[1] != query.shape[1]:
        yield
        return
    module.num_key_value_groups = 1
    try:
        yield
    finally:
        module.num_key_value_groups = groups


def _mixed(pattern: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """z ``[batch, q_pos, head, d_head]`` from the pattern and the values (each K/V head serving
    its group of query heads), as eager attention mixes them."""
    group = pattern.shape[1] // value.shape[1]
    value = value.repeat_interleave(group, dim=1) if group > 1 else value
    return torch.matmul(pattern, value).transpose(1, 2).contiguous()


def _returns_pattern(mirror, module) -> bool:
    """Whether the model's own kernel computes the pattern and returns it: eager attention, out
    of training (where dropout would have changed what it returns)."""
    return mirror.previous == "eager" and not module.training


def _pattern_of_eager(mirror, p, module, query, key, value, attention_mask, kwargs):
    """The model's eager attention, its own pattern handed to ``hook_pattern``: no second
    computation of what it has just computed. Returns (z, pattern); where a hook edited the
    pattern, z is computed from the edited one."""
    own = _own_kernel(mirror, module)
    with _one_group(module, query, key):
        z, pattern = own(module, query, key, value, attention_mask, **kwargs)
    if pattern is None:  # a kernel that keeps its pattern to itself: compute it beside
        return _pattern_beside(mirror, p, module, query, key, value, attention_mask, kwargs)
    seen = p.hook_pattern(pattern)
    if seen is not pattern:
        group = query.shape[1] // value.shape[1]
        value = value.repeat_interleave(group, dim=1) if group > 1 else value
        z = torch.matmul(seen, value).transpose(1, 2).contiguous()
    return z, seen


def _pattern_beside(mirror, p, module, query, key, value, attention_mask, kwargs):
    """Scores and pattern through their hook points, eagerly; returns (z, pattern) where a hook
    edited either (z is then computed from the edited pattern), else (None, pattern)."""
    scaling = kwargs.get("scaling")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    group = query.shape[1] // key.shape[1]
    if group > 1:  # grouped-query attention: each K/V head serves `group` query heads
        key = key.repeat_interleave(group, dim=1)
        value = value.repeat_interleave(group, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)).mul_(scaling)
    if (softcap := kwargs.get("softcap")) is not None:  # Gemma 2, before the mask (out of
        scores = torch.tanh(scores / softcap) * softcap  # place: tanh's backward needs it)
    if (position_bias := kwargs.get("position_bias")) is not None:  # T5's relative positions
        scores.add_(position_bias)
    mask = _additive(attention_mask, scores, module, kwargs)
    if mask is not None:
        scores.add_(mask[:, :, :, : key.shape[-2]])
    seen = p.hook_attn_scores(scores)
    pattern = F.softmax(seen, dim=-1, dtype=torch.float32).to(query.dtype)
    seen_pattern = p.hook_pattern(pattern)
    if seen is scores and seen_pattern is pattern:
        return None, pattern
    dropout = float(kwargs.get("dropout") or 0.0)
    z = torch.matmul(F.dropout(seen_pattern, dropout, module.training), value)
    return z.transpose(1, 2).contiguous(), seen_pattern


def _additive(mask, scores, module, kwargs) -> torch.Tensor | None:
    """The model's mask as an additive float one (the dtype's minimum where masked): sdpa's
    masks are boolean, or None where sdpa is told the attention is causal instead."""
    if mask is None:
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        if not causal or scores.shape[-2] == 1:
            return None
        q, k = scores.shape[-2:]
        mask = torch.ones(1, 1, q, k, dtype=torch.bool, device=scores.device).tril(k - q)
    if mask.dtype != torch.bool:
        return mask
    full = torch.full(mask.shape, torch.finfo(scores.dtype).min, dtype=scores.dtype)
    return full.to(scores.device).masked_fill_(mask, 0)


def _eager(module, query, key, value, attention_mask, **kwargs):
    """Eager attention, for a modeling file without its own (the scores and pattern path)."""
    group = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(group, dim=1) for t in (key, value))
    scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    mask = _additive(attention_mask, scores, module, kwargs)
    scores = scores if mask is None else scores + mask[:, :, :, : key.shape[-2]]
    pattern = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(pattern, value).transpose(1, 2).contiguous(), pattern


def probe_mask(*args, config=None, **kwargs):
    """The mask of the implementation the model ran before it was mirrored (see ``Mirror``)."""
    mirror = _BY_CONFIG.get(id(config))
    previous = "eager" if mirror is None else mirror.previous
    mask = AttentionMaskInterface._global_mapping.get(previous, eager_mask)
    return mask(*args, config=config, **kwargs)


AttentionInterface.register(IMPLEMENTATION, probe_attention)
AttentionMaskInterface.register(IMPLEMENTATION, probe_mask)
