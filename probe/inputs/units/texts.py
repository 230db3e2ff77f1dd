"""The text unit: windows of plain text from a corpus read through 🤗 datasets
(``probe.inputs.texts``),
for the analyses that need no annotation.

A corpus has no words of its own, and splitting it at spaces would invent them (code, Chinese,
punctuation glued to words): here every ordinary token is its own word, and a token is
punctuation when its characters are. That is all such an analysis reads: which tokens are
special (``Batch.special``), which are punctuation, and their positions.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from typing import TYPE_CHECKING, Any

from probe.distributed import Tally
from probe.inputs.units import Unit
from probe.lazy import lazy

if TYPE_CHECKING:
    from probe.inputs.corpus import Batch

torch = lazy("torch")

DEFAULT_CONTEXT = 512  # tokens per window unless --context says otherwise (or the model less)
CHUNK_WINDOWS = 256  # windows sorted by length together
# A batch holds at most a quarter of batch_size full windows, so that it is bounded by attention
# cells, as a batch of sentences is (``probe.inputs.units.windows``).
WINDOWS_PER_BATCH_SHARE = 4
EMPTY = "no tokens"


class Texts(Unit):
    """A corpus's texts, tokenized in batches and cut into windows of at most ``--context``
    tokens; the windows are shared between processes one in turn, in the corpus's order."""

    name = "text"
    label = "corpus windows"
    counted = "corpus texts"  # windows cannot be counted before the texts are tokenized
    input = "corpus"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.context = min(self.source.context or DEFAULT_CONTEXT, self.limit)
        self.texts = self.windows = self.tokens = self.empty = 0
        self.inexact: dict[str, int] = {}  # windows whose tokens may not be their text's, by why

    def size(self) -> int | None:
        """The texts to read (the progress bar counts texts, each batch its ``progress``), where
        the corpus's files tell without parsing (``probe.inputs.texts.count_texts``): every process
        reads every text, and keeps its share of their windows."""
        from probe.inputs.texts import count_texts

        if self.stop is not None or (texts := count_texts(self.source.corpus)) is None:
            return None
        limit = self.source.max_texts
        return texts if limit is None else min(texts, limit)

    def batches(self, batch_size: int) -> Iterator[Batch]:
        """Batches of windows of similar length, in an order fixed by the corpus; the first
        batch of each chunk of windows moves the progress bar by the texts cut for the chunk."""
        from probe.inputs.corpus import _groups
        from probe.inputs.texts import windows
        from probe.inputs.windowing import special_tokens

        self.texts = self.windows = self.tokens = self.empty = 0
        self.inexact = {}
        source = self.source
        stream = windows(source.corpus, self.tokenizer, self.context, max_texts=source.max_texts,
                         stop=self.stop, shard=self.shard)  # fmt: skip
        first = len(special_tokens(self.tokenizer)[0])
        cells = max(batch_size * self.context**2 // WINDOWS_PER_BATCH_SHARE, self.context**2)
        total, reached, owed = self.size(), 0, 0  # texts: the progress bar's count
        for chunk, last in _chunks(stream):
            self.texts += sum(row["window"] == 0 for row in chunk)
            # every text is cut by the end, though this process may not see its last windows
            cut = total if last and total is not None else chunk[-1]["text"] + 1
            owed, reached = owed + cut - reached, cut
            kept = [row for row in chunk if row["input_ids"]]
            self.empty += len(chunk) - len(kept)
            self.windows += len(kept)
            self.tokens += sum(len(row["punct"]) for row in kept)
            for row in chunk:
                if row["inexact"]:
                    self.inexact[row["inexact"]] = self.inexact.get(row["inexact"], 0) + 1
            for group in _groups([len(row["input_ids"]) for row in kept], batch_size, cells):
                batch = collate([kept[i] for i in group], first)
                batch.progress, owed = owed, 0
                yield batch

    def tally(self) -> Tally:
        """Texts, windows, tokens, the empty texts skipped, and, where a long text had to be
        cut where its tokens may differ from its whole's (``probe.inputs.pieces``), how many
        windows hold such a cut, by reason (``inexact``, absent when none)."""
        inexact = {"inexact": Tally(self.inexact)} if self.inexact else {}
        return Tally(texts=self.texts, windows=self.windows, tokens=self.tokens,
                     skipped=Tally({EMPTY: self.empty} if self.empty else {}),
                     **inexact)  # fmt: skip


def _chunks(stream: Iterator[dict[str, Any]]) -> Iterator[tuple[list[dict[str, Any]], bool]]:
    """The windows in chunks of ``CHUNK_WINDOWS``, each with whether it is the last."""
    chunk = list(islice(stream, CHUNK_WINDOWS))
    while chunk:
        following = list(islice(stream, CHUNK_WINDOWS))
        yield chunk, not following
        chunk = following


def collate(rows: list[dict[str, Any]], first: int) -> Batch:
    """A batch of windows, each ``first`` special tokens, its text, then the closing ones: each
    text token its own word, the special tokens none (-1)."""
    from probe.inputs.corpus import Batch

    B, T = len(rows), max(len(r["input_ids"]) for r in rows)
    W = max(len(r["punct"]) for r in rows)
    ids = torch.zeros(B, T, dtype=torch.long)
    word = torch.full((B, T), -1)
    punct = torch.zeros(B, W, dtype=torch.bool)
    for b, row in enumerate(rows):
        n, words = len(row["input_ids"]), len(row["punct"])
        ids[b, :n] = torch.tensor(row["input_ids"])
        word[b, first : first + words] = torch.arange(words)
        punct[b, :words] = torch.tensor(row["punct"], dtype=torch.bool)
    lengths = torch.tensor([len(r["input_ids"]) for r in rows])
    empty = torch.zeros(B, 0, dtype=torch.long)
    return Batch(
        input_ids=ids,
        attention_mask=(torch.arange(T)[None] < lengths[:, None]).long(),
        word_of_token=word,
        heads=empty,
        relations=empty,
        punct=punct,
        n_words=torch.tensor([len(r["punct"]) for r in rows]),
        index=torch.tensor([r["index"] for r in rows]),
        unit="text",
    )
