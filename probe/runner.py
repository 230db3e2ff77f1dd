"""Stream a corpus through a mirrored model and hand each batch's attention to the analyses.

Only one batch of captures exists at a time; analyses keep sums, so memory does not grow with
the corpus.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import torch
from transformers import PreTrainedModel

from probe.alignment import Attention
from probe.corpus import Batch, Corpus
from probe.hooks import trace


def _find_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None


_malloc_trim = _find_malloc_trim()


def release_memory() -> None:
    """Return freed heap memory to the OS at the end of a run.

    glibc keeps the memory of freed tensors of the many shapes a corpus brings (every batch has
    its own length) until it is trimmed. Trimming after every batch would cost about a fifth of
    the run in page faults, so it is done once, when the batches are done.
    """
    if _malloc_trim is not None:
        _malloc_trim(0)


class Analysis(Protocol):
    """What the runner needs of an analysis."""

    name: str

    def update(self, batch: Batch, attention: Attention) -> None:
        """Add one batch; ``attention.patterns`` is ``[batch, layer, head, q_pos, k_pos]``."""


def attention_batches(
    model: PreTrainedModel, corpus: Corpus, batch_size: int = 32
) -> Iterator[tuple[Batch, torch.Tensor]]:
    """Each batch with every layer's attention pattern ``[batch, layer, head, q_pos, k_pos]``."""
    device = next(model.parameters()).device
    with torch.inference_mode(), trace(model, "hook_pattern") as cache:
        for batch in corpus.batches(batch_size):
            batch = batch.to(device)
            model(**batch.inputs)
            patterns = cache.stack("hook_pattern", dim=1).float()
            cache.clear()  # only the stacked copy lives on
            yield batch, patterns
    release_memory()


def run(
    model: PreTrainedModel,
    corpus: Corpus,
    analyses: Iterable[Analysis],
    *,
    batch_size: int = 32,
    progress: Callable[[Iterator], Iterator] = iter,
) -> None:
    """Feed every batch's patterns to every analysis, one batch in memory at a time."""
    analyses = list(analyses)
    for batch, patterns in progress(attention_batches(model, corpus, batch_size)):
        attention = Attention(patterns, batch.word_of_token, batch.n_words)
        for analysis in analyses:
            analysis.update(batch, attention)
