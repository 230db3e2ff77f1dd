"""Stream a corpus through a mirrored model and hand each layer's captures to the consumers.

Captures reach the consumers one layer at a time, from inside the forward pass, and are dropped
before the next layer runs: memory holds one layer of one batch, whatever the depth of the model
or the size of the corpus. Consumers keep sums, or the few features they need across layers.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable, Collection, Iterable, Sequence
from contextlib import suppress
from functools import cached_property
from typing import Protocol

import torch
from transformers import PreTrainedModel

from probe.capture.hookpoints import hooks
from probe.capture.modes import mixed_from_the_pattern
from probe.capture.names import hook_name, parse
from probe.capture.spec import describe
from probe.errors import ProbeError
from probe.inputs.alignment import WordAlignment
from probe.inputs.corpus import Batch
from probe.pipeline.loading import main_device


def _glibc(function: str) -> Callable[..., int] | None:
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), function) if name else None
    except (OSError, AttributeError):  # not glibc
        return None


_malloc_trim, _mallopt = _glibc("malloc_trim"), _glibc("mallopt")
M_MMAP_THRESHOLD = -3  # mallopt's parameter number, from glibc's malloc.h
MMAP_THRESHOLD = 4 * 2**20


def fix_mmap_threshold() -> None:
    """Keep large tensors in their own memory mappings, returned to the OS when freed.

    glibc raises its mmap threshold each time it frees a mapped block, up to 32 MiB; after a few
    long sentences, attention maps of every size come from the heap, which fragments, so that
    resident memory grows with the number of layers run. A fixed threshold prevents that.
    """
    if _mallopt is not None:
        _mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def release_memory() -> None:
    """Return freed heap memory to the OS at the end of a run.

    glibc keeps the memory of freed tensors of the many shapes a corpus brings (every batch has
    its own length) until it is trimmed. Trimming after every batch would cost about a fifth of
    the run in page faults, so it is done once, when the batches are done.
    """
    if _malloc_trim is not None:
        _malloc_trim(0)


class LayerCapture(dict):
    """One layer's captures for one batch, by hook suffix (``capture["hook_pattern"]``), with
    the word-level views of the attention pattern computed once and shared by every consumer."""

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        batch: Batch,
        alignment: WordAlignment | None = None,
        attention: str = "blocks.attn",
    ) -> None:
        super().__init__(tensors)
        self.batch = batch
        self.attention = attention  # which of the model's attentions (see ``attentions``)
        self.alignment = alignment or WordAlignment(batch.word_of_token, batch.n_words)

    @cached_property
    def pattern(self) -> torch.Tensor:
        """Attention weights ``[batch, head, q_pos, k_pos]`` in float32."""
        return self["hook_pattern"].float()

    @cached_property
    def words(self) -> torch.Tensor:
        """Word-level attention ``[batch, head, word, word]`` (see ``word_attention``)."""
        return self.alignment.words(self.pattern)

    @cached_property
    def predictions(self) -> torch.Tensor:
        """Every head's predicted head word ``[batch, 2, head, word]``, direction 0 dependent ->
        head, 1 head -> dependent (see ``head_predictions``)."""
        return self.alignment.predictions(self.words)


class _AllSeen(Exception):  # noqa: N818 (a signal, not an error)
    """Raised from the hook that hands on the last capture of a batch: what the model computes
    after it (the last block's MLP, a pooler, a decoder the consumers do not read) feeds no
    consumer, so the forward pass stops there."""


class Consumer(Protocol):
    """What the runner needs of whatever reads the captures (an analysis, say). A consumer may
    name the ``attention`` it reads (``"decoder.cross_attn"``; see
    ``probe.capture.architectures.attentions``), or a tuple of them (each capture says which it is,
    in ``capture.attention``); by default the model's first: its only attention, or an
    encoder-decoder model's encoder self-attention."""

    def begin_batch(self, batch: Batch) -> None:
        """Called before the batch runs through the model."""

    def update(self, batch: Batch, layer: int, capture: LayerCapture) -> None:
        """Called once per layer, in layer order, while the batch runs through the model."""

    def end_batch(self, batch: Batch) -> None:
        """Called after every layer of the batch has been seen."""


def check_finite(pattern: torch.Tensor, batch: Batch, name: str) -> None:
    """Refuse attention that is not finite among real tokens ``[batch, head, q_pos, k_pos]``:
    every count an analysis keeps would silently absorb it.

    Raises
    ------
    ProbeError
        Naming the hook point and the first sentence.
    """
    if torch.isfinite(pattern.sum(dtype=torch.float32)):  # weights ≤ 1: finite if all are
        return
    if pattern.shape[-1] != pattern.shape[-2] or pattern.shape[-1] != batch.attention_mask.shape[1]:
        real = torch.ones(pattern.shape[0], dtype=torch.bool, device=pattern.device)[:, None, None]
    else:
        mask = batch.attention_mask.bool()
        real = (mask[:, None, :, None] & mask[:, None, None, :]).to(pattern.device)
    bad = ~torch.isfinite(pattern) & real
    if bad.any():
        first = int(bad.flatten(1).any(1).nonzero()[0])
        raise ProbeError(
            f"{name} is not finite (NaN or infinite) on sentence {int(batch.index[first])}: the "
            "model's weights are damaged, or its attention overflowed (try --dtype float32)"
        )


def decoder_inputs(model: PreTrainedModel, inputs: dict[str, torch.Tensor]) -> dict:
    """An encoder-decoder model's inputs with the decoder's: the sentence itself, shifted right
    after the decoder's start token (teacher forcing on reconstruction, BART's pre-training
    task), so that decoder position t reads source token t - 1 and predicts token t.

    The decoder has a real position for each of the sentence's tokens, its mask the sentence's:
    the last token is predicted, never read, in a padded row as in the batch's longest one, so
    that what the decoder sees does not depend on the batch."""
    ids = inputs["input_ids"]
    config = model.config
    start = getattr(config, "decoder_start_token_id", None)
    start = config.pad_token_id if start is None else start  # T5 starts from its padding
    first = torch.full_like(ids[:, :1], start)
    return inputs | {
        "decoder_input_ids": torch.cat([first, ids[:, :-1]], 1),
        "decoder_attention_mask": inputs["attention_mask"],
    }


def stream(
    model: PreTrainedModel,
    batches: Iterable[Batch],
    consumers: Sequence[Consumer],
    captures: Collection[str] = ("hook_pattern",),
) -> None:
    """Run every batch through ``model`` and hand each layer's captures to every consumer.

    The forward pass of a batch stops once its last capture has been handed on: nothing the
    model computes after it reaches a consumer. A layer whose pattern is computed beside the
    model's sdpa kernel takes its output from that pattern (p·V, ``mixed_from_the_pattern``):
    sdpa's output to float32 rounding, without the kernel's second pass over the same scores.

    Parameters
    ----------
    model : PreTrainedModel
        A supported Hugging Face model; it is mirrored for the duration of the call. An
        encoder-decoder model's decoder reads each sentence too (``decoder_inputs``).
    batches : iterable of Batch
        E.g. ``Corpus.batches()``, wrapped in a progress bar if wanted.
    consumers : sequence of Consumer
    captures : collection of str
        Hook suffixes (``"hook_pattern"``, ``"hook_z"``…) a layer's capture holds; the consumers
        see a layer once all of them have been computed.
    """
    fix_mmap_threshold()
    device = main_device(model)  # a model spread over devices is analysed on the first
    spec = describe(model)
    first = spec.attention().name
    readers: dict[str, list[Consumer]] = {}
    for consumer in consumers:
        read = getattr(consumer, "attention", None) or first
        for site in (read,) if isinstance(read, str) else read:
            readers.setdefault(site, []).append(consumer)
    wanted = set(captures)
    # Each name's (attention, layer) and point, parsed once here rather than on every capture.
    where: dict[str, tuple[tuple[str, int], str]] = {}
    for site in readers:
        for layer in range(spec.attention(site).n_layers):
            for suffix in wanted:
                name = hook_name(suffix, layer, site)  # encoder.attn -> encoder.3.attn.hook_z
                where[name] = (site, layer), parse(name).point
    last = {site: spec.attention(site).n_layers - 1 for site in readers}
    encoder_decoder = spec.encoder_decoder
    pending: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    batch: Batch
    alignment: WordAlignment

    def receive(tensor: torch.Tensor, name: str) -> None:
        site, point = where[name]
        got = pending.setdefault(site, {})
        got[point] = tensor.to(device)  # a no-op unless the layer is elsewhere
        if point == "hook_pattern":
            check_finite(got[point], batch, name)
        if len(got) == len(wanted):
            capture = LayerCapture(pending.pop(site), batch, alignment, site[0])
            for consumer in readers[site[0]]:
                consumer.update(batch, site[1], capture)
            if site[1] == last[site[0]]:
                finished.add(site[0])
                if len(finished) == len(readers):
                    raise _AllSeen

    with (
        torch.inference_mode(),
        mixed_from_the_pattern(),
        hooks(model, dict.fromkeys(where, receive)),
    ):
        for batch in batches:
            batch = batch.to(device)
            alignment = WordAlignment(batch.word_of_token, batch.n_words)
            for consumer in consumers:
                consumer.begin_batch(batch)
            inputs = decoder_inputs(model, batch.inputs) if encoder_decoder else batch.inputs
            finished: set[str] = set()
            with suppress(_AllSeen):
                model(**inputs)
            for consumer in consumers:
                consumer.end_batch(batch)
    release_memory()


def stream_rows(
    model: PreTrainedModel,
    batches: Iterable[Batch],
    consumers: Sequence[Consumer],
    budget: int,
) -> None:
    """As ``stream``, for consumers that take patterns in blocks of query rows (an analysis
    that declares ``rows``): each layer's pattern reaches every consumer's ``update_rows`` one
    block at a time, computed from the layer's queries and keys (``probe.capture.rows``), and the
    layer's output is mixed from the same blocks (p·V) in place of the model's sdpa kernel. No
    T × T pattern exists whole: memory per layer is O(block × T).

    Parameters
    ----------
    model : PreTrainedModel
        A model ``probe.capture.rows.rows_unsupported`` accepts; its first attention is read.
    batches : iterable of Batch
    consumers : sequence of Consumer
        Each that declares ``rows`` has ``update_rows(batch, layer, block)`` called; the others
        (an analysis that reads no captures) see only the batches.
    budget : int
        Bytes a block of rows may take (``probe.capture.rows.block_rows``).
    """
    from probe.capture.rows import scored

    fix_mmap_threshold()
    device = main_device(model)
    last = describe(model).n_layers - 1
    batch: Batch
    takers = [c for c in consumers if getattr(c, "rows", False)]

    def receive(layer: int, what) -> torch.Tensor | None:
        # The layer's output from the blocks (p·V), where the model goes on to a next layer.
        out = what.output() if layer != last and what.value is not None else None
        for block in what.blocks(budget, batch.attention_mask):
            if out is not None:  # before the consumers, which may reuse the block's memory
                what.add_output(block, out)
            for consumer in takers:
                consumer.update_rows(batch, layer, block)
        if layer == last:  # the last block's MLP feeds no consumer
            raise _AllSeen
        return out

    with torch.inference_mode(), scored(model, receive):
        for batch in batches:
            batch = batch.to(device)
            for consumer in consumers:
                consumer.begin_batch(batch)
            with suppress(_AllSeen):
                model(**batch.inputs)
            for consumer in consumers:
                consumer.end_batch(batch)
    release_memory()
