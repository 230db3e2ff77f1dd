"""Random numbers keyed to what they are about, not to the order in which they are drawn.

A random choice about sentence 17 (is it held out? is its word pair (3, 5) sampled?) is a hash of
the seed, a purpose and the sentence's own indices. So results depend on the data and the seed
only: not on the batch size, the order batches arrive in, or how many processes share the corpus.
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a bijection of uint64 whose output bits all depend on every
    input bit (uint64 arithmetic wraps modulo 2⁶⁴, as the algorithm needs)."""
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def keys(seed: int, purpose: str, *parts) -> np.ndarray:
    """uint64 keys of the items ``parts`` identify (integer arrays that broadcast together).

    Parameters
    ----------
    seed : int
    purpose : str
        Separates independent choices about the same items (``"held-out"``, ``"pair"``…).
    *parts : int or array of int
        E.g. sentence index, word index, word index.
    """
    h = np.asarray(seed, dtype=np.uint64) ^ np.uint64(_stable_hash(purpose))
    h = _mix(h)
    for part in parts:
        h = _mix(h ^ np.asarray(part).astype(np.uint64))
    return h


def uniform(seed: int, purpose: str, *parts) -> np.ndarray:
    """Floats in [0, 1) keyed like ``keys``: each is uniform and independent of the others."""
    return (keys(seed, purpose, *parts) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _stable_hash(text: str) -> int:
    """A hash of ``text`` that is the same in every process (``hash()`` is salted)."""
    h = np.uint64(0)
    for byte in text.encode():
        h = _mix(h ^ np.uint64(byte))
    return int(h)


_POISSON_1_CDF = np.cumsum([np.exp(-1.0) / np.prod(np.arange(1.0, k + 1)) for k in range(24)])


def poisson(seed: int, purpose: str, *parts) -> np.ndarray:
    """Poisson(1) counts keyed like ``keys``, e.g. the weights of a Poisson bootstrap
    (the inverse distribution function of a keyed uniform)."""
    return np.searchsorted(_POISSON_1_CDF, uniform(seed, purpose, *parts), side="right")
