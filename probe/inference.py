"""What a finding must survive before the report states it: an interval honest at small n, enough
independent clusters to draw one at all, and a correction for the many tests a selection makes.

- Proportions get Wilson's score interval, which neither collapses at 0 or 1 nor runs outside
  [0, 1]; a cluster (Poisson) bootstrap interval, which does collapse on a handful of clusters,
  is widened to at least it (``honest``).
- Below ``MIN_CLUSTERS`` independent clusters (sentences, documents), no interval is drawn.
- Many margins tested at once (every head against every relation) are screened with the
  Benjamini–Hochberg procedure at ``FDR``: among the margins called, the expected share of false
  ones is at most ``FDR``.
- A mean over n items gets Student's t-interval (``t_interval``), and a paired difference the
  one-sided one-sample t-test that its mean is above 0 (``t_test_above``): the one place these
  are computed, for the pairs of the interventions, the claims' ablations and the experiment's
  seeds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from statistics import NormalDist

import numpy as np

LEVEL = 0.95  # the intervals' coverage
FDR = 0.05  # Benjamini–Hochberg's level over a family of tests
MIN_CLUSTERS = 10  # fewer sentences (documents) than this: no interval, nothing called
MIN_EFFECT = 0.02  # a margin under two points is not named as a finding, however certain


def wilson(correct, total, level: float = LEVEL) -> tuple[np.ndarray, np.ndarray]:
    """Wilson's score interval of the proportions ``correct / total`` (arrays that broadcast).

    Returns
    -------
    low, high : arrays of the broadcast shape; NaN where ``total`` is 0
    """
    k, n = np.asarray(correct, float), np.asarray(total, float)
    z = NormalDist().inv_cdf(0.5 + level / 2)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = k / n
        centre = (p + z**2 / (2 * n)) / (1 + z**2 / n)
        half = z / (1 + z**2 / n) * np.sqrt(p * (1 - p) / n + z**2 / (4 * n**2))
    low, high = np.clip(centre - half, 0, 1), np.clip(centre + half, 0, 1)
    empty = n <= 0
    return np.where(empty, np.nan, low), np.where(empty, np.nan, high)


def honest(low, high, correct, total, clusters, level: float = LEVEL):
    """A cluster bootstrap's interval ``[low, high]`` made honest at small n: widened to at least
    Wilson's interval on ``correct`` of ``total``, and NaN where fewer than ``MIN_CLUSTERS``
    clusters hold the items.

    Returns
    -------
    low, high : arrays of the broadcast shape
    """
    w_low, w_high = wilson(correct, total, level)
    low, high = np.fmin(low, w_low), np.fmax(high, w_high)
    few = np.asarray(clusters) < MIN_CLUSTERS
    return np.where(few, np.nan, low), np.where(few, np.nan, high)


def p_above(difference: np.ndarray, axis: int = 0) -> np.ndarray:
    """One-sided p-values that the mean difference is above 0, from bootstrap replicates along
    ``axis``: the replicates' mean over their standard deviation, read on the normal curve (a
    percentile count would stop at 1 / replicates, too coarse for thousands of tests).

    Returns
    -------
    The p-values, ``difference``'s shape without ``axis``. Where the replicates do not vary,
    0 if the difference is above 0 in every one of them, else 1 (a head right on every word:
    the guard against a handful of clusters is ``MIN_CLUSTERS``, not this test).
    """
    mean, sd = difference.mean(axis), difference.std(axis, ddof=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = mean / sd
    p = 1 - np.vectorize(NormalDist().cdf, otypes=[float])(np.nan_to_num(z, nan=0.0))
    return np.where(sd > 0, p, np.where(mean > 0, 0.0, 1.0))


def benjamini_hochberg(p_values, level: float = FDR) -> np.ndarray:
    """Which of the tests to call, controlling the false discovery rate at ``level``
    (Benjamini & Hochberg 1995): the k smallest p-values, k the largest rank with
    p_(k) ≤ level · k / m. NaN p-values are not tests.

    Returns
    -------
    Booleans of ``p_values``'s shape.
    """
    p = np.asarray(p_values, float)
    flat = p.ravel()
    tested = ~np.isnan(flat)
    m = int(tested.sum())
    called = np.zeros(flat.shape, bool)
    if m == 0:
        return called.reshape(p.shape)
    order = np.argsort(np.where(tested, flat, np.inf), kind="stable")[:m]
    passing = np.nonzero(flat[order] <= level * np.arange(1, m + 1) / m)[0]
    if len(passing):
        called[order[: passing[-1] + 1]] = True
    return called.reshape(p.shape)


def t975(df: int) -> float:
    """The 97.5th percentile of Student's t with ``df`` degrees of freedom (≥ 1): a 95% interval
    of a mean over ``df + 1`` items is ± this many standard errors."""
    from scipy.special import stdtrit  # scipy.stats's import costs a run about 0.4 s more

    return float(stdtrit(df, 0.975))


def t_interval(mean, sd, n: int, quantile: Callable[[int], float] = t975):
    """Student's t-interval of a mean over ``n`` items: ``mean ± quantile(n - 1) · sd / √n``
    (95% with the default ``quantile``).

    Parameters
    ----------
    mean, sd : float, numpy array or torch tensor (shapes that broadcast)
        The mean over the items and their standard deviation with Bessel's correction
        (``ddof=1``, torch's default), per interval.
    n : int
        The number of items, at least 2 (one item has no spread: callers write NaN there).
    quantile : callable
        ``quantile(df)``: the t quantile with ``df`` degrees of freedom that the half-width
        takes; by default the exact 97.5th percentile, ``t975``.

    Returns
    -------
    low, high : of the type and broadcast shape of ``mean`` and ``sd``
        ``mean - half`` and ``mean + half``, the half-width computed as
        ``quantile(n - 1) * sd / math.sqrt(n)`` in that order (float64 for float64 inputs).

    Raises
    ------
    ValueError
        For ``n`` below 2.
    """
    if n < 2:
        raise ValueError(f"a t-interval needs at least two items, not {n}")
    half = quantile(n - 1) * sd / math.sqrt(n)
    return mean - half, mean + half


def t_test_above(difference) -> float:
    """One-sided p-value of a one-sample t-test that the mean of ``difference`` is above 0
    (paired differences: a head's effect less its baseline's, per input).

    Parameters
    ----------
    difference : array-like ``[items]``
        At least two values.

    Returns
    -------
    The p-value, P(T ≥ t) for Student's T with ``items - 1`` degrees of freedom and t the mean
    over its standard error. Where the differences do not vary, 0 if their mean is above 0 and 1
    otherwise.
    """
    from scipy.special import stdtr  # Student's t CDF (scipy.stats's import costs about 0.4 s)

    difference = np.asarray(difference)
    mean, sd = float(difference.mean()), float(difference.std(ddof=1))
    if not sd > 0:
        return 0.0 if mean > 0 else 1.0
    return float(stdtr(len(difference) - 1, -mean / (sd / math.sqrt(len(difference)))))
