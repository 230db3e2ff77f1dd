"""A tiny GPT-2 whose heads are known, for validating head-type detectors.

`tests/data/induction-gpt2/` holds a 2-layer, 4-heads-per-layer GPT-2 (d_model 64, vocabulary
64) trained by `tests/support/make_induction_model.py` on `repeated` sequences: BOS (token 0), n
random tokens from 1..63, then the same n tokens again, n from 2 to 30 (`LENGTHS`). It learned the
induction circuit: a previous-token head in layer 0, and in layer 1 heads that attend from the
second copy of a token to the token that followed its first copy, and copy it. All four layer-1
heads do this (redundantly); `INDUCTION` is the one that does it most. The folder also holds a
word-level tokenizer over the symbols "t0".."t63" (token i is "ti"; "t0" is BOS, padding and
what unknown words become), which adds BOS in front of every text, so that
`probe analyze -m tests/data/induction-gpt2` runs on it.
"""

from __future__ import annotations

from pathlib import Path

import torch

MODEL = Path(__file__).parents[1] / "data" / "induction-gpt2"
# The same task on a Llama with grouped-query attention (4 query heads sharing 2 key/value heads
# per layer; d_model 64, heads 16 wide, rotary positions, tied embeddings), trained by
# tests/support/make_induction_llama.py. Second-copy loss at n = 20: 0.308 (fresh tokens 6.129,
# first copy 4.269). It learned induction with a longer stride than the textbook's: from the ninth
# position on, head (0, 1) attends 9 positions back and heads (0, 2), (0, 3) (which share a
# key/value head) 8 back, and the layer-1 heads attend from the second copy's token i to
# i - n + 9, the position whose token 9 back is the current one, and read the token 8 back from
# there, the one that followed the current one in the first copy. The circuit analysis's edges
# say so: (0, 1) feeds every layer-1 head's keys, (0, 2) and (0, 3) their values.
MODEL_GQA = Path(__file__).parents[1] / "data" / "induction-llama-gqa"
VOCAB = 64  # token 0 is BOS; the random tokens are 1..VOCAB-1
BOS = 0
LENGTHS = (2, 30)  # n, the length of one copy, was drawn from this range (inclusive) per sequence

# The heads, (layer, head) 0-based, found from the trained model's attention patterns on
# repeated(256, 20, VOCAB, seed=1) (make_induction_model.py prints every head's scores for n = 12,
# 20, 24, 25 and 30). Previous-token score, mean A[i, i-1] over queries i >= 1: 0.858 at n = 20
# (0.983 at n = 12, 0.764 at n = 25: it misses a few positions past 27); the next best head,
# (0, 1), 0.155.
PREVIOUS_TOKEN = (0, 0)
# Induction score, mean A[i, i-n+1] over the second copy's queries i >= n+1: 0.832 at n = 20
# (0.769 at n = 12, 0.809 at n = 25); the other layer-1 heads 0.665 to 0.701 (they do the same).
# Second-copy loss at n = 20: 0.214 (first copy 4.288); with this head zero-ablated 0.669.
INDUCTION = (1, 1)


def repeated(batch: int, n: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    """``[batch, 1 + 2n]`` token ids as trained on: BOS, n tokens drawn uniformly from
    1..vocab-1, and the same n tokens again. (Training drew n per sequence, padded each batch on
    the right to its longest and started positions at random offsets; see the training script.)"""
    g = torch.Generator().manual_seed(seed)
    first = torch.randint(1, vocab, (batch, n), generator=g)
    return torch.cat([torch.full((batch, 1), BOS), first, first], dim=1)


def fresh(batch: int, n: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    """The null for `repeated`: ``[batch, 1 + 2n]``, BOS, n random tokens, then n other random
    tokens (each differs from the one n positions before it, so nothing is repeated in place)."""
    g = torch.Generator().manual_seed(seed)
    first = torch.randint(1, vocab, (batch, n), generator=g)
    shift = torch.randint(1, vocab - 1, (batch, n), generator=g)  # 1..vocab-2
    second = (first - 1 + shift) % (vocab - 1) + 1  # in 1..vocab-1, never equal to first
    return torch.cat([torch.full((batch, 1), BOS), first, second], dim=1)


def copy_losses(logits: torch.Tensor, ids: torch.Tensor, n: int) -> tuple[float, float]:
    """Mean next-token loss over the first copy (predicting tokens 1..n from positions 0..n-1)
    and over the second copy's predictable tokens (predicting tokens n+2..2n from positions
    n+1..2n-1; the second copy's first token cannot be predicted from what precedes it)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    nll = -logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]  # [batch, 2n]: position i -> i+1
    return nll[:, :n].mean().item(), nll[:, n + 1 :].mean().item()


def previous_token_scores(patterns: torch.Tensor) -> torch.Tensor:
    """``[layer, head]``: mean attention A[i, i-1] over queries i >= 1, from patterns
    ``[layer, batch, head, q, k]``."""
    T = patterns.shape[-1]
    i = torch.arange(1, T)
    return patterns[..., i, i - 1].mean(dim=(1, 3))


def induction_scores(patterns: torch.Tensor, n: int) -> torch.Tensor:
    """``[layer, head]``: mean attention A[i, i-n+1] (the token after the first copy of the
    current one) over the second copy's queries i >= n+1, from patterns
    ``[layer, batch, head, q, k]`` on `repeated` sequences of copy length n."""
    i = torch.arange(n + 1, 2 * n + 1)
    return patterns[..., i, i - n + 1].mean(dim=(1, 3))


def symbol(word: str) -> str:
    """The model's symbol a word stands as: the same word, the same symbol (t1..t63)."""
    import zlib

    return f"t{1 + zlib.crc32(word.lower().encode()) % (VOCAB - 1)}"


def symbols_treebank(path: Path) -> Path:
    """The bundled sample treebank (its trees, relations and parts of speech) with every word
    replaced by its ``symbol``, written to ``path``: a treebank the model's vocabulary reads,
    where English would be its unknown token throughout (and a run would skip what reads it)."""
    from probe.inputs.treebank import SAMPLE

    lines = []
    for line in SAMPLE.read_text(encoding="utf-8").splitlines():
        fields = line.split("\t")
        if len(fields) == 10 and fields[0].isdigit():
            fields[1] = fields[2] = symbol(fields[1])
        lines.append("\t".join(fields))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
