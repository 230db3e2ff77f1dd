"""The repeated-sequence unit: BOS, n random tokens, then the same n tokens again (Olsson et al.
2022), each beside its null: the same first half followed by n fresh random tokens.

Position 0 is the BOS (an encoder's [CLS]-like first token), the first copy is at 1…n and the
second at n+1…2n; an encoder's closing special tokens follow. Tokens are drawn uniformly, with
replacement, from the vocabulary without its special tokens, by a generator keyed to the run's
seed and the sequence's index: the same sequences whatever the batches or processes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from probe.distributed import Tally
from probe.errors import ProbeError
from probe.inputs.units import Unit
from probe.lazy import lazy
from probe.options import Option

if TYPE_CHECKING:
    from probe.inputs.corpus import Batch

np = lazy("numpy")
torch = lazy("torch")

SEQUENCES = Option("repeat_sequences", 200, "Repeated random sequences (and as many nulls).", min=1)
LENGTH = Option("repeat_length", 50, "Random tokens in each half of a repeated sequence.", min=2)


class RepeatedSequences(Unit):
    """Pairs of token sequences: a repeat (index 2s) and its null (index 2s + 1)."""

    name = "repeats"
    label = "repeated sequences"
    options = (SEQUENCES, LENGTH)
    input = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.n = self.settings["repeat_length"]
        self.sequences = self.settings["repeat_sequences"]
        self.vocabulary = ordinary_tokens(self.tokenizer)
        self.first, self.last = specials(self.tokenizer)
        self.length = length = len(self.first) + 2 * self.n + len(self.last)
        if length > self.limit:
            raise ProbeError(
                f"--repeat-length {self.n} makes sequences of {length} tokens, longer than the "
                f"model's {self.limit}; use at most {(self.limit - 1 - len(self.last)) // 2}"
            )
        self.read = 0

    def size(self) -> int:
        rank, size = self.shard
        return 2 * len(range(rank, self.sequences, size))

    def pair(self, index: int) -> tuple[list[int], list[int]]:
        """Sequence ``index``'s repeat and null, as token ids with the special tokens."""
        first, fresh = halves(self.source.seed, index, self.vocabulary, self.n)
        return [*self.first, *first, *first, *self.last], [*self.first, *first, *fresh, *self.last]

    def batches(self, batch_size: int) -> Iterator[Batch]:
        """Batches of whole pairs (at least one pair per batch), in the order of their index."""
        self.read = 0
        rank, size = self.shard
        mine = range(rank, self.sequences, size)  # a range, not a list: any count streams
        per_batch = max(1, batch_size // 2)
        for start in range(0, len(mine), per_batch):
            chosen = mine[start : start + per_batch]
            rows = [row for index in chosen for row in self.pair(index)]
            self.read += len(chosen)
            yield _batch(rows, [i for index in chosen for i in (2 * index, 2 * index + 1)])

    def tally(self) -> Tally:
        return Tally(sequences=self.read, tokens=self.read * 2 * self.length)


def ordinary_tokens(tokenizer) -> np.ndarray:
    """The ids of the vocabulary without special tokens, ascending."""
    special = set(tokenizer.all_special_ids)
    return np.array([i for i in range(len(tokenizer)) if i not in special])


def halves(seed: int, index: int, vocabulary: np.ndarray, n: int) -> tuple[list[int], list[int]]:
    """Sequence ``index``'s random tokens: its first half (the repeat's both halves) and its
    null's fresh second half, ``n`` token ids each drawn from ``vocabulary`` (``[vocab]``) by a
    generator keyed to ``seed`` and ``index``."""
    rng = np.random.default_rng([seed, index])
    first, fresh = rng.choice(vocabulary, size=(2, n))
    return first.tolist(), fresh.tolist()


def specials(tokenizer) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer puts before and after a sequence, with a BOS first even
    where it adds none (GPT-2): the token every query can attend to at position 0."""
    from probe.inputs.windowing import special_tokens

    before, after = special_tokens(tokenizer)
    if not before:
        bos = next(
            (t for t in (tokenizer.bos_token_id, tokenizer.cls_token_id, tokenizer.eos_token_id)
             if t is not None), None,
        )  # fmt: skip
        if bos is None:
            raise ProbeError("the tokenizer has no BOS, CLS or EOS token to begin sequences with")
        before = [bos]
    return before[-1:], after


def _batch(rows: list[list[int]], index: list[int]) -> Batch:
    """A batch of equal-length token sequences that belong to no treebank (no words)."""
    from probe.inputs.corpus import Batch

    ids = torch.tensor(rows)
    B, T = ids.shape
    empty = torch.zeros(B, 0, dtype=torch.long)
    return Batch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        word_of_token=torch.full((B, T), -1),
        heads=empty,
        relations=empty,
        punct=empty.bool(),
        n_words=torch.zeros(B, dtype=torch.long),
        index=torch.tensor(index),
        unit="repeats",
    )
