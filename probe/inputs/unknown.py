"""How much of a treebank or corpus the tokenizer cannot read: the share of its words that become
the unknown token and nothing else.

A toy vocabulary reading English (``tests/data/induction-gpt2``'s 64 symbols) turns most words
into the unknown token: "The cat sat" is four of them with the BOS. An analysis of that text
would measure where the heads look among copies of one token, whatever the words were, so the
run measures the share on the input's first ``SAMPLE_WORDS`` words before it streams, records it
in ``run.json``, and skips the analyses of that input where more than ``MOSTLY_UNKNOWN`` of them
are unknown (``probe.app.execute``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any

MOSTLY_UNKNOWN = 0.5  # above this share of words unknown, an input is one the model cannot read
SAMPLE_WORDS = 5000  # words read from the input's start to measure the share
TEXTS = 200  # at most this many texts of a corpus read for them


def unknown_words(tokenizer: Any, words: Iterable[str]) -> dict[str, Any]:
    """How many of ``words`` (the first ``SAMPLE_WORDS``) the tokenizer turns into its unknown
    token alone, each tokenized by itself without special tokens.

    Returns
    -------
    dict
        ``words`` (read), ``unknown`` (of them) and ``share`` (unknown / words; 0 for none read).
        A tokenizer without an unknown token (byte-level BPE) reads every word.
    """
    sample = list(islice(words, SAMPLE_WORDS))
    unknown = 0
    unk = getattr(tokenizer, "unk_token_id", None)
    if sample and unk is not None:
        ids = tokenizer(sample, add_special_tokens=False)["input_ids"]
        unknown = sum(1 for pieces in ids if pieces and all(i == unk for i in pieces))
    share = unknown / len(sample) if sample else 0.0
    return {"words": len(sample), "unknown": unknown, "share": round(share, 4)}


def treebank_words(sentences: Iterable[Any]) -> Iterator[str]:
    """The words of a treebank's sentences (``probe.inputs.treebank.Sentence``), in order."""
    for sentence in sentences:
        yield from sentence.words


def corpus_words(texts: Iterable[dict]) -> Iterator[str]:
    """The whitespace-separated words of a corpus's texts (rows with a ``text``), in order."""
    for row in islice(texts, TEXTS):
        yield from (row.get("text") or "").split()
