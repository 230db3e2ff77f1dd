"""The coreference window unit: consecutive whole sentences of one document, with the
document's mentions (``probe.inputs.coreference``)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from itertools import islice
from typing import TYPE_CHECKING, Any

from probe.distributed import Tally
from probe.inputs.treebank import iter_treebank
from probe.inputs.units import Unit
from probe.options import Option

if TYPE_CHECKING:
    from probe.inputs.corpus import Batch

# Windows are all near the limit: a batch holds at most a quarter of batch_size full windows, so
# that it is bounded by attention cells, as a batch of sentences is.
WINDOWS_PER_BATCH_SHARE = 4


class CoreferenceWindows(Unit):
    """Documents cut into windows of whole sentences, each at most ``coref_window`` tokens.
    Documents without mentions give no window, so a treebank without ``Entity=`` gives none."""

    name = "window"
    label = "coreference windows"
    options = (
        Option("coref_window", 128, "Model tokens per coreference window of whole sentences "
               "(capped at the model's).", min=8),
    )  # fmt: skip

    @classmethod
    def used(cls, options: Mapping[str, Any], limit: int) -> dict[str, Any]:
        (window,) = cls.options
        return {window.name: min(options.get(window.name, window.default), limit)}

    def __init__(self, *args, **kwargs) -> None:
        from probe.inputs.coreference import Windows
        from probe.inputs.corpus import Corpus  # imported with torch: not when options are read

        super().__init__(*args, **kwargs)
        self.window = self.used(self.settings, self.limit)["coref_window"]
        sentences = islice(iter_treebank(self.source.treebank), self.source.max_sentences)
        self.windows = Windows(sentences, self.tokenizer, self.window, shard=self.shard)
        self.corpus = Corpus(self.windows, self.tokenizer, self.window)

    def batches(self, batch_size: int) -> Iterator[Batch]:
        cells = batch_size * self.window * self.window // WINDOWS_PER_BATCH_SHARE
        return self.corpus.batches(batch_size, cells)

    def tally(self) -> Tally:
        windows = self.windows
        return Tally(
            documents=windows.documents,
            windows=windows.windows,
            mentions=windows.mentions,
            sentences_skipped=windows.skipped,
            # windows the corpus refused (tokenized in context, one came out too long)
            windows_skipped=Tally(self.corpus.skipped),
        )
