"""Clark et al.'s (2019) attention-only probing classifier: can a linear combination of all
heads' attention find each word's syntactic head?

For word i and candidate head word j, the features are the word-level attention i -> j and
j -> i of every head (2 x layers x heads). A logistic regression (scikit-learn's) scores each
pair; a word's predicted head is its best-scoring candidate. It is trained on some sentences
and evaluated on the others, by unlabelled attachment score (UAS, punctuation excluded), beside the
right-branching baseline and the best single head on the same words.

Every random choice is keyed to the sentence (``probe.keys``), so the result does not depend on
the batch size or the order of batches: a sentence is held out when its key says so; the
training pairs kept are those with the smallest keys (a bottom-k sample, uniform over all pairs
and exact to merge); the held-out sentences evaluated are those with the smallest keys that fit.
Memory is bounded in bytes, whatever the depth of the model or the size of the corpus.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from analyses import Analysis, Context, Schema
from analyses.vocabulary import Direction
from probe.keys import keys, uniform
from probe.lazy import lazy
from probe.pipeline import helper

if TYPE_CHECKING:
    from sklearn.linear_model import LogisticRegression

    from probe.inputs.corpus import Batch
    from probe.pipeline.runner import LayerCapture

np = lazy("numpy")
pd = lazy("pandas")
torch = lazy("torch")

C = 1.0  # inverse strength of the logistic regression's L2 penalty (scikit-learn's C)
HELD_OUT = 0.2  # share of sentences held out for evaluation
MAX_TRAIN_PAIRS = 150_000
MAX_EVAL_SENTENCES = 400
TRAIN_BYTES = 32 * 2**20  # features of the sampled training pairs
EVAL_BYTES = 48 * 2**20  # features of the held-out sentences evaluated
# The fit is Newton's method (scikit-learn's ``newton-cholesky``), which stops when no gradient
# component exceeds this: the one minimum of the strictly convex objective, reached in a few
# quadratically converging steps, where L-BFGS at scikit-learn's default tolerance stops far
# from it on attention features (strongly correlated across heads).
TOLERANCE = 1e-8
MAX_ITER = 100
# Newton's first steps, far from the minimum, are taken on every WARM_STEP-th pair of a large
# sample (to WARM_TOLERANCE: that subsample's own minimum lies further than this from the whole
# sample's), and the fit on every pair starts from there: on EWT dev, four steps on all 58,254
# pairs where a cold start takes seven, 0.5 s where it took 0.8.
WARM_STEP = 8
WARM_TOLERANCE = 1e-4
WARM_MIN_PAIRS = 20_000


@dataclass
class _Held:
    """A held-out sentence kept for evaluation: its pair features and what single heads and
    right-branching get right on it."""

    key: int
    features: np.ndarray  # [word, word, feature], written once every layer has been seen
    gold: np.ndarray  # [word] 0-based head, -1 for the root
    counted: np.ndarray  # [word] bool: scored and not punctuation
    head_correct: np.ndarray  # [direction, layer, head], written with the features
    right_branching: int


class AttentionProbe(Analysis):
    """Collects pair features for the attention-only probe; ``finish`` fits and evaluates it."""

    name = "probe"
    title = "Attention-only probe"
    captures = ("hook_pattern",)
    helper_warmup = "analyses.probing:warm_up"
    tables: ClassVar[dict[str, Schema]] = {
        "probe": {
            "parser": "str", "layer": "Int64", "head": "Int64", "direction": "str",
            "correct": "int", "words": "int", "sentences": "int", "uas": "float",
            "train_pairs": "Int64", "train_pairs_seen": "Int64", "held_out_too_long": "Int64",
        }
    }  # fmt: skip

    def __init__(
        self,
        context: Context,
        *,
        held_out: float = HELD_OUT,
        max_train_pairs: int = MAX_TRAIN_PAIRS,
        max_eval_sentences: int = MAX_EVAL_SENTENCES,
        train_bytes: int = TRAIN_BYTES,
        eval_bytes: int = EVAL_BYTES,
    ) -> None:
        super().__init__(context)
        L, H = context.n_layers, context.n_heads
        self.n_features = 2 * L * H
        pair_bytes = self.n_features * 4
        self.held_out = held_out
        self.capacity = max(1, min(max_train_pairs, train_bytes // pair_bytes))
        self.max_eval_sentences = max_eval_sentences
        self.max_eval_pairs = eval_bytes // pair_bytes
        # np.zeros maps pages lazily: memory is taken as the sample fills.
        self.X = np.zeros((self.capacity, self.n_features), dtype=np.float32)
        self.y = np.zeros(self.capacity, dtype=bool)
        self.keys = np.zeros(self.capacity, dtype=np.uint64)
        self.filled = 0
        self.seen = 0  # training pairs offered
        self.held: dict[int, _Held] = {}  # by sentence index
        self.too_long = 0  # held-out sentences whose features alone exceed the budget
        self._fit: helper.Pending[tuple[np.ndarray, float]] | None = None  # see hand_off

    # -- streaming ------------------------------------------------------------------------

    def begin_batch(self, batch: Batch) -> None:
        n = int(batch.n_words.max())
        gold = batch.heads[:, :n]
        scored = gold >= 0  # [B, n]: words with a head (not the root, not padding)
        index = batch.index.cpu().numpy()
        held = uniform(self.context.seed, "held-out", index) < self.held_out
        held_t = torch.from_numpy(held).to(gold.device)
        self._sample_training_pairs(batch, gold, scored & ~held_t[:, None], index)
        self._keep_held_out(batch, gold, scored & ~batch.punct[:, :n], held, index)

    def _sample_training_pairs(
        self, batch: Batch, gold: torch.Tensor, training: torch.Tensor, index: np.ndarray
    ) -> None:
        """Offer the batch's training pairs to the sample, and prepare to gather the features of
        those admitted (``update``).

        A training pair (i, j) is a scored word i of a training sentence and any other word j
        of its sentence; only the pairs entering the sample get features.

        Parameters
        ----------
        batch : Batch
        gold : ``[B, n]`` long: each word's 0-based head, -1 for the root and padding
        training : ``[B, n]`` bool: scored words of the sentences not held out
        index : ``[B]`` each sentence's index in the treebank
        """
        n = gold.shape[1]
        position = torch.arange(n, device=gold.device)
        real = position[None, :] < batch.n_words[:, None]
        pairs = training[:, :, None] & real[:, None, :]
        pairs &= position[:, None] != position[None, :]
        b, i, j = pairs.nonzero(as_tuple=True)
        pair_keys = keys(
            self.context.seed, "pair", index[b.cpu().numpy()], i.cpu().numpy(), j.cpu().numpy()
        )
        slots, chosen = self._admit(pair_keys)
        chosen = torch.from_numpy(chosen).to(b.device)
        self.y[slots] = (gold[b, i] == j)[chosen].cpu().numpy()
        self._pairs = self._feature_positions(b[chosen], i[chosen], j[chosen], n)
        self._slots = slots
        self._forward, self._backward = [], []

    def _feature_positions(
        self, b: torch.Tensor, i: torch.Tensor, j: torch.Tensor, n: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each pair's features lie in a flattened ``[B, H, n, n]`` word attention, for
        every head: one index_select per layer and direction then gathers them all.

        Parameters
        ----------
        b, i, j : ``[pairs]`` long: each pair's sentence in the batch, word and candidate head
        n : words per sentence in the batch (padded)

        Returns
        -------
        forward : ``[pairs, H]`` the positions of attention i -> j
        backward : ``[pairs, H]`` the positions of attention j -> i
        """
        heads = torch.arange(self.context.n_heads, device=b.device) * n * n
        start = b * self.context.n_heads * n * n
        return (start + i * n + j)[:, None] + heads, (start + j * n + i)[:, None] + heads

    def _keep_held_out(
        self, batch: Batch, gold: torch.Tensor, counted: torch.Tensor, held: np.ndarray,
        index: np.ndarray,
    ) -> None:  # fmt: skip
        """Keep the batch's held-out sentences that fit the evaluation budget (those with the
        smallest keys), and prepare to gather their features and single heads' hits
        (``update``).

        Parameters
        ----------
        batch : Batch
        gold : ``[B, n]`` long: each word's 0-based head, -1 for the root and padding
        counted : ``[B, n]`` bool: words scored and not punctuation
        held : ``[B]`` bool: sentences held out
        index : ``[B]`` each sentence's index in the treebank
        """
        new = self._offer_held_out(batch, gold, counted, held, index)
        self._evict()
        # A sentence just offered may already have been evicted by ones with smaller keys.
        kept = [(s, e) for s, e in new if self.held.get(int(index[s])) is e]
        self._held_now = [e for _, e in kept]
        # Their rows in the batch, and each word's gold head where it counts (-2, which no
        # prediction names, where it does not): every layer gathers them at once.
        rows_kept = [s for s, _ in kept]
        self._held_rows = torch.tensor(rows_kept, dtype=torch.long, device=gold.device)
        self._held_gold = torch.where(counted, gold, -2).index_select(0, self._held_rows)
        self._held_words, self._held_hits = [], []

    def _offer_held_out(
        self, batch: Batch, gold: torch.Tensor, counted: torch.Tensor, held: np.ndarray,
        index: np.ndarray,
    ) -> list[tuple[int, _Held]]:  # fmt: skip
        """Add the batch's held-out sentences to ``held``, before eviction; a sentence without
        a counted word is skipped, one too long for the budget on its own counted in
        ``too_long``.

        Parameters
        ----------
        batch : Batch
        gold : ``[B, n]`` long: each word's 0-based head, -1 for the root and padding
        counted : ``[B, n]`` bool: words scored and not punctuation
        held : ``[B]`` bool: sentences held out
        index : ``[B]`` each sentence's index in the treebank

        Returns
        -------
        Each added sentence's row in the batch and its entry, without features yet.
        """
        counted_np, gold_np = counted.cpu().numpy(), gold.cpu().numpy()
        n_words = batch.n_words.cpu().numpy()
        rows = np.flatnonzero(held)
        evaluate = keys(self.context.seed, "evaluate", index[rows])
        new = []
        for s, key in zip(rows, evaluate, strict=True):
            k = int(n_words[s])
            c = counted_np[s, :k]
            if not c.any():
                continue
            if k * k > self.max_eval_pairs:
                self.too_long += 1
                continue
            self.held[int(index[s])] = entry = self._held_entry(int(key), gold_np[s, :k], c)
            new.append((s, entry))
        return new

    def _held_entry(self, key: int, gold: np.ndarray, counted: np.ndarray) -> _Held:
        """A held-out sentence's entry, with its right-branching score; its features and
        single heads' hits are written at ``end_batch``.

        Parameters
        ----------
        key : the sentence's evaluation key
        gold : ``[k]`` each word's 0-based head, -1 for the root
        counted : ``[k]`` bool: words scored and not punctuation
        """
        k = len(gold)
        right = np.append(np.arange(1, k), -2)  # the next word, if any
        return _Held(
            key=key,
            features=np.zeros((0, 0, self.n_features), dtype=np.float32),
            gold=gold,
            counted=counted,
            head_correct=np.zeros((2, self.context.n_layers, self.context.n_heads), int),
            right_branching=int(((gold == right) & counted).sum()),
        )

    def update(self, batch: Batch, layer: int, capture: LayerCapture) -> None:
        words = capture.words  # [B, H, n, n]
        flat = words.reshape(-1)
        forward, backward = self._pairs
        self._forward.append(flat[forward])  # [pairs, H]: this layer's heads' attention i -> j
        self._backward.append(flat[backward])  # … and j -> i
        if self._held_now:
            rows = self._held_rows
            self._held_words.append(words.index_select(0, rows))  # [held, H, n, n]
            predicted = capture.predictions.index_select(0, rows)  # [held, 2, H, n]
            self._held_hits.append((predicted == self._held_gold[:, None, None]).sum(-1))

    def end_batch(self, batch: Batch) -> None:
        """Write the batch's features, every layer at once, in the column order of
        ``n_features``: i -> j for every head (flat order), then j -> i."""
        slots = self._slots
        if len(slots):
            self.X[slots] = torch.cat(self._forward + self._backward, dim=1).cpu().numpy()
        if self._held_now:
            words = torch.stack(self._held_words, 1).cpu()  # [held, L, H, n, n]
            hits = torch.stack(self._held_hits, 2).cpu().numpy()  # [held, 2, L, H]
            for i, entry in enumerate(self._held_now):
                k = len(entry.gold)
                w = words[i, :, :, :k, :k].flatten(0, 1)  # [LH, k, k]
                entry.features = torch.cat([w.permute(1, 2, 0), w.permute(2, 1, 0)], -1).numpy()
                entry.head_correct = hits[i]
        self._forward, self._backward, self._held_now = [], [], []
        self._held_words, self._held_hits = [], []

    def _admit(self, new_keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Keep the ``capacity`` smallest keys among those kept so far and ``new_keys``.

        Returns the slots the admitted new pairs take, and which new pairs they are.
        """
        self.seen += len(new_keys)
        candidates = np.arange(len(new_keys))
        if self.filled == self.capacity:
            candidates = np.flatnonzero(new_keys < self.keys.max())
        total = self.filled + len(candidates)
        if total <= self.capacity:
            slots = np.arange(self.filled, total)
            self.filled = total
        else:
            combined = np.concatenate([self.keys[: self.filled], new_keys[candidates]])
            keep = np.argpartition(combined, self.capacity - 1)[: self.capacity]
            kept_old = np.zeros(self.filled, dtype=bool)
            kept_old[keep[keep < self.filled]] = True
            candidates = candidates[keep[keep >= self.filled] - self.filled]
            free = np.concatenate(
                [np.flatnonzero(~kept_old), np.arange(self.filled, self.capacity)]
            )
            slots = free[: len(candidates)]
            self.filled = self.capacity
        self.keys[slots] = new_keys[candidates]
        return slots, candidates

    def _evict(self) -> None:
        """Keep the held-out sentences with the smallest keys that fit the budget: the longest
        prefix, in key order, within ``max_eval_sentences`` and ``max_eval_pairs``."""
        pairs = sum(len(e.gold) ** 2 for e in self.held.values())
        by_key = sorted(self.held, key=lambda s: self.held[s].key)
        while len(by_key) > self.max_eval_sentences or pairs > self.max_eval_pairs:
            dropped = self.held.pop(by_key.pop())
            pairs -= len(dropped.gold) ** 2

    # -- merging and finishing ------------------------------------------------------------

    def __getstate__(self) -> dict:
        """Only the filled part of the training sample travels (``Analysis.__getstate__``)."""
        state = super().__getstate__()
        for name in ("X", "y", "keys"):
            state[name] = state[name][: self.filled]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._fit = None
        for name in ("X", "y", "keys"):  # back to full capacity, so it can admit more pairs
            kept = getattr(self, name)
            full = np.zeros((self.capacity, *kept.shape[1:]), dtype=kept.dtype)
            full[: len(kept)] = kept
            setattr(self, name, full)

    def merge(self, other: AttentionProbe) -> None:
        self._check_mergeable(other)
        seen = self.seen + other.seen
        n = other.filled
        slots, chosen = self._admit(other.keys[:n])
        self.X[slots], self.y[slots] = other.X[:n][chosen], other.y[:n][chosen]
        self.seen = seen
        self.held.update(other.held)
        self._evict()
        self.too_long += other.too_long

    def hand_off(self) -> bool:
        self._fit = self._submit_fit() if self._evaluable() else None
        return self._fit is not None

    def _evaluable(self) -> bool:
        """Whether there are held-out sentences to evaluate, and two classes to learn."""
        y = self.y[: self.filled]
        return bool(self.held) and bool(y.any()) and not y.all()

    def _submit_fit(self) -> helper.Pending[tuple[np.ndarray, float]]:
        """The fit, started in the helper process, where scikit-learn is imported (or here)."""
        order = np.argsort(self.keys[: self.filled])  # the fit must not depend on arrival order
        filled = slice(self.filled)
        return helper.submit(fit_in_order, self.X[filled], self.y[filled], order)

    def _tables(self) -> dict[str, pd.DataFrame]:
        """``probe``: one row per parser on the same held-out words."""
        held = [self.held[s] for s in sorted(self.held, key=lambda s: self.held[s].key)]
        probe_row = {"parser": "attention_probe", "train_pairs": self.filled,
                     "train_pairs_seen": self.seen, "held_out_too_long": self.too_long}  # fmt: skip
        if not self._evaluable():
            table = pd.DataFrame([probe_row | {"correct": 0, "words": 0, "sentences": 0}])
            return {"probe": table.reindex(columns=list(self.tables["probe"]))}
        weights, bias = (self._fit or self._submit_fit()).result()
        correct = words = right = 0
        head_correct = np.zeros_like(held[0].head_correct)
        for entry in held:
            k = len(entry.gold)
            scores = entry.features.reshape(k * k, -1).astype(np.float64) @ weights + bias
            scores = scores.reshape(k, k)
            np.fill_diagonal(scores, -np.inf)
            correct += int((scores.argmax(1) == entry.gold)[entry.counted].sum())
            words += int(entry.counted.sum())
            right += entry.right_branching
            head_correct += entry.head_correct
        direction, layer, head = np.unravel_index(int(head_correct.argmax()), head_correct.shape)
        rows = [
            probe_row | {"correct": correct},
            {"parser": "right_branching", "correct": right},
            {"parser": "best_single_head", "correct": int(head_correct.max()), "layer": layer,
             "head": head, "direction": str(list(Direction)[direction])},
        ]  # fmt: skip
        table = pd.DataFrame(rows).assign(words=words, sentences=len(held))
        table["uas"] = table.correct / words
        return {"probe": table.reindex(columns=list(self.tables["probe"]))}

    @classmethod
    def summary(cls, tables: dict[str, pd.DataFrame]) -> list[str]:
        probe = tables["probe"].set_index("parser")
        if probe.words.iloc[0] == 0:
            return []
        uas = probe.uas
        return [
            f"attention probe UAS {uas['attention_probe']:.1%} (right-branching "
            f"{uas['right_branching']:.1%}, best single head {uas['best_single_head']:.1%})"
        ]

    @classmethod
    def section(cls, tables: dict[str, pd.DataFrame], run: dict) -> dict:
        return {"parsers": tables["probe"].set_index("parser").to_dict("index")}


def fit_coefficients(X: np.ndarray, y: np.ndarray, c: float = C) -> tuple[np.ndarray, float]:
    """``fit_logistic``'s weights ``[features]`` and intercept, as plain numbers: what the
    helper process sends back (a ``LogisticRegression`` would import scikit-learn here)."""
    model = fit_logistic(X, y, c)
    return model.coef_[0], float(model.intercept_[0])


def fit_in_order(X: np.ndarray, y: np.ndarray, order: np.ndarray) -> tuple[np.ndarray, float]:
    """``fit_coefficients`` of the pairs taken in ``order``: the helper process gathers them (33
    MB on EWT dev, 14-51 ms), not the run."""
    return fit_coefficients(X[order], y[order])


def warm_up() -> None:
    """A small fit, which the helper process runs while torch imports
    (``probe.pipeline.helper``)."""
    rng = np.random.default_rng(0)
    X = rng.standard_normal((2000, 144), dtype=np.float32)
    fit_coefficients(X, X[:, 0] + rng.standard_normal(2000) > 0)


def fit_logistic(X: np.ndarray, y: np.ndarray, c: float = C) -> LogisticRegression:
    """The L2-penalised logistic regression of pair features, fitted to its minimum.

    Minimises ``c · Σ log(1 + exp(-s·(x·w + b))) + ||w||² / 2`` with s = ±1, the intercept not
    penalised (scikit-learn's ``LogisticRegression``, solved by Newton's method in float64, to
    TOLERANCE; from WARM_MIN_PAIRS pairs on, starting from every WARM_STEP-th pair's minimum).

    Parameters
    ----------
    X : ``[n, features]`` float
    y : ``[n]`` bool
    c : float

    Returns
    -------
    LogisticRegression
        Fitted: ``coef_`` ``[1, features]``, ``intercept_`` ``[1]``.
    """
    from sklearn.linear_model import LogisticRegression  # here: it costs an import 0.8 s

    X, y = np.asarray(X, dtype=np.float64), np.asarray(y, dtype=bool)
    model = LogisticRegression(C=c, solver="newton-cholesky", tol=TOLERANCE, max_iter=MAX_ITER)
    part = slice(None, None, WARM_STEP)
    if len(y) >= WARM_MIN_PAIRS and y[part].any() and not y[part].all():
        # the subsample's penalty weighs as much against its loss as the whole sample's does
        share = len(y) / len(y[part])
        model.set_params(C=c * share, tol=WARM_TOLERANCE, warm_start=True).fit(X[part], y[part])
        model.set_params(C=c, tol=TOLERANCE)
    return model.fit(X, y)
