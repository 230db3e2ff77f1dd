"""A circuit's faithfulness with an interval, per pair, and as MIB's two scores of its curve; and
the ablations the edges left out of a circuit can take.

Faithfulness is ``circuit``'s: (circuit − corrupted) / (clean − corrupted), where clean is the
metric with every edge kept, corrupted with none and circuit with the circuit's edges, each
averaged over the pairs (or, per pair, a pair's own). Everything here works from the per-pair
metrics ``patch_edges`` returns; none of it runs the model.

- ``faithfulness_resamples``: the faithfulness on bootstrap resamples of the pairs, weighted as
  ``probe.interventions.stability`` weighs them, with a 95% interval.
- ``pair_faithfulness``: each pair's faithfulness, the pairs whose clean-to-corrupted difference
  is too small to divide by set aside and counted; quantiles, the share below 0.5 and the worst
  pairs.
- ``mib_scores``: CPR and CMD, MIB's areas under the faithfulness curve and between it and 1
  (Mueller et al. 2025), at the circuit sizes ``mib_counts`` gives.
- ``ABLATIONS``, ``check_ablation``, ``resample_partners``: what the edges left out are set to.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from probe.errors import ProbeError
from probe.inference import t975
from probe.interventions.stability import bootstrap_weights, check_resamples
from probe.keys import uniform

# What the edges left out of a circuit are set to: the corrupted run's values (patching), their
# mean over the task's clean inputs, zero, or another pair's clean run's (keyed by seed).
ABLATIONS = ("corrupted", "mean", "zero", "resample")
FAITHFULNESS_RESAMPLES = 10  # resamples the faithfulness's interval is drawn from
MIN_DIFFERENCE = 0.01  # per pair: |clean − corrupted| below this share of its mean is set aside
QUANTILES = (0.0, 0.05, 0.25, 0.5, 0.75, 0.95, 1.0)  # of the per-pair faithfulness
WORST = 5  # the worst pairs named
# MIB's circuit sizes, the share of edges kept (Mueller et al. 2025, §3, and their evaluation
# code's ``percentages``).
MIB_SIZES = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
_PARTNER = "resample-ablation"  # keys.uniform's purpose: each pair's partner


def check_ablation(ablation: str, pairs: int) -> str:
    """``ablation``, refused in one line where it is not one of ``ABLATIONS``, or is
    ``"resample"`` with fewer than two pairs (a pair's values come from another pair's run)."""
    if ablation not in ABLATIONS:
        raise ProbeError(f"ablation must be one of {', '.join(ABLATIONS)}; got {ablation!r}")
    if ablation == "resample" and pairs < 2:
        raise ProbeError(
            f"ablation 'resample' takes values from another pair's run: it needs at least 2 "
            f"pairs, not {pairs}; use another ablation or more pairs"
        )
    return ablation


def resample_partners(seed: int, pairs: int) -> np.ndarray:
    """For a resample ablation: each pair's partner, another pair drawn uniformly and keyed to
    (seed, pair), so that it does not depend on the chunks the pairs run in.

    Returns
    -------
    ``[pairs]`` int64: the partner of pair p, never p itself.
    """
    check_ablation("resample", pairs)
    p = np.arange(pairs)
    step = 1 + np.floor(uniform(seed, _PARTNER, p) * (pairs - 1)).astype(np.int64)
    return (p + step) % pairs


def _metrics(clean, corrupted, circuit) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The three per-pair metrics as float64 ``[pairs]`` arrays, checked; refused in one line
    where every pair's clean and corrupted metrics are equal."""
    clean, corrupted, circuit = (
        np.asarray(v, dtype=np.float64) for v in (clean, corrupted, circuit)
    )
    if clean.ndim != 1 or corrupted.shape != clean.shape or circuit.shape != clean.shape:
        raise ValueError("clean, corrupted and circuit must be [pairs] each, of the same pairs")
    if not np.any(clean != corrupted):
        raise ProbeError(
            "every pair's clean and corrupted metrics are equal: faithfulness is undefined; "
            "check the corrupted prompts or the metric"
        )
    return clean, corrupted, circuit


