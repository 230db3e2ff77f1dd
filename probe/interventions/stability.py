"""A circuit's stability over bootstrap resamples of its pairs, from the per-pair edge scores
that ``edges`` already computes a chunk of pairs at a time: no forward pass, no ``[pairs, edges]``
table kept.

The bootstrap is Poisson(1) (Hanley and MacGibbon 2006; Chamandy et al. 2012): in resample b,
pair p weighs a Poisson(1) count keyed to (seed, b, p) (``probe.keys.poisson``), where the
classic bootstrap's multinomial counts would tie every pair's count to the number of pairs and
to the others'. So a resample's weighted sums are the same whatever the chunks of pairs, their
order or the processes that share them, and they merge by addition (``BootstrapSums``). A
resample's scores are its weighted means; its circuit is its top k edges by |score|, k the full
circuit's size; an edge's inclusion is the share of resampled circuits that hold it, and the
edge is stable at ``STABLE`` or more (``Stability``).

A resample in which no pair is drawn (every weight 0: probability e^(−pairs), 0.7% of resamples
at 5 pairs, 4.5e-5 at 10) has no mean: it is left out of every statistic and counted.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from probe.errors import ProbeError
from probe.keys import poisson

RESAMPLES = 100  # bootstrap resamples of the pairs for the stability
STABLE = 0.9  # an edge held in at least this share of resampled circuits is stable
_BOOTSTRAP = "circuit-bootstrap"  # keys.poisson's purpose: the pairs' weights


def check_resamples(resamples: object, name: str = "resamples") -> int:
    """``resamples`` as an int, refused in one line (``ProbeError``, which the command line
    prints as such) unless it is an integer of at least 2: one resample has no spread."""
    if isinstance(resamples, bool) or not isinstance(resamples, numbers.Integral):
        raise ProbeError(f"{name} must be an integer of at least 2, not {resamples!r}")
    if resamples < 2:
        raise ProbeError(f"{name} must be at least 2 (one resample has no spread), not {resamples}")
    return int(resamples)


def bootstrap_weights(seed: int, resamples: int, pairs: Sequence[int] | np.ndarray) -> np.ndarray:
    """The Poisson(1) bootstrap weights of ``pairs`` (global pair indices) in resamples
    0 … ``resamples`` − 1: ``[resamples, len(pairs)]`` float64, keyed to (seed, resample, pair)."""
    b = np.arange(resamples)[:, None]
    return poisson(seed, _BOOTSTRAP, b, np.asarray(pairs)[None, :]).astype(np.float64)


def top_edges(scores: np.ndarray, k: int) -> np.ndarray:
    """The circuits of the top ``k`` edges by |score|, ties broken as ``circuit`` breaks them
    (a stable ascending sort of |score|, read from its end: the later edge first).

    A partition finds each row's k-th largest |score| in linear time, where a sort of 100
    resamples of a large model's edges would take seconds.

    Parameters
    ----------
    scores : ``[..., edges]``
    k : int

    Returns
    -------
    ``[..., edges]`` bool: which edges each circuit holds.
    """
    size = np.abs(np.asarray(scores, dtype=np.float64))
    edges = size.shape[-1]
    if k <= 0 or k >= edges:
        return np.full(size.shape, k > 0)
    kth = np.partition(size, edges - k, axis=-1)[..., edges - k, None]  # the k-th largest
    above = size > kth
    missing = k - above.sum(-1, keepdims=True)  # taken from the ties at the k-th, last first
    tied = size == kth
    from_the_end = np.cumsum(tied[..., ::-1], axis=-1)[..., ::-1]  # ties at or after each edge
    return above | (tied & (from_the_end <= missing))


def jaccard(circuits: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """|A ∩ B| / |A ∪ B| of each circuit ``[..., edges]`` (bool) with ``reference`` ``[edges]``
    (bool); two empty circuits are the same (1)."""
    both = (circuits & reference).sum(-1)
    either = (circuits | reference).sum(-1)
    return np.where(either > 0, both / np.maximum(either, 1), 1.0)


@dataclass(frozen=True)
class Stability:
    """The full circuit's stability over bootstrap resamples of the pairs.

    Attributes
    ----------
    inclusion : ``[edges]`` float
        Share of resampled circuits (of the full circuit's size) that hold the edge.
    stable : ``[edges]`` bool
        ``inclusion >= STABLE``.
    jaccard : ``[resamples]`` float
        Jaccard of each resampled circuit with the full one (non-empty resamples only).
    jaccard_mean, jaccard_low, jaccard_high : float
        Their mean, and the 2.5th and 97.5th percentiles of the resamples' Jaccards (numpy's
        linear interpolation): the percentile bootstrap interval.
    size : int
        The circuits' size, the full circuit's.
    resamples, empty : int
        Resamples drawn, and how many of them drew no pair (left out).
    """

    inclusion: np.ndarray
    stable: np.ndarray
    jaccard: np.ndarray
    jaccard_mean: float
    jaccard_low: float
    jaccard_high: float
    size: int
    resamples: int
    empty: int


class BootstrapSums:
    """The edges' scores summed over the pairs with each bootstrap resample's weights, added a
    chunk of pairs at a time: the per-resample means of every pair at once (to float rounding)
    whatever the chunks and their order, with only ``[resamples, edges]`` kept.

    Parameters
    ----------
    edges : int
        Edges scored (the rows of ``edges``'s table).
    resamples : int
        Bootstrap resamples, at least 2.
    seed : int
        Keys the weights (``bootstrap_weights``).
    """

    def __init__(self, edges: int, resamples: int = RESAMPLES, seed: int = 0) -> None:
        self.resamples = check_resamples(resamples)
        self.seed = seed
        self.sums = np.zeros((self.resamples, edges))
        self.weights = np.zeros(self.resamples)  # Σ of each resample's weights
        self.pairs = 0

    def add(self, scores, pairs: Sequence[int] | np.ndarray | slice) -> None:
        """Add a chunk's per-pair scores.

        Parameters
        ----------
        scores : ``[pairs_in_chunk, edges]`` array or tensor (taken to the CPU in float64)
        pairs : ``[pairs_in_chunk]`` int, or a slice
            The chunk's pairs' indices among all the pairs (what keys their weights).
        """
        if hasattr(scores, "detach"):  # a torch tensor, without importing torch here
            scores = scores.detach().to("cpu").double().numpy()
        scores = np.asarray(scores, dtype=np.float64)
        if isinstance(pairs, slice):
            pairs = np.arange(pairs.start or 0, pairs.stop)
        pairs = np.asarray(pairs)
        if scores.ndim != 2 or scores.shape != (len(pairs), self.sums.shape[1]):
            raise ValueError(
                f"scores must be [pairs_in_chunk, edges] = [{len(pairs)}, {self.sums.shape[1]}], "
                f"not {list(scores.shape)}"
            )
        w = bootstrap_weights(self.seed, self.resamples, pairs)  # [resamples, pairs_in_chunk]
        self.sums += w @ scores
        self.weights += w.sum(1)
        self.pairs += len(pairs)

    def __deepcopy__(self, memo: dict) -> BootstrapSums:
        # pandas deep-copies a table's attrs on every operation: the sums, read once the
        # scores are made, are shared rather than copied ([resamples, edges] float64 each time).
        return self

    def merge(self, other: BootstrapSums) -> None:
        """Add another instance's sums (other pairs, the same seed and resamples) exactly."""
        if (other.seed, other.resamples) != (self.seed, self.resamples):
            raise ValueError("merge needs the same seed and resamples")
        self.sums += other.sums
        self.weights += other.weights
        self.pairs += other.pairs

    def means(self) -> np.ndarray:
        """``[resamples, edges]``: each resample's weighted mean score (NaN rows for a resample
        that drew no pair)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.sums / self.weights[:, None]

    def circuits(self, size: int) -> np.ndarray:
        """``[resamples, edges]`` bool: each resample's top ``size`` edges by |mean score|
        (a resample that drew no pair holds none)."""
        kept = top_edges(np.nan_to_num(self.means()), size)
        kept[self.weights == 0] = False
        return kept

    def stability(self, circuit: Sequence[int] | np.ndarray) -> Stability:
        """The full circuit's stability.

        Parameters
        ----------
        circuit : ``[size]`` int or ``[edges]`` bool
            The full circuit's edges (row positions in ``edges``'s table, as ``circuit``
            returns them, or flags); the resampled circuits take its size.
        """
        full = np.asarray(circuit)
        edges = self.sums.shape[1]
        if full.dtype == bool and full.shape != (edges,):
            raise ValueError(f"circuit flags must be [edges] = [{edges}], not {list(full.shape)}")
        if full.dtype != bool:
            flags = np.zeros(edges, dtype=bool)
            flags[full.astype(np.int64)] = True
            full = flags
        size = int(full.sum())
        drawn = self.weights > 0
        kept = self.circuits(size)[drawn]
        if len(kept) == 0:
            raise ProbeError("no bootstrap resample drew a pair: add pairs or resamples")
        overlap = jaccard(kept, full)
        inclusion = kept.mean(0)
        low, high = np.percentile(overlap, [2.5, 97.5])
        return Stability(inclusion, inclusion >= STABLE, overlap, float(overlap.mean()),
                         float(low), float(high), size, self.resamples,
                         int((~drawn).sum()))  # fmt: skip
