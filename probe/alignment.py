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
    member = membership(word_of_token, n_words).to(pattern.dtype)  # [batch, word, pos]
    tokens = member.sum(-1, keepdim=True).clamp(min=1)
    extra = pattern.dim() - 3
    shape = (member.shape[0],) + (1,) * extra + member.shape[1:]
    to_words = pattern @ member.view(shape).transpose(-1, -2)  # sum over the key's tokens
    return (member / tokens).view(shape) @ to_words  # mean over the query's tokens


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
    n = words.shape[-1]
    padding = torch.arange(n, device=words.device)[None, :] >= n_words[:, None]  # [batch, word]
    # One symmetric mask serves both directions: padding rows, padding columns and self.
    invalid = (
        padding[:, :, None]
        | padding[:, None, :]
        | torch.eye(n, dtype=torch.bool, device=words.device)
    )
    masked = words.masked_fill(invalid[:, None], -torch.inf)
    # max(...).indices: torch's argmax over a non-last dimension is several times slower.
    return torch.stack([masked.max(-1).indices, masked.max(-2).indices], dim=1)
