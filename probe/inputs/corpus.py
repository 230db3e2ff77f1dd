"""A treebank as model inputs, streamed: tokenized, aligned to words, filtered and batched.

Sentences are read lazily and handled a chunk at a time (tokenized together, then sorted by
length so that batches carry little padding), so memory is bounded by one chunk whatever the
size of the treebank, and reading stops as soon as the caller stops asking for batches.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from itertools import islice

import torch
from transformers import PreTrainedTokenizerBase

from probe.inputs.alignment import word_tokenizer
from probe.inputs.treebank import RELATIONS, Sentence

RELATION_ID = {r: i for i, r in enumerate(RELATIONS)}
TOO_LONG = "longer than the model's maximum length"
NO_TOKENS = "a word has no tokens"
CHUNK_SENTENCES = 2048  # sentences tokenized and length-sorted together
UNKNOWN_MAX_TOKENS = 512  # when neither the model nor the tokenizer states a limit
CELLS_PER_SENTENCE = 24 * 24  # attention cells a batch may hold per sentence of its size


@dataclass
class Batch:
    """Model inputs for a batch of sentences, with their trees aligned to tokens.

    Tokens are ``[batch, pos]``, words ``[batch, word]``; word indices are 0-based and -1 pads.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    word_of_token: torch.Tensor  # word of each token; -1 for special tokens and padding
    heads: torch.Tensor  # 0-based head word; -1 for the root and padding
    relations: torch.Tensor  # index into RELATIONS; -1 for padding
    punct: torch.Tensor  # bool: the word is punctuation (UPOS PUNCT)
    n_words: torch.Tensor  # [batch]
    index: torch.Tensor  # [batch] the sentence's 0-based position in the treebank
    sentences: list[Sentence] = field(default_factory=list)  # in batch order
    unit: str = "sentence"  # the input unit that made it (``probe.inputs.units``)
    # How far it moves its unit's progress bar, where not by its length (``Unit.size``): a
    # corpus's bar counts texts, not windows.
    progress: int | None = None

    @property
    def special(self) -> torch.Tensor:
        """Bool ``[batch, pos]``: real tokens that belong to no word ([CLS], [SEP], <s>…)."""
        return (self.word_of_token < 0) & self.attention_mask.bool()

    @property
    def inputs(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask}

    def __len__(self) -> int:
        return len(self.n_words)

    def to(self, device: torch.device | str) -> Batch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return Batch(**{k: v.to(device) if torch.is_tensor(v) else v for k, v in moved.items()})


@dataclass
class _Encoded:
    """One sentence, tokenized."""

    index: int
    sentence: Sentence
    input_ids: list[int]
    word_of_token: list[int]