@dataclass(frozen=True)
class Interval:
    """A faithfulness with its 95% interval from bootstrap resamples of the pairs.

    Attributes
    ----------
    value : float
        On every pair, as ``circuit`` computes it.
    low, high : float
        ``value`` ± t₀.₉₇₅(R − 1) × the standard deviation of the R resamples' values: the
        bootstrap's normal interval, with Student's t for so few resamples (percentiles of 10
        values would be their extremes). NaN where fewer than 2 resamples have a value.
    values : ``[resamples]`` float
        Each resample's faithfulness (NaN where it drew no pair, or no difference to divide by).
    """

    value: float
    low: float
    high: float
    values: np.ndarray


def faithfulness_resamples(
    clean, corrupted, circuit, resamples: int = FAITHFULNESS_RESAMPLES, seed: int = 0
) -> Interval:
    """A circuit's faithfulness with a 95% interval from ``resamples`` bootstrap resamples.

    Resample b weighs the pairs as ``BootstrapSums``'s resample b with the same seed
    (``bootstrap_weights``): its faithfulness is on the pairs that chose resample b's circuit,
    Σ_p w_bp (circuit_p − corrupted_p) / Σ_p w_bp (clean_p − corrupted_p).

    Parameters
    ----------
    clean, corrupted, circuit : ``[pairs]``
        Each pair's metric with every edge kept, with none and with the circuit's
        (``patch_edges``'s rows).
    resamples : int
        At least 2.
    seed : int
        ``BootstrapSums``'s seed.

    Raises
    ------
    ProbeError
        Where the clean and corrupted metrics are equal for every pair, or in their means
        (``circuit``'s rule).
    """
    clean, corrupted, circuit = _metrics(clean, corrupted, circuit)
    resamples = check_resamples(resamples)
    spread = clean.mean() - corrupted.mean()
    if abs(spread) < 1e-12:
        raise ProbeError("the clean and corrupted inputs score alike: faithfulness is undefined")
    value = float((circuit.mean() - corrupted.mean()) / spread)
    w = bootstrap_weights(seed, resamples, np.arange(len(clean)))  # [resamples, pairs]
    # A resample's weighted means share one total weight, which cancels in their ratio.
    top, bottom = w @ (circuit - corrupted), w @ (clean - corrupted)
    with np.errstate(invalid="ignore", divide="ignore"):
        values = np.where(bottom != 0, top / bottom, np.nan)
    ok = values[np.isfinite(values)]
    if len(ok) < 2:
        return Interval(value, math.nan, math.nan, values)
    half = t975(len(ok) - 1) * float(ok.std(ddof=1))
    return Interval(value, value - half, value + half, values)


@dataclass(frozen=True)
class PairFaithfulness:
    """Each pair's faithfulness, and what it says of the worst case.

    Attributes
    ----------
    values : ``[pairs]`` float
        (circuit_p − corrupted_p) / (clean_p − corrupted_p); NaN where set aside.
    set_aside : ``[pairs]`` bool
        Pairs whose |clean_p − corrupted_p| is below ``threshold``.
    threshold : float
        ``min_difference`` × the mean of |clean_p − corrupted_p| over the pairs.
    quantiles : dict
        ``QUANTILES`` (0 … 1) → the quantile of the pairs kept (numpy's linear interpolation).
    below_half : float
        Share of the pairs kept whose faithfulness is below 0.5.
    worst : ``[≤ WORST]``
        The ids of the pairs kept with the lowest faithfulness, worst first (ties: the first).
    """

    values: np.ndarray
    set_aside: np.ndarray
    threshold: float
    quantiles: dict[float, float]
    below_half: float
    worst: np.ndarray


