"""Example attention maps for the report: a few real treebank sentences, and for each head the one
that best shows what it does (for a syntactic head, the sentence where it gets its relation right
most often).

Keeps the token-level patterns of the first ``n_candidates`` sentences of a readable length, so
memory is fixed whatever the corpus size.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from transformers import PreTrainedTokenizerBase

from analyses.syntax import DIRECTIONS
from probe.alignment import Attention
from probe.corpus import Batch
from probe.treebank import RELATIONS, Sentence

name = "examples"


class ExampleCollector:
    """Token-level attention of every head on a few short sentences."""

    name = name

    def __init__(
        self,
        sentences: list[Sentence],
        tokenizer: PreTrainedTokenizerBase,
        *,
        n_candidates: int = 12,
        words: tuple[int, int] = (5, 14),
        max_tokens: int = 32,
    ):
        self.sentences, self.tokenizer = sentences, tokenizer
        self.n_candidates, self.words, self.max_tokens = n_candidates, words, max_tokens
        self.candidates: list[dict] = []

    def update(self, batch: Batch, attention: Attention) -> None:
        for b in range(len(batch.n_words)):
            if len(self.candidates) >= self.n_candidates:
                return
            n_tokens, n_words = int(batch.attention_mask[b].sum()), int(batch.n_words[b])
            if not (self.words[0] <= n_words <= self.words[1]) or n_tokens > self.max_tokens:
                continue
            pattern = attention.flat[b, :, :n_tokens, :n_tokens]  # [LH, T, T]
            word_of_token = batch.word_of_token[b, :n_tokens]
            predicted = attention.predictions[b, :, :, :n_words]  # [2, LH, n]
            sentence = self.sentences[int(batch.index[b])]
            self.candidates.append(
                {
                    "sentence": sentence,
                    "tokens": self.tokenizer.convert_ids_to_tokens(
                        batch.input_ids[b, :n_tokens].tolist()
                    ),
                    "word_of_token": word_of_token.tolist(),
                    "pattern": pattern.cpu().numpy().astype(np.float32),
                    "predicted": predicted.cpu().numpy(),
                }
            )

    def choose(self, heads: pd.DataFrame, n_heads: int) -> dict:
        """``examples.json``: the candidate sentences, and per head its sentence and pattern."""
        if not self.candidates:
            return {"sentences": [], "heads": {}}
        sentences = [
            {
                "words": c["sentence"].words,
                "heads": c["sentence"].heads,
                "relations": c["sentence"].relations,
                "tokens": c["tokens"],
                "word_of_token": c["word_of_token"],
            }
            for c in self.candidates
        ]
        chosen = {}
        for row in heads.itertuples():
            flat = row.layer * n_heads + row.head
            relation = getattr(row, "best_relation", None)
            index, correct = 0, None
            if isinstance(relation, str) and relation in RELATIONS:
                d = DIRECTIONS.index(row.best_relation_direction)
                hits = [self._hits(c, d, flat, relation) for c in self.candidates]
                index = int(np.argmax(hits))
                correct = int(hits[index])
            else:  # the longest candidate shows positional and sink patterns best
                index = int(np.argmax([len(c["tokens"]) for c in self.candidates]))
            pattern = self.candidates[index]["pattern"][flat]
            chosen[f"{row.layer}.{row.head}"] = {
                "sentence": index,
                "relation": relation if correct is not None else None,
                "correct": correct,
                "pattern": np.round(pattern, 3).tolist(),
            }
        return {"sentences": sentences, "heads": chosen}

    @staticmethod
    def _hits(candidate: dict, direction: int, flat: int, relation: str) -> int:
        s = candidate["sentence"]
        predicted = candidate["predicted"][direction, flat]
        return sum(
            1
            for i, (h, r) in enumerate(zip(s.heads, s.relations, strict=True))
            if r == relation and h > 0 and predicted[i] == h - 1
        )
