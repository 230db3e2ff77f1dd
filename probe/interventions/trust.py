"""How far to trust a circuit (``circuit``'s ``Trust``): its stability over bootstrap resamples of
the pairs, its faithfulness under each ablation with intervals, MIB's CPR and CMD of each
ablation's curve, and each pair's faithfulness, assembled from the per-pair metrics the circuit
search measured (``patch_edges``) and the bootstrap sums of the edges' scores (``edges``).
Nothing here runs the model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from probe.errors import ProbeError
from probe.interventions.faithfulness import (
    FAITHFULNESS_RESAMPLES,
    MIB_SIZES,
    PairFaithfulness,
    faithfulness_resamples,
    mib_counts,
    mib_scores,
    pair_faithfulness,
)
from probe.interventions.stability import BootstrapSums, Stability

# How a sentence names each ablation.
NAMES = {
    "corrupted": "corrupted patching",
    "mean": "mean ablation",
    "zero": "zero ablation",
    "resample": "resample ablation",
}


@dataclass(frozen=True, eq=False)  # eq=False: tables inside; pandas compares attrs in concat
class Trust:
    """How far to trust a circuit: ``circuit``'s ``curve.attrs["trust"]``.

    Attributes
    ----------
    ablation : str
        The ablation that chose the circuit (its search ran with it).
    ablations : pandas.DataFrame
        A row per ablation and circuit size measured: ``ablation``, ``edges`` (the top edges
        kept), ``total_edges``, ``faithfulness`` ((m(k) − m(0)) / (m(all) − m(0)), each
        ablation normalised by its own run with no edge kept, as MIB does), and its 95%
        interval ``low``, ``high`` over ``FAITHFULNESS_RESAMPLES`` bootstrap resamples of the
        pairs (NaN for a scalar metric).
    scores : pandas.DataFrame
        A row per ablation: ``faithfulness``, ``low``, ``high`` of the chosen circuit, and MIB's
        ``cpr`` and ``cmd`` of its curve at ``MIB_SIZES`` (``mib_scores``).
    stability : pandas.DataFrame or None
        A row per edge, in ``edges``' order: ``sender``, ``receiver``, ``input``, ``inclusion``
        (the share of resampled circuits of the circuit's size that hold it) and ``stable``
        (inclusion ≥ 0.9). None for a scalar metric or scores without bootstrap sums.
    jaccard, jaccard_low, jaccard_high : float
        Mean Jaccard of the resampled circuits with the circuit, and its 95% percentile
        interval (NaN where ``stability`` is None).
    resamples : int
        Bootstrap resamples of the stability.
    pairs : pandas.DataFrame or None
        A row per pair under the chosen ablation: ``pair`` (its id), ``clean``, ``ablated``
        (no edge kept), ``circuit`` metrics, ``faithfulness`` (NaN where set aside) and
        ``set_aside`` (|clean − ablated| too small to divide by). None for a scalar metric.
    worst : PairFaithfulness or None
        ``pair_faithfulness``'s summary: quantiles, share below 0.5, the worst pairs' ids.
    disagreement : str or None
        One sentence where two ablations' intervals at the circuit do not overlap.
    """

    ablation: str
    ablations: pd.DataFrame
    scores: pd.DataFrame
    stability: pd.DataFrame | None
    jaccard: float
    jaccard_low: float
    jaccard_high: float
    resamples: int
    pairs: pd.DataFrame | None
    worst: PairFaithfulness | None
    disagreement: str | None


def faithfulness_of(values: Mapping[int, np.ndarray], total: int, k: int) -> float:
    """(mean m(k) − mean m(0)) / (mean m(total) − mean m(0)); NaN where the ends score alike."""
    spread = values[total].mean() - values[0].mean()
    if abs(spread) < 1e-12:
        return math.nan
    return float((values[k].mean() - values[0].mean()) / spread)


def _interval(values: Mapping[int, np.ndarray], total: int, k: int, seed: int, per_pair: bool):
    """The faithfulness at ``k`` and its interval (NaN where undefined or a scalar metric)."""
    value = faithfulness_of(values, total, k)
    if not per_pair or math.isnan(value):
        return value, math.nan, math.nan
    try:
        found = faithfulness_resamples(values[total], values[0], values[k],
                                       FAITHFULNESS_RESAMPLES, seed)  # fmt: skip
    except ProbeError:
        return value, math.nan, math.nan
    return value, found.low, found.high


def sizes_for(total: int, chosen: int) -> list[int]:
    """The edge counts every ablation is measured at: none, MIB's sizes, the circuit, all."""
    return sorted({0, chosen, total, *mib_counts(total)})


def assess(
    measured: Mapping[str, Mapping[int, np.ndarray]],
    ablation: str,
    total: int,
    chosen: int,
    scores: pd.DataFrame,
    order: np.ndarray,
    per_pair: bool,
    seed: int = 0,
    ids: Sequence | None = None,
) -> Trust:
    """The circuit's ``Trust`` from what was measured.

    Parameters
    ----------
    measured : ablation -> {edges kept -> ``[pairs]`` metric}
        Each ablation's per-pair metrics with the top k edges kept, at least at ``sizes_for``.
    ablation : str
        The one that chose the circuit.
    total, chosen : int
        Edges in the graph, and in the circuit.
    scores : pandas.DataFrame
        ``edges``' table; ``attrs["bootstrap"]`` its ``BootstrapSums`` (or None).
    order : ``[edges]`` int
        The edges' rows, strongest first (the circuit is ``order[:chosen]``).
    per_pair : bool
        Whether the metric gave one value per pair (else no intervals nor pairs).
    ids : ``[pairs]``, optional
        The pairs' ids for ``pairs`` and ``worst``.
    """
    rows, summary = [], []
    for name, values in measured.items():
        for k in sorted(values):
            f, low, high = _interval(values, total, k, seed, per_pair)
            rows.append({"ablation": name, "edges": k, "total_edges": total,
                         "faithfulness": f, "low": low, "high": high})  # fmt: skip
        f, low, high = _interval(values, total, chosen, seed, per_pair)
        curve = [faithfulness_of(values, total, k) for k in mib_counts(total)]
        cpr, cmd = mib_scores(curve, MIB_SIZES) if np.all(np.isfinite(curve)) else (math.nan,) * 2
        summary.append({"ablation": name, "faithfulness": f, "low": low, "high": high,
                        "cpr": cpr, "cmd": cmd})  # fmt: skip
    table = pd.DataFrame(summary)
    stab = _stability(scores, order, chosen) if per_pair else None
    stability = None
    if stab is not None:
        stability = scores[["sender", "receiver", "input"]].reset_index(drop=True)
        stability["inclusion"] = stab.inclusion
        stability["stable"] = stab.stable
    pairs, worst = None, None
    own = measured[ablation]
    if per_pair and len(own[0]) > 1:
        worst = pair_faithfulness(own[total], own[0], own[chosen], ids)
        pairs = pd.DataFrame(
            {"pair": worst_ids(ids, len(own[0])), "clean": own[total], "ablated": own[0],
             "circuit": own[chosen], "faithfulness": worst.values, "set_aside": worst.set_aside}
        )  # fmt: skip
    return Trust(
        ablation, pd.DataFrame(rows), table, stability,
        *(stab.jaccard_mean, stab.jaccard_low, stab.jaccard_high) if stab else (math.nan,) * 3,
        stab.resamples if stab else 0, pairs, worst, disagreement(table),
    )  # fmt: skip


def worst_ids(ids: Sequence | None, pairs: int) -> np.ndarray:
    """The pairs' ids: ``ids``, or their positions."""
    return np.arange(pairs) if ids is None else np.asarray(ids)


def _stability(scores: pd.DataFrame, order: np.ndarray, chosen: int) -> Stability | None:
    boot = scores.attrs.get("bootstrap")
    if not isinstance(boot, BootstrapSums) or boot.sums.shape[1] != len(scores):
        return None
    return boot.stability(order[:chosen])


def disagreement(scores: pd.DataFrame) -> str | None:
    """One sentence where the ablations' faithfulness intervals at the circuit do not overlap
    (the highest's low above the lowest's high), else None."""
    ok = scores.dropna(subset=["faithfulness", "low", "high"])
    if len(ok) < 2:
        return None
    top, bottom = ok.loc[ok.faithfulness.idxmax()], ok.loc[ok.faithfulness.idxmin()]
    if top.low <= bottom.high:
        return None
    return (f"The ablations disagree beyond their intervals: faithfulness {top.faithfulness:.2f} "
            f"[{top.low:.2f}, {top.high:.2f}] by {NAMES[top.ablation]} but "
            f"{bottom.faithfulness:.2f} [{bottom.low:.2f}, {bottom.high:.2f}] by "
            f"{NAMES[bottom.ablation]}.")  # fmt: skip
