"""The two ways a block can switch a mirrored model's attention to run: TransformerLens's ungrouped
view of grouped-query attention (``ungrouped``, and ``ungroupable`` to ask beforehand) and each
layer's output mixed from the pattern computed beside the model's kernel
(``mixed_from_the_pattern``). The attention function and the hooks read the switches.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from transformers import PreTrainedModel

from probe.capture.architectures import architecture
from probe.capture.spec import describe

# Set by ``ungrouped``: keys and values per query head, as on the model's ungrouped twin.
UNGROUPED: ContextVar[bool] = ContextVar("probe_ungrouped", default=False)


@contextmanager
def ungrouped() -> Iterator[None]:
    """Within the block, a model with grouped-query attention runs in TransformerLens's ungrouped
    view: each key and value head's projection is repeated for every query head it serves, so
    that ``hook_k``, ``hook_v``, ``hook_{k,v}_input`` and every point after them have one head
    per query head, and an edit of one reaches that query head alone. The model computes what
    its ungrouped twin (its key and value weights repeated, ``num_key_value_heads`` =
    ``num_attention_heads``) computes: the same output, to float rounding. Models whose keys
    and values come out of a fused projection (``Architecture.fused``) cannot be ungrouped: the
    attention raises ``ProbeError`` (``ungroupable`` says so beforehand)."""
    token = UNGROUPED.set(True)
    try:
        yield
    finally:
        UNGROUPED.reset(token)


def ungroupable(model: PreTrainedModel) -> str | None:
    """Why ``model``'s grouped-query attention cannot run ``ungrouped``, or None where it can
    (or has no grouped-query attention)."""
    spec = describe(model).attention()
    if spec.n_kv_heads == spec.n_heads:
        return None
    arch = architecture(model)
    if arch.fused:
        return (
            f"{type(model).__name__} computes its queries, keys and values in one fused "
            f"projection ({arch.qkv}), which probe cannot split into one key and value input per "
            f"query head under grouped-query attention ({spec.n_heads} query heads, "
            f"{spec.n_kv_heads} key/value heads)"
        )
    return None


# Set by ``mixed_from_the_pattern``: where the pattern is computed beside the model's kernel and
# nothing edits it, the layer's output is mixed from it rather than by the kernel again.
MIXED: ContextVar[bool] = ContextVar("probe_mixed", default=False)


@contextmanager
def mixed_from_the_pattern() -> Iterator[None]:
    """Within the block, a layer whose pattern is computed beside the model's kernel (sdpa, say)
    takes its output from that pattern (p·V) instead of running the kernel: the same numbers
    within the kernel's own rounding, for a reader of patterns that needs not the model's
    output bit for bit (the analyses' stream; a trace keeps the kernel's bits)."""
    token = MIXED.set(True)
    try:
        yield
    finally:
        MIXED.reset(token)
