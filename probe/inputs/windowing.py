"""Texts tokenized and cut into windows: each text's tokens in consecutive windows of at most the
context's tokens, the tokenizer's special tokens around each, as a text of its own would have
them; a long text tokenized in pieces as it is read (``probe.inputs.pieces``).

``Cutter`` cuts the texts ``probe.inputs.texts`` reads; ``special_tokens`` tells which tokens a
tokenizer puts around a text, and ``tokenize`` which of a text's tokens are punctuation.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from probe.errors import ProbeError
from probe.inputs.pieces import punctuation, tokens_in_pieces

TEXTS_PER_MAP = 256  # texts tokenized together


class Cutter:
    """Tokenizes texts and cuts each into consecutive windows of at most ``context`` tokens,
    the tokenizer's special tokens included (each window gets them, as a text of its own would).
    A text with no tokens gives one window with none, so that it is counted where it falls.
    Each window also carries ``text``, its text's place in the corpus, and ``inexact``: why its
    tokens may differ from those of its whole text ("" where they do not; ``probe.inputs.pieces``).

    Texts that come in one piece are tokenized ``TEXTS_PER_MAP`` together; a longer one is
    tokenized in pieces as it is read (``probe.inputs.pieces.tokens_in_pieces``)."""

    def __init__(self, tokenizer, context: int) -> None:
        self.tokenizer = tokenizer
        self.read = 0  # texts cut so far
        self.prefix, self.suffix = special_tokens(tokenizer)
        self.width = context - len(self.prefix) - len(self.suffix)
        if self.width < 1:
            raise ProbeError(f"--context {context} leaves no room for text beside the "
                             f"{context - self.width} special tokens; give more")  # fmt: skip

    def cut(self, pieces: Iterable[tuple[str, bool]]) -> Iterator[dict[str, Any]]:
        """The windows of the texts given as ``(piece, last)``: a text's pieces in order, the
        last one marked."""
        pieces, batch = iter(pieces), []
        for piece, last in pieces:
            if last:
                batch.append(piece)
                if len(batch) < TEXTS_PER_MAP:
                    continue
            yield from self._whole(batch)
            batch = []
            if not last:
                yield from self._long(_rest_of_text(piece, pieces))
        yield from self._whole(batch)

    def _whole(self, texts: list[str]) -> Iterator[dict[str, Any]]:
        """The windows of texts tokenized whole, together."""
        width = self.width
        for ids, punct in tokenize(self.tokenizer, texts) if texts else []:
            for w, start in enumerate(range(0, len(ids), width) if ids else [0]):
                yield self._window(ids[start : start + width], punct[start : start + width], w,
                                   bool(ids), "")  # fmt: skip
            self.read += 1

    def _long(self, chunks: Iterator[str]) -> Iterator[dict[str, Any]]:
        """The windows of a text tokenized in pieces: each as soon as its tokens are known."""
        ids, punct, w, why, any_tokens = [], [], 0, "", False
        for run, run_punct, cut in tokens_in_pieces(self.tokenizer, chunks):
            why, any_tokens = why or cut, any_tokens or bool(run)
            ids += run
            punct += run_punct
            while len(ids) >= self.width:
                yield self._window(ids[: self.width], punct[: self.width], w, True, why)
                ids, punct, w, why = ids[self.width :], punct[self.width :], w + 1, ""
        if ids or not any_tokens:
            yield self._window(ids, punct, w, any_tokens, why)
        self.read += 1

    def _window(self, ids: list[int], punct: list[bool], w: int, tokens: bool, why: str) -> dict:
        return {"input_ids": [*self.prefix, *ids, *self.suffix] if tokens else [],
                "punct": punct, "window": w, "text": self.read, "inexact": why}  # fmt: skip


def _rest_of_text(first: str, pieces: Iterator[tuple[str, bool]]) -> Iterator[str]:
    """A text's pieces: ``first``, then those of ``pieces`` up to its last."""
    yield first
    for piece, last in pieces:
        yield piece
        if last:
            return


def tokenize(tokenizer, batch: list[str]) -> list[tuple[list[int], list[bool]]]:
    """Each text's token ids (no special tokens) and which tokens are punctuation: those whose
    characters, spaces aside, are all Unicode punctuation (category P)."""
    if not tokenizer.is_fast:  # no offsets: each token decoded alone
        ids = tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"]
        return [(row, [punctuation(tokenizer.decode([i])) for i in row]) for row in ids]
    encoded = tokenizer(
        batch,
        add_special_tokens=False,
        return_offsets_mapping=True,
        return_attention_mask=False,
        return_token_type_ids=False,
        verbose=False,
    )
    rows = zip(batch, encoded["input_ids"], encoded["offset_mapping"], strict=True)
    return [(ids, [punctuation(text[a:b]) for a, b in offsets]) for text, ids, offsets in rows]


def special_tokens(tokenizer) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer puts before and after a text ([CLS] … [SEP]; none
    for GPT-2), as its own special-tokens mask tells them from the text's tokens: never by
    looking for a word's ids, which in a vocabulary without that word are the unknown token,
    itself special (and in some tokenizers the BOS too).

    Raises
    ------
    ProbeError
        When no sample text gives the tokenizer a token of text to place the others around.
    """
    for sample in SAMPLES:
        encoded = tokenizer(sample, return_special_tokens_mask=True, verbose=False)
        ids, special = encoded["input_ids"], encoded["special_tokens_mask"]
        text = [i for i, s in enumerate(special) if not s]
        if text:
            return list(ids[: text[0]]), list(ids[text[-1] + 1 :])
    raise ProbeError("the tokenizer turns no text into tokens; probe cannot tell its special "
                     "tokens from a text's")  # fmt: skip


# Texts the special tokens are placed around: one of them gives any tokenizer a token of text
# (an unknown one counts: the mask marks only what the tokenizer added).
SAMPLES = ("a", "the", "0", ".", "x y z")
