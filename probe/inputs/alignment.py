"""From treebank words to model tokens and back: tokenization of pre-split words, and word-level
attention (Clark et al. 2019)."""

from __future__ import annotations

import copy
import json

import torch
from transformers import PreTrainedTokenizerBase


def word_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """A tokenizer that tokenizes pre-split words as they appear inside a sentence.

    Byte-level BPE (GPT-2, RoBERTa) marks a word's leading space in its first token, so pre-split
    words must each get a prefix space, or every word is tokenized as if it began the text.
    Returns a copy with that set when needed; the caller's tokenizer is left as it is.
    """
    if not tokenizer.is_fast:
        raise ValueError("word alignment needs a fast tokenizer (with word_ids)")
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    pre = state.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    byte_level = [p for p in parts if p and p.get("type") == "ByteLevel"]
    if not byte_level or all(p.get("add_prefix_space") for p in byte_level):
        return tokenizer
    for p in byte_level:
        p["add_prefix_space"] = True
    fixed = copy.deepcopy(tokenizer)
    from tokenizers import Tokenizer

    fixed._tokenizer = Tokenizer.from_str(json.dumps(state))
    if hasattr(fixed, "add_prefix_space"):
        fixed.add_prefix_space = True
    return fixed


class WordAlignment:
    """One batch's maps between tokens and words, built once and applied to every layer.

    Parameters
    ----------
    word_of_token : ``[batch, pos]`` long
        The 0-based word of each token, -1 for tokens of no word.
    n_words : ``[batch]`` long
        Words per sentence.
    """

    def __init__(self, word_of_token: torch.Tensor, n_words: torch.Tensor) -> None:
        n = int(n_words.max())
        self.to_words, self.from_words = _maps(word_of_token, n)
        self.invalid = _invalid(n_words, n)[:, None]

    def words(self, pattern: torch.Tensor) -> torch.Tensor:
        """Word-level attention ``[batch, head, word, word]`` from ``[batch, head, q_pos, k_pos]``
        (see ``word_attention``)."""
        # Two matrix products per sentence, every head at once (a broadcast over heads would
        # run one small product per head).
        B, H, T, _ = pattern.shape
        n = self.to_words.shape[-1]
        to_words = (pattern.reshape(B, H * T, T) @ self.to_words).view(B, H, T, n)
        both = self.from_words @ to_words.transpose(1, 2).reshape(B, T, H * n)  # [B, n, H·n]
        return both.view(B, n, H, n).transpose(1, 2)

    def predictions(self, words: torch.Tensor) -> torch.Tensor:
        """Each head's predicted head word ``[batch, 2, head, word]`` (see ``head_predictions``)."""
        return _predict(words, self.invalid)


def _maps(word_of_token: torch.Tensor, n_words: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[batch, pos, word]`` summing a key's tokens, ``[batch, word, pos]`` averaging a
    query's tokens; tokens of no word have no column or row."""
    member = membership(word_of_token, n_words).float()  # [batch, word, pos]
    return member.transpose(1, 2), member / member.sum(-1, keepdim=True).clamp(min=1)


def _invalid(n_words: torch.Tensor, n: int) -> torch.Tensor:
    """Bool ``[batch, word, word]``: pairs no prediction may name. One symmetric mask serves both
    directions: padding rows, padding columns and self."""
    padding = torch.arange(n, device=n_words.device)[None, :] >= n_words[:, None]
    self_pairs = torch.eye(n, dtype=torch.bool, device=n_words.device)
    return padding[:, :, None] | padding[:, None, :] | self_pairs


def _predict(words: torch.Tensor, invalid: torch.Tensor) -> torch.Tensor:
    masked = words.masked_fill(invalid, -torch.inf)
    # max(...).indices: torch's argmax over a non-last dimension is several times slower.
    return torch.stack([masked.max(-1).indices, masked.max(-2).indices], dim=1)


def word_attention(
    pattern: torch.Tensor, word_of_token: torch.Tensor, n_words: int
) -> torch.Tensor:
    """Token-level attention to word-level attention, as Clark et al. (2019) do.

    Attention *to* a word split into several tokens is the sum over its tokens; attention *from*
    it is the mean over its tokens. Tokens of no word (special tokens, padding) are dropped, so
    rows need not sum to 1.

    Parameters
    ----------
    pattern : ``[batch, ..., q_pos, k_pos]``
        Attention weights (any number of head dimensions, e.g. layer and head).
    word_of_token : ``[batch, pos]`` long
        The 0-based word of each token, -1 for tokens of no word.
    n_words : int
        Words per sentence to return (the batch's maximum).

    Returns
    -------
    torch.Tensor ``[batch, ..., n_words, n_words]``
        Entry [i, j] is the attention from word i to word j.
    """
    to_words, from_words = (m.to(pattern.dtype) for m in _maps(word_of_token, n_words))
    extra = (1,) * (pattern.dim() - 3)  # head dimensions
    to_words = to_words.view(to_words.shape[0], *extra, *to_words.shape[1:])
    from_words = from_words.view(from_words.shape[0], *extra, *from_words.shape[1:])
    return from_words @ (pattern @ to_words)


def membership(word_of_token: torch.Tensor, n_words: int) -> torch.Tensor:
    """Bool ``[batch, word, pos]``: token ``pos`` belongs to word ``word``."""
    words = torch.arange(n_words, device=word_of_token.device)
    return word_of_token[:, None, :] == words[None, :, None]


def head_predictions(words: torch.Tensor, n_words: torch.Tensor) -> torch.Tensor:
    """Each head's predicted syntactic head for every word, both directions.

    Parameters
    ----------
    words : ``[batch, heads, word, word]``
        Word-level attention (from row word to column word).
    n_words : ``[batch]``

    Returns
    -------
    torch.Tensor ``[batch, 2, heads, word]`` long
        Direction 0 (dependent -> head): the word that word i attends to most. Direction 1
        (head -> dependent): the word that attends most to word i. Self is excluded.
    """
    return _predict(words, _invalid(n_words, words.shape[-1])[:, None])
