"""A treebank as model inputs: tokenized, aligned to words, filtered and batched."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import datasets
import torch
from transformers import PreTrainedTokenizerBase

from probe.alignment import word_tokenizer
from probe.treebank import RELATIONS, Sentence

RELATION_ID = {r: i for i, r in enumerate(RELATIONS)}
TOO_LONG = "longer than the model's maximum length"
NO_TOKENS = "a word has no tokens"


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
    index: torch.Tensor  # [batch] sentence number in the corpus

    @property
    def special(self) -> torch.Tensor:
        """Bool ``[batch, pos]``: real tokens that belong to no word ([CLS], [SEP], <s>…)."""
        return (self.word_of_token < 0) & self.attention_mask.bool()

    @property
    def inputs(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask}

    def to(self, device: torch.device | str) -> Batch:
        return Batch(**{k: v.to(device) for k, v in vars(self).items()})


@dataclass
class Corpus:
    """Encoded sentences, and how many were skipped and why."""

    dataset: datasets.Dataset
    sentences: list[Sentence]
    skipped: Counter

    def __post_init__(self) -> None:
        # One conversion from Arrow to Python lists; batches are then cut from the lists.
        self.columns = self.dataset.to_dict()

    def batches(self, batch_size: int, max_cells: int | None = None) -> Iterator[Batch]:
        """Batches of similar length (less padding), in a fixed order.

        Parameters
        ----------
        batch_size : int
            At most this many sentences per batch.
        max_cells : int, optional
            At most this many attention cells (sentences x tokens²) per batch, so that long
            sentences come in smaller batches and memory stays bounded by one batch whatever
            the corpus holds; default ``batch_size * 24²``.
        """
        for group in self.groups(batch_size, max_cells):
            yield collate({k: [v[i] for i in group] for k, v in self.columns.items()})

    def groups(self, batch_size: int, max_cells: int | None = None) -> list[list[int]]:
        """The sentence indices of each batch that ``batches`` yields."""
        max_cells = max_cells or batch_size * 24 * 24
        lengths = self.columns["length"]
        order = sorted(range(len(lengths)), key=lengths.__getitem__)
        groups: list[list[int]] = []
        for i in order:
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

    def __len__(self) -> int:
        return len(self.dataset)


def max_tokens(model_config, tokenizer: PreTrainedTokenizerBase) -> int:
    limits = [getattr(model_config, "max_position_embeddings", None), tokenizer.model_max_length]
    return min(int(x) for x in limits if x and x < 1e9) if any(limits) else 512


def encode(
    sentences: list[Sentence], tokenizer: PreTrainedTokenizerBase, max_length: int
) -> Corpus:
    """Tokenize pre-split words, align tokens to words, and drop what cannot be scored.

    Sentences with more than ``max_length`` tokens, or with a word that gets no token, are
    skipped and counted in ``Corpus.skipped`` (never truncated: that would silently cut trees).
    """
    tok = word_tokenizer(tokenizer)
    table = datasets.Dataset.from_dict(
        {
            "index": list(range(len(sentences))),
            "words": [s.words for s in sentences],
            "heads": [[h - 1 for h in s.heads] for s in sentences],
            "relations": [[RELATION_ID[r] for r in s.relations] for s in sentences],
            "punct": [[u == "PUNCT" for u in s.upos] for s in sentences],
        }
    )

    def tokenize(rows):
        encoded = tok(rows["words"], is_split_into_words=True, truncation=False)
        word_ids = [
            [-1 if w is None else w for w in encoded.word_ids(i)] for i in range(len(rows["words"]))
        ]
        n_words = [len(w) for w in rows["words"]]
        covered = [
            len({w for w in ids if w >= 0}) == n for ids, n in zip(word_ids, n_words, strict=True)
        ]
        return {
            "input_ids": encoded["input_ids"],
            "word_of_token": word_ids,
            "length": [len(ids) for ids in encoded["input_ids"]],
            "covered": covered,
        }

    table = table.map(tokenize, batched=True, desc="tokenizing", keep_in_memory=True)
    skipped = Counter()
    for length, covered in zip(table["length"], table["covered"], strict=True):
        if length > max_length:
            skipped[TOO_LONG] += 1
        elif not covered:
            skipped[NO_TOKENS] += 1
    keep = [
        i
        for i, (n, c) in enumerate(zip(table["length"], table["covered"], strict=True))
        if n <= max_length and c
    ]
    return Corpus(table.select(keep), sentences, skipped)


def collate(rows: dict[str, list]) -> Batch:
    def pad(key: str, value: int, dtype=torch.long) -> torch.Tensor:
        seqs = rows[key]
        width = max(len(s) for s in seqs)
        return torch.tensor([list(s) + [value] * (width - len(s)) for s in seqs], dtype=dtype)

    input_ids = pad("input_ids", 0)
    lengths = torch.tensor(rows["length"])
    return Batch(
        input_ids=input_ids,
        attention_mask=(torch.arange(input_ids.shape[1])[None] < lengths[:, None]).long(),
        word_of_token=pad("word_of_token", -1),
        heads=pad("heads", -1).clamp(min=-1),
        relations=pad("relations", -1),
        punct=pad("punct", False, torch.bool),
        n_words=torch.tensor([len(w) for w in rows["words"]]),
        index=torch.tensor(rows["index"]),
    )