def pair_faithfulness(
    clean,
    corrupted,
    circuit,
    ids: Sequence | np.ndarray | None = None,
    min_difference: float = MIN_DIFFERENCE,
) -> PairFaithfulness:
    """Each pair's faithfulness, with the pairs too close to divide by set aside.

    A pair whose clean and corrupted metrics differ by less than ``min_difference`` (1%) of the
    pairs' mean absolute difference is set aside: its ratio would be rounding noise, or
    infinite. The pair with the largest difference is always kept.

    Parameters
    ----------
    clean, corrupted, circuit : ``[pairs]``
        As ``faithfulness_resamples`` takes them.
    ids : ``[pairs]``, optional
        The pairs' ids, as the task file names them; by default their positions 0 … pairs − 1.
    min_difference : float
        The share of the mean absolute difference below which a pair is set aside.

    Raises
    ------
    ProbeError
        Where every pair's clean and corrupted metrics are equal.
    """
    clean, corrupted, circuit = _metrics(clean, corrupted, circuit)
    ids = np.arange(len(clean)) if ids is None else np.asarray(ids)
    if ids.shape != clean.shape:
        raise ValueError(f"ids must be [pairs] = [{len(clean)}], not {list(ids.shape)}")
    if not 0 <= min_difference < 1:
        raise ValueError(f"min_difference must be in [0, 1), not {min_difference}")
    difference = clean - corrupted
    threshold = float(min_difference * np.abs(difference).mean())
    aside = (np.abs(difference) < threshold) | (difference == 0)
    values = np.full(len(clean), np.nan)
    values[~aside] = (circuit - corrupted)[~aside] / difference[~aside]
    kept = values[~aside]
    quantiles = dict(zip(QUANTILES, np.quantile(kept, QUANTILES).tolist(), strict=True))
    worst = ids[~aside][np.argsort(kept, kind="stable")[:WORST]]
    return PairFaithfulness(values, aside, threshold, quantiles, float((kept < 0.5).mean()), worst)


def mib_counts(total: int, sizes: Sequence[float] = MIB_SIZES) -> list[int]:
    """The number of edges in the circuit of each of MIB's sizes: ``int(k × total)``, the top
    edges by |score|, as MIB's evaluation code takes them (``apply_topn``).

    Parameters
    ----------
    total : int
        Edges in the graph.
    """
    return [int(k * total) for k in sizes]


def mib_scores(
    faithfulness: Sequence[float], sizes: Sequence[float] = MIB_SIZES
) -> tuple[float, float]:
    """CPR and CMD of a faithfulness curve, as MIB defines them.

    MIB (Mueller et al. 2025, "MIB: A Mechanistic Interpretability Benchmark", arXiv
    2504.13151, §3) scores a circuit method by the faithfulness f(k) of its circuits of the top
    k share of edges, over k in ``MIB_SIZES`` (0.1% … 100%):

    - CPR, the integrated circuit performance ratio, ∫ f(k) dk: higher is better;
    - CMD, the integrated circuit–model distance, ∫ |1 − f(k)| dk: 0 is best.

    Both integrals are the trapezoidal rule on the points, as their evaluation code computes
    them (``evaluate_area_under_curve``, ``log_scale=False``): the axis is the share of edges k
    itself (not its log, nor the edge count left after pruning that their leaderboard's table
    divides by the full graph's), and the area runs from the first size to the last, 0.001 to
    1, with nothing added below 0.001: a curve of 1 everywhere has CPR 0.999 and CMD 0. CMD's
    trapezoids take |1 − f| at the points, so a segment that crosses 1 counts the trapezoid of
    the two points' distances, as MIB's does, not the area of the segment's two triangles.

    Parameters
    ----------
    faithfulness : ``[sizes]``
        f at each size (``faithfulness`` of the circuit of ``mib_counts(total)`` edges).
    sizes : ``[sizes]``
        The shares of edges kept, increasing, in [0, 1]; by default ``MIB_SIZES``.

    Returns
    -------
    (cpr, cmd) : tuple of float
    """
    f = np.asarray(faithfulness, dtype=np.float64)
    k = np.asarray(sizes, dtype=np.float64)
    if f.ndim != 1 or f.shape != k.shape or len(k) < 2:
        raise ValueError(f"faithfulness must be one value per size: [{len(k)}] values")
    if np.any(np.diff(k) <= 0) or k[0] < 0 or k[-1] > 1:
        raise ValueError("sizes must increase, within [0, 1] (shares of the edges)")
    if not np.all(np.isfinite(f)):
        raise ValueError("faithfulness must be finite at every size")
    width = np.diff(k)
    cpr = float((width * (f[:-1] + f[1:]) / 2).sum())
    gap = np.abs(1 - f)
    cmd = float((width * (gap[:-1] + gap[1:]) / 2).sum())
    return cpr, cmd
