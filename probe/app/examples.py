"""Example attention maps for the report's head cards: a few real treebank sentences, and for
each head the one that best shows what it does (for a syntactic head, the sentence where it gets
its best relation right most often).

The candidates are the first ``n_candidates`` sentences of the treebank (by position, whatever
order the batches come in) of a readable length; their token-level patterns are kept, layer by
layer, so memory is fixed whatever the corpus size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from transformers import PreTrainedTokenizerBase

from analyses.vocabulary import Direction
from probe.corpus import Batch
from probe.heads import HeadId
from probe.runner import LayerCapture
from probe.treebank import Sentence

N_CANDIDATES = 12
WORDS = (5, 14)  # a readable sentence has this many words…
MAX_TOKENS = 32  # …and at most this many tokens


@dataclass
class _Candidate:
    index: int
    sentence: Sentence
    tokens: list[str]
    word_of_token: list[int]
    pattern: np.ndarray  # [layer, head, q_pos, k_pos]
    predicted: np.ndarray  # [direction, layer, head, word]


class Examples:
    """Token-level attention of every head on a few short sentences (a stream consumer)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        n_layers: int,
        n_heads: int,
        *,
        n_candidates: int = N_CANDIDATES,
    ) -> None:
        self.tokenizer, self.n_layers, self.n_heads = tokenizer, n_layers, n_heads
        self.n_candidates = n_candidates
        self.candidates: dict[int, _Candidate] = {}  # by sentence index
        self._now: list[tuple[int, _Candidate]] = []

    def begin_batch(self, batch: Batch) -> None:
        self._now = []
        for b in range(len(batch)):
            n_tokens, n_words = int(batch.attention_mask[b].sum()), int(batch.n_words[b])
            if not (WORDS[0] <= n_words <= WORDS[1]) or n_tokens > MAX_TOKENS:
                continue
            index = int(batch.index[b])
            if len(self.candidates) >= self.n_candidates and index > max(self.candidates):
                continue
            candidate = _Candidate(
                index=index,
                sentence=batch.sentences[b],
                tokens=self.tokenizer.convert_ids_to_tokens(batch.input_ids[b, :n_tokens].tolist()),
                word_of_token=batch.word_of_token[b, :n_tokens].tolist(),
                pattern=np.zeros((self.n_layers, self.n_heads, n_tokens, n_tokens), np.float32),
                predicted=np.zeros((2, self.n_layers, self.n_heads, n_words), np.int64),
            )
            self.candidates[index] = candidate
            self._now.append((b, candidate))
            while len(self.candidates) > self.n_candidates:
                del self.candidates[max(self.candidates)]
        self._now = [(b, c) for b, c in self._now if self.candidates.get(c.index) is c]

    def update(self, batch: Batch, layer: int, capture: LayerCapture) -> None:
        for b, candidate in self._now:
            T, n = candidate.pattern.shape[-1], candidate.predicted.shape[-1]
            candidate.pattern[layer] = capture.pattern[b, :, :T, :T].cpu().numpy()
            candidate.predicted[:, layer] = capture.predictions[b, :, :, :n].cpu().numpy()

    def end_batch(self, batch: Batch) -> None:
        self._now = []

    def __getstate__(self) -> dict:
        """The candidates, for a merge in another process; not the tokenizer."""
        return {k: v for k, v in self.__dict__.items() if k not in ("tokenizer", "_now")}

    def merge(self, other: Examples) -> None:
        self.candidates.update(other.candidates)
        while len(self.candidates) > self.n_candidates:
            del self.candidates[max(self.candidates)]

    def choose(self, heads: pd.DataFrame) -> dict:
        """``examples.json``: the candidate sentences (heads 0-based, -1 for the root), and per
        head (keyed ``"layer.head"``) its sentence and pattern."""
        candidates = [self.candidates[i] for i in sorted(self.candidates)]
        if not candidates:
            return {"sentences": [], "heads": {}}
        sentences = [
            {
                "words": c.sentence.words,
                "heads": c.sentence.heads,
                "relations": c.sentence.relations,
                "tokens": c.tokens,
                "word_of_token": c.word_of_token,
            }
            for c in candidates
        ]
        longest = int(np.argmax([len(c.tokens) for c in candidates]))
        chosen = {}
        for row in heads.itertuples():
            head = HeadId(row.layer, row.head)
            relation = getattr(row, "best_relation", None)
            index, correct = longest, None  # the longest shows positional and sink heads best
            if isinstance(relation, str) and relation:
                direction = Direction(row.best_relation_direction).index
                hits = [_hits(c, direction, head, relation) for c in candidates]
                index = int(np.argmax(hits))
                correct = int(hits[index])
            pattern = candidates[index].pattern[head.layer, head.head]
            chosen[head.key] = {
                "sentence": index,
                "relation": relation if correct is not None else None,
                "correct": correct,
                "pattern": np.round(pattern, 3).tolist(),
            }
        return {"sentences": sentences, "heads": chosen}


def _hits(candidate: _Candidate, direction: int, head: HeadId, relation: str) -> int:
    """Words of ``relation`` whose head this head predicts in ``candidate``."""
    s = candidate.sentence
    predicted = candidate.predicted[direction, head.layer, head.head]
    return sum(
        1
        for i, (h, r) in enumerate(zip(s.heads, s.relations, strict=True))
        if r == relation and h >= 0 and predicted[i] == h
    )
