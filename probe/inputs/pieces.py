"""A long text tokenized in pieces, giving the tokens of the whole text, in bounded memory.

Tokenizing a text of millions of characters at once holds every token, its offsets and the
tokenizer's own records of them (a hundred times the text's size), and cannot be interrupted
until it ends. Here the text is read in pieces of about ``PIECE_CHARS`` characters. Each piece is
tokenized from a cut point to the end of what has been read, and only its tokens that end
before the last *cut point* of the piece are given; the rest is read again with the next piece.

A cut point is a single space between two characters that are not whitespace. Every tokenizer
family probe meets splits a text there, whatever comes before: WordPiece drops the space
between words, byte-level BPE starts a word with it (`` cat``, and a run of spaces gives its
last one to the next word, which is why a run is no cut point), unigram's metaspace starts a
word with ``▁``. So the tokens before the cut are the whole text's, and tokenizing again from
the cut gives the whole text's tokens after it.

Each piece is also checked: it is tokenized from the cut point before the last one, and the
word between the two must give the same tokens it gave before (a tokenizer that treats the
start of a text apart, or whose tokens at a space depend on what precedes it, would not), and
no token may cross a cut. A text with no cut point for ``UNSPACED_CHARS`` characters (a base64
blob, Chinese) is cut inside a word, at a token boundary near the middle of what was read:
there its tokens may differ from the whole text's. Both are said: each window holding such a
cut carries the reason, which the run counts in its record (``Texts.tally``).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterator

PIECE_CHARS = 1 << 14  # characters of a long text tokenized at once (besides what is carried)
CONTEXT_CHARS = 256  # the word before a cut, tokenized again to check the cut: at most this
UNSPACED_CHARS = 1 << 16  # characters read without a cut point before a cut inside a word
INSIDE_A_WORD = f"cut inside a word (no space for {UNSPACED_CHARS:,} characters)"
NOT_LOCAL = "cut at a space where the tokenizer's tokens depend on the text before it"


def tokens_in_pieces(
    tokenizer, chunks: Iterator[str]
) -> Iterator[tuple[list[int], list[bool], str]]:
    """The tokens of the text made of ``chunks`` (no special tokens), in runs: each run's ids,
    which of them are punctuation, and why the cut before the run may have changed the tokens
    the whole text would give there ("" where it did not).

    Parameters
    ----------
    tokenizer : PreTrainedTokenizerBase
    chunks : iterator of str
        The text, in pieces of any size: memory grows with the largest piece, not the text.
    """
    text = ""  # read and not yet given: its tokens before ``keep`` were given already
    keep, given, why, first, ended = 0, [], "", True, False  # given: those tokens' ids
    while True:
        cut, inside = None, False
        while cut is None:
            if not ended and (
                len(text) - keep < PIECE_CHARS
                or (
                    len(text) < UNSPACED_CHARS
                    and _last_space(text, keep + 1, len(text) - 1) is None
                )
            ):
                chunk = next(chunks, None)
                ended = chunk is None
                text += chunk or ""
            elif ended:
                cut = len(text)
            elif (cut := _last_space(text, keep + 1, len(text) - 1)) is None:
                cut, inside = len(text) // 2, True
        if not tokenizer.is_fast:  # no offsets: the span between the cuts alone, unchecked
            ids, punct = _slow(tokenizer, text[keep:cut])
            yield ids, punct, why
            if ended and cut == len(text):
                return
            text, keep, why = text[cut:], 0, INSIDE_A_WORD if inside else ""
            continue
        ids, offsets = _encode(tokenizer, text)
        if inside:  # the token boundary nearest the middle, past what was given
            starts = [a for a, _ in offsets if keep < a < len(text)]
            cut = min(starts, key=lambda a: abs(a - cut), default=cut)
        if _ending(ids, offsets, 0, keep) != given or _crosses(offsets, keep):
            why = why or NOT_LOCAL
        run = [(i, a, b) for i, (a, b) in zip(ids, offsets, strict=True)
               if (first or keep < b) and b <= cut]  # fmt: skip
        yield [i for i, _, _ in run], [punctuation(text[a:b]) for _, a, b in run], why
        if ended and cut == len(text):
            return
        why = INSIDE_A_WORD if inside else NOT_LOCAL if _crosses(offsets, cut) else ""
        start = None if inside else _last_space(text, max(keep, cut - CONTEXT_CHARS, 1), cut)
        start = cut if start is None else start  # else nothing to check the next cut with
        given = _ending(ids, offsets, start, cut)
        text, keep, first = text[start:], cut - start, False


def _ending(ids: list[int], offsets: list[tuple[int, int]], start: int, cut: int) -> list[int]:
    """The ids of the tokens that end after ``start`` and not after ``cut``, in order."""
    return [i for i, (_, b) in zip(ids, offsets, strict=True) if start < b <= cut]


def _crosses(offsets: list[tuple[int, int]], point: int) -> bool:
    """Whether a token holds characters on both sides of ``point``."""
    return any(a < point < b for a, b in offsets)


def _slow(tokenizer, text: str) -> tuple[list[int], list[bool]]:
    """A tokenizer without offsets: its ids of ``text``, each decoded alone for punctuation."""
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return ids, [punctuation(tokenizer.decode([i])) for i in ids]


def _encode(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """The text's token ids (no special tokens) and each one's characters."""
    encoded = tokenizer(
        text,
        add_special_tokens=False,
        return_offsets_mapping=True,
        return_attention_mask=False,
        return_token_type_ids=False,
        verbose=False,
    )
    return encoded["input_ids"], encoded["offset_mapping"]


def _last_space(text: str, lo: int, hi: int) -> int | None:
    """The last cut point in ``text[lo:hi]``: a space between two characters that are not
    whitespace (``1 <= lo``, ``hi < len(text)``), or None."""
    at = text.rfind(" ", lo, hi)
    while at >= lo:
        if not text[at - 1].isspace() and not text[at + 1].isspace():
            return at
        at = text.rfind(" ", lo, at)
    return None


def punctuation(text: str) -> bool:
    """Whether a token's characters, spaces aside, are all Unicode punctuation (category P)."""
    text = "".join(text.split())
    return bool(text) and all(unicodedata.category(c).startswith("P") for c in text)
