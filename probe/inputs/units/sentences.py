"""The sentence unit: a treebank's sentences, each with its tree (``probe.inputs.corpus``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from probe.distributed import Tally
from probe.inputs.treebank import count_sentences, iter_treebank
from probe.inputs.units import Unit

if TYPE_CHECKING:
    from probe.inputs.corpus import Batch


class Sentences(Unit):
    """Treebank sentences, tokenized, aligned to their words and batched by length."""

    name = "sentence"
    label = "sentences"
    examples = True

    def __init__(self, *args, **kwargs) -> None:
        from probe.inputs.corpus import Corpus  # imported with torch: not when options are read

        super().__init__(*args, **kwargs)
        stop = _smaller(self.source.max_sentences, self.stop)
        self.corpus = Corpus(self, self.tokenizer, self.limit, max_sentences=stop, shard=self.shard)

    def __iter__(self) -> Iterator:
        """Every sentence of the treebank, read anew (every process reads every sentence)."""
        return iter_treebank(self.source.treebank)

    def size(self) -> int:
        rank, size = self.shard
        total = count_sentences(self.source.treebank)
        return len(range(rank, _smaller(total, self.corpus.max_sentences), size))

    def batches(self, batch_size: int) -> Iterator[Batch]:
        return self.corpus.batches(batch_size)

    def tally(self) -> Tally:
        corpus = self.corpus
        return Tally(read=corpus.read, analysed=corpus.analysed, words=corpus.words,
                     skipped=Tally(corpus.skipped))  # fmt: skip


def _smaller(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)