class Corpus:
    """Sentences streamed as batches; counts what was read, analysed and skipped, and why.

    Parameters
    ----------
    sentences : iterable of Sentence
        Read lazily, once per call of ``batches`` (a list can be passed over again).
    tokenizer : PreTrainedTokenizerBase
        A fast tokenizer (word alignment needs ``word_ids``).
    max_length : int
        Sentences with more tokens than this, special tokens included, are skipped (never
        truncated: that would silently cut trees).
    max_sentences : int, optional
        Stop reading after this many sentences.
    chunk_size : int
        Sentences tokenized and sorted by length together.
    shard : (int, int)
        ``(rank, size)``: only the sentences whose index in the treebank is ``rank`` modulo
        ``size`` (one process's share, ``probe.distributed``); the counters count those alone.
    """

    def __init__(
        self,
        sentences: Iterable[Sentence],
        tokenizer: PreTrainedTokenizerBase,
        max_length: int,
        *,
        max_sentences: int | None = None,
        chunk_size: int = CHUNK_SENTENCES,
        shard: tuple[int, int] = (0, 1),
    ) -> None:
        self.sentences = sentences
        self.tokenizer = word_tokenizer(tokenizer)
        self.max_length = max_length
        self.max_sentences = max_sentences
        self.chunk_size = chunk_size
        self.shard = shard
        self.read = self.analysed = self.words = 0
        self.skipped: Counter[str] = Counter()

    def batches(self, batch_size: int = 32, max_cells: int | None = None) -> Iterator[Batch]:
        """Batches of similar length (less padding), in an order fixed by the treebank.

        Parameters
        ----------
        batch_size : int
            At most this many sentences per batch.
        max_cells : int, optional
            At most this many attention cells (sentences x tokens²) per batch, so that long
            sentences come in smaller batches and memory stays bounded by one batch whatever
            the corpus holds; default ``batch_size * 24²``.
        """
        self.read = self.analysed = self.words = 0
        self.skipped = Counter()
        max_cells = max_cells or batch_size * CELLS_PER_SENTENCE
        rank, size = self.shard
        stream = islice(enumerate(islice(self.sentences, self.max_sentences)), rank, None, size)
        while chunk := list(islice(stream, self.chunk_size)):
            self.read += len(chunk)
            kept = self._encode(chunk)
            self.analysed += len(kept)
            self.words += sum(len(e.sentence.words) for e in kept)
            for group in _groups([len(e.input_ids) for e in kept], batch_size, max_cells):
                yield collate([kept[i] for i in group])

    def _encode(self, chunk: list[tuple[int, Sentence]]) -> list[_Encoded]:
        """Tokenize pre-split words, align tokens to words, and drop what cannot be scored."""
        encoded = self.tokenizer(
            [s.words for _, s in chunk],
            is_split_into_words=True,
            truncation=False,
            return_attention_mask=False,
            return_token_type_ids=False,
        )
        kept = []
        for row, (index, sentence) in enumerate(chunk):
            ids = encoded["input_ids"][row]
            word_ids = [-1 if w is None else w for w in encoded.word_ids(row)]
            if len(ids) > self.max_length:
                self.skipped[TOO_LONG] += 1
            elif len({w for w in word_ids if w >= 0}) < len(sentence.words):
                self.skipped[NO_TOKENS] += 1
            else:
                kept.append(_Encoded(index, sentence, ids, word_ids))
        return kept


def _groups(lengths: list[int], batch_size: int, max_cells: int) -> list[list[int]]:
    """Positions grouped into batches of similar length: sorted by length (stable), a batch
    closed when it holds ``batch_size`` sentences or would exceed ``max_cells``."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        group = groups[-1] if groups else None
        if (
            group is None
            or len(group) >= batch_size
            or (len(group) + 1) * lengths[i] ** 2 > max_cells
        ):
            groups.append([i])
        else:
            group.append(i)
    return groups


def max_tokens(model_config, tokenizer: PreTrainedTokenizerBase) -> int:
    """The longest input, special tokens included, that both the model and tokenizer accept."""
    limits = [getattr(model_config, "max_position_embeddings", None), tokenizer.model_max_length]
    known = [int(x) for x in limits if x and x < 1e9]  # tokenizers say 1e30 for "no limit"
    return min(known) if known else UNKNOWN_MAX_TOKENS


def collate(rows: list[_Encoded]) -> Batch:
    def pad(seqs: list[list], value, dtype=torch.long) -> torch.Tensor:
        width = max(len(s) for s in seqs)
        return torch.tensor([list(s) + [value] * (width - len(s)) for s in seqs], dtype=dtype)

    input_ids = pad([r.input_ids for r in rows], 0)
    lengths = torch.tensor([len(r.input_ids) for r in rows])
    sentences = [r.sentence for r in rows]
    return Batch(
        input_ids=input_ids,
        attention_mask=(torch.arange(input_ids.shape[1])[None] < lengths[:, None]).long(),
        word_of_token=pad([r.word_of_token for r in rows], -1),
        heads=pad([s.heads for s in sentences], -1),
        relations=pad([[RELATION_ID[r] for r in s.relations] for s in sentences], -1),
        punct=pad([[u == "PUNCT" for u in s.upos] for s in sentences], False, torch.bool),
        n_words=torch.tensor([len(s.words) for s in sentences]),
        index=torch.tensor([r.index for r in rows]),
        sentences=sentences,
    )
