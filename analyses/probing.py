"""Clark et al.'s (2019) attention-only probing classifier: can a linear combination of all
heads' attention find each word's syntactic head?

For word i and candidate head word j, the features are the word-level attention i -> j and
j -> i of every head (2 x layers x heads). A logistic regression scores each pair; a word's
predicted head is its best-scoring candidate. It is trained on a seeded split of the sentences
and evaluated on the others, by unlabelled attachment score (UAS, punctuation excluded), beside
the right-branching baseline and the best single head on the same words.

Memory stays bounded: training pairs are kept by reservoir sampling (at most ``max_train_pairs``)
and at most ``max_eval_sentences`` held-out sentences are kept for evaluation.
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression

from analyses.syntax import DIRECTIONS, head_predictions
from probe.alignment import word_attention
from probe.corpus import Batch

name = "probe"


def pair_features(words: torch.Tensor) -> torch.Tensor:
    """``[batch, heads, n, n]`` word attention -> ``[batch, n, n, 2·heads]`` features of (i, j)."""
    return torch.cat([words, words.transpose(-1, -2)], dim=1).permute(0, 2, 3, 1)


class ProbeAnalysis:
    """Collects features for the attention-only probe; ``result()`` fits and evaluates it."""

    name = name

    def __init__(
        self,
        n_sentences: int,
        *,
        seed: int = 0,
        held_out: float = 0.2,
        max_train_pairs: int = 150_000,
        max_eval_sentences: int = 400,
    ):
        self.rng = np.random.default_rng(seed)
        self.is_held_out = self.rng.random(n_sentences) < held_out
        self.max_train_pairs = max_train_pairs
        self.max_eval_sentences = max_eval_sentences
        self.X: np.ndarray | None = None
        self.y = np.zeros(max_train_pairs, dtype=bool)
        self.seen = 0
        self.eval: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.head_correct: torch.Tensor | None = None  # single heads on the held-out words
        self.right_branching = 0
        self.eval_words = 0

    def update(self, batch: Batch, patterns: torch.Tensor) -> None:
        B, L, H, T, _ = patterns.shape
        n = int(batch.n_words.max())
        words = word_attention(patterns.reshape(B, L * H, T, T), batch.word_of_token, n)
        features = pair_features(words).cpu().numpy().astype(np.float32)
        gold, n_words = batch.heads[:, :n].cpu().numpy(), batch.n_words.cpu().numpy()
        punct = batch.punct[:, :n].cpu().numpy()
        held_out = self.is_held_out[batch.index.cpu().numpy()]
        predicted = head_predictions(words, batch.n_words).cpu()  # [B, 2, LH, n]
        if self.head_correct is None:
            self.head_correct = torch.zeros(2, L * H, dtype=torch.long)
            self.n_heads = H
        for b in range(B):
            k = int(n_words[b])
            scored = gold[b, :k] >= 0
            if held_out[b]:
                if len(self.eval) >= self.max_eval_sentences:
                    continue
                counted = scored & ~punct[b, :k]
                g = torch.from_numpy(gold[b, :k])
                hits = (predicted[b, :, :, :k] == g) & torch.from_numpy(counted)
                self.head_correct += hits.sum(-1)
                self.right_branching += int((gold[b, :k] == np.arange(1, k + 1))[counted].sum())
                self.eval_words += int(counted.sum())
                self.eval.append((features[b, :k, :k], gold[b, :k], counted))
            else:
                i, j = np.nonzero(scored[:, None] & ~np.eye(k, dtype=bool))
                self._keep(features[b, i, j], gold[b, i] == j)

    def _keep(self, X: np.ndarray, y: np.ndarray) -> None:
        """Reservoir sampling (Algorithm R): a uniform sample of all training pairs so far."""
        if self.X is None:
            self.X = np.zeros((self.max_train_pairs, X.shape[1]), dtype=np.float32)
        index = self.seen + np.arange(len(X))
        slots = np.where(index < self.max_train_pairs, index, self.rng.integers(0, index + 1))
        keep = slots < self.max_train_pairs
        self.X[slots[keep]] = X[keep]
        self.y[slots[keep]] = y[keep]
        self.seen += len(X)

    def result(self) -> dict:
        """UAS of the probe, right-branching and the best single head on held-out words."""
        if self.X is None or not self.eval or self.eval_words == 0:
            return {"skipped": "too few sentences to train and evaluate the probe"}
        n = min(self.seen, self.max_train_pairs)
        model = LogisticRegression(C=1.0, max_iter=1000)
        model.fit(self.X[:n], self.y[:n])
        correct = total = 0
        for features, gold, counted in self.eval:
            k = len(gold)
            scores = model.decision_function(features.reshape(k * k, -1)).reshape(k, k)
            np.fill_diagonal(scores, -np.inf)
            correct += int((scores.argmax(1) == gold)[counted].sum())
            total += int(counted.sum())
        direction, flat = divmod(int(self.head_correct.argmax()), self.head_correct.shape[1])
        return {
            "uas": correct / total,
            "eval_words": total,
            "eval_sentences": len(self.eval),
            "train_pairs": n,
            "train_pairs_seen": self.seen,
            "right_branching_uas": self.right_branching / self.eval_words,
            "best_head_uas": float(self.head_correct.max()) / self.eval_words,
            "best_head_direction": DIRECTIONS[direction],
            "best_head_layer": flat // self.n_heads,
            "best_head_head": flat % self.n_heads,
        }
