"""Input units: what the model reads for an analysis, read, sharded, batched and counted.

An analysis declares the unit it reads (``Analysis.unit``); the run streams every unit that a
chosen analysis needs, the same way for all: it builds the unit from the run's ``Source``, asks
it for batches, hands them through the model to the analyses that read it, and keeps the unit's
``tally`` in ``run.json``. Adding a unit is one module with one ``Unit`` subclass and one line in
``UNITS``.

This module imports nothing heavy: the run plans its units before loading torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from probe.options import Option

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from probe.inputs.corpus import Batch

# name -> "module:class"
UNITS: dict[str, str] = {
    "sentence": "probe.inputs.units.sentences:Sentences",
    "window": "probe.inputs.units.windows:CoreferenceWindows",
    "repeats": "probe.inputs.units.repeats:RepeatedSequences",
    "text": "probe.inputs.units.texts:Texts",
}


def get(name: str) -> type[Unit]:
    """The unit registered as ``name`` (its module is imported now)."""
    module, cls = UNITS[name].split(":")
    return getattr(importlib.import_module(module), cls)


class Either(tuple):
    """Units an analysis can read in place of one another, the first whose input the run has
    (``Unit.input``): ``Either("text", "sentence")`` reads a corpus when one is given
    (``--corpus``), else the treebank's sentences."""

    def __new__(cls, *names: str) -> Either:
        return super().__new__(cls, names)

    def pick(self, given: set[str]) -> str:
        """The first alternative whose input is among ``given`` (or that needs none); else the
        last."""
        return next((u for u in self if get_input(u) in given | {None}), self[-1])


def get_input(name: str) -> str | None:
    """What unit ``name`` reads from the user: ``treebank``, ``corpus``, or None (it makes its
    own input)."""
    return get(name).input


@dataclass(frozen=True)
class Source:
    """What the run's units read: treebank files, resolved and checked when the run is planned,
    how many of their sentences (None: all), the seed of what a unit draws at random; and a
    corpus of plain text (``probe.inputs.texts.CorpusSpec``), its first ``max_texts`` texts, and
    the tokens per window (None: the model's maximum, at most 512)."""

    treebank: tuple[Path, ...] = ()
    max_sentences: int | None = None
    seed: int = 0
    corpus: Any = None
    max_texts: int | None = None
    context: int | None = None


class Unit:
    """One kind of model input, streamed as ``Batch``es.

    Parameters
    ----------
    source : Source
    tokenizer : PreTrainedTokenizerBase
    limit : int
        The longest input the model takes, special tokens included.
    shard : (int, int)
        ``(rank, size)``: this process's share under torchrun (``probe.distributed``); every
        item goes to exactly one process, chosen by its position in the input.
    options : mapping
        This unit's ``options``, resolved.
    stop : int, optional
        Read at most this many items from the input's start (before sharding); the analyses
        that read this unit may need only the first few.
    """

    name: ClassVar[str]
    label: ClassVar[str]  # what it reads ("sentences"), as the run card and progress bar say
    counted: ClassVar[str | None] = None  # what its progress bar counts, where not that
    options: ClassVar[tuple[Option, ...]] = ()
    # Whether the report's head cards take their example sentences from this unit's batches.
    examples: ClassVar[bool] = False
    # What it reads from the user (``Either`` picks by it): "treebank", "corpus", or None.
    input: ClassVar[str | None] = "treebank"

    def __init__(
        self,
        source: Source,
        tokenizer: PreTrainedTokenizerBase,
        limit: int,
        *,
        shard: tuple[int, int] = (0, 1),
        options: Mapping[str, Any] | None = None,
        stop: int | None = None,
    ) -> None:
        self.source, self.tokenizer, self.limit = source, tokenizer, limit
        self.shard, self.stop = shard, stop
        self.settings = {o.name: o.default for o in self.options} | dict(options or {})

    @classmethod
    def used(cls, options: Mapping[str, Any], limit: int) -> dict[str, Any]:
        """This unit's options as a run with the model's ``limit`` uses them (``run.json``
        records these, not what was asked): as given, unless the unit caps one."""
        return {o.name: options.get(o.name, o.default) for o in cls.options}

    def size(self) -> int | None:
        """How many items this process will read, if known before reading (progress bars); a
        unit whose bar counts something else sets each batch's ``progress``."""
        return None

    def batches(self, batch_size: int) -> Iterator[Batch]:
        """The input, batched; counters restart with each call."""
        raise NotImplementedError

    def tally(self) -> dict[str, Any]:
        """What was read, analysed and skipped, and why: counts that add up across processes."""
        raise NotImplementedError
