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

from analyses.syntax import DIRECTIONS
from probe.alignment import Attention
from probe.corpus import Batch

name = "probe"


def pair_features(words: torch.Tensor, b: torch.Tensor, i: torch.Tensor, j: torch.Tensor):
    """Features of word pairs (i, j) of sentences b: the attention i -> j and j -> i of every
    head, ``[pairs, 2·heads]``, from word attention ``[batch, heads, n, n]``."""
    by_pair = words.permute(0, 2, 3, 1)  # [batch, n, n, heads], a view
    return torch.cat([by_pair[b, i, j], by_pair[b, j, i]], dim=-1)


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

    def update(self, batch: Batch, attention: Attention) -> None:
        L, H = attention.patterns.shape[1:3]
        n = int(batch.n_words.max())
        words = attention.words
        gold = batch.heads[:, :n]
        scored = gold >= 0  # [B, n]: words with a head (not the root, not padding)
        held_out = torch.from_numpy(self.is_held_out[batch.index.cpu().numpy()]).to(gold.device)
        if self.head_correct is None:
            self.head_correct = torch.zeros(2, L * H, dtype=torch.long)
            self.n_heads = H

        # Training pairs (i, j): every scored word i of a training sentence and every other
        # word j of its sentence, gathered for the whole batch at once.
        position = torch.arange(n, device=gold.device)
        real = position[None, :] < batch.n_words[:, None]
        pairs = (scored & ~held_out[:, None])[:, :, None] & real[:, None, :]
        pairs &= position[:, None] != position[None, :]
        b, i, j = pairs.nonzero(as_tuple=True)
        slots, keep = self._reservoir_slots(len(b))
        keep = torch.from_numpy(keep).to(b.device)
        b, i, j = b[keep], i[keep], j[keep]  # gather features only for pairs that are kept
        if self.X is None:
            self.X = np.zeros((self.max_train_pairs, 2 * L * H), dtype=np.float32)
        self.X[slots] = pair_features(words, b, i, j).cpu().numpy()
        self.y[slots] = (gold[b, i] == j).cpu().numpy()

        # Held-out sentences, up to the cap: counted words exclude punctuation.
        predicted = attention.predictions  # [B, 2, LH, n]
        counted = scored & ~batch.punct[:, :n]
        right = torch.cat([position[1:], position.new_tensor([-2])])  # the next word, if any
        for s in held_out.nonzero().flatten().tolist():
            if len(self.eval) >= self.max_eval_sentences:
                break
            k = int(batch.n_words[s])
            c = counted[s, :k]
            self.head_correct += ((predicted[s, :, :, :k] == gold[s, :k]) & c).sum(-1).cpu()
            self.right_branching += int(((gold[s, :k] == right[:k]) & c).sum())
            self.eval_words += int(c.sum())
            i, j = torch.meshgrid(position[:k], position[:k], indexing="ij")
            X = pair_features(words, torch.full_like(i, s), i, j)  # [k, k, 2·LH]
            self.eval.append((X.cpu().numpy(), gold[s, :k].cpu().numpy(), c.cpu().numpy()))

    def _reservoir_slots(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Reservoir sampling (Algorithm R) for the next ``count`` training pairs: a uniform
        sample of all pairs so far. Returns the slots of the kept pairs and which are kept."""
        index = self.seen + np.arange(count)
        slots = np.where(index < self.max_train_pairs, index, self.rng.integers(0, index + 1))
        keep = slots < self.max_train_pairs
        self.seen += count
        return slots[keep], keep

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
