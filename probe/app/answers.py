"""The experiment's answers (``probe experiment heads``), each sentence derived from the measured
numbers: whether each model converged, and which differences hold across seeds.

A (task, variant) has *converged* when every seed's model either solved the task (held-out
accuracy ≥ ``SOLVED``) or stopped learning (its training loss fell by less than ``PLATEAU`` of
itself over the last quarter of training). A comparison of two variants is made only where both
converged, on at least two seeds: the per-seed differences (paired by seed: the same data) give
a 95% t-interval, and a difference is called where that interval excludes 0 and the mean is at
least ``SAME_WITHIN``; the two are "the same" only where the whole interval lies within
``SAME_WITHIN`` of 0. Otherwise the page gives the numbers and says that no conclusion follows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from probe.inference import t_interval

SOLVED = 0.99  # held-out accuracy at which a task counts as solved
PLATEAU = 0.10  # a loss falling by less than this share over the last quarter has stopped
SAME_WITHIN = 0.02  # differences of accuracy under two points are not called
# 97.5th percentiles of Student's t with 1…10 degrees of freedom (above: the normal's)
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def t975(df: int) -> float:
    """The 97.5th percentile of Student's t with ``df`` degrees of freedom (≥ 1)."""
    return T975[df - 1] if df <= len(T975) else 1.96


def convergence(experiment: pd.DataFrame, curves: pd.DataFrame) -> pd.DataFrame:
    """One row per task, variant and seed: ``accuracy``, ``final_loss``, ``loss_drop`` (the
    share by which the training loss fell over the last quarter of training) and ``status``:
    "solved", "plateaued" or "not converged"."""
    per_run = experiment.groupby(["task", "variant", "seed"], sort=False).agg(
        accuracy=("accuracy", "first"), final_loss=("final_loss", "first")
    )
    rows = []
    for (task, variant, seed), curve in curves.groupby(["task", "variant", "seed"], sort=False):
        curve = curve.sort_values("step")
        last = curve.step.iloc[-1]
        earlier = curve[curve.step <= last - max(last // 4, 1)]
        before = earlier.loss.iloc[-1] if len(earlier) else math.nan
        drop = (before - curve.loss.iloc[-1]) / before if before > 0 else math.nan
        rows.append({"task": task, "variant": variant, "seed": seed, "loss_drop": drop})
    table = per_run.join(pd.DataFrame(rows).set_index(["task", "variant", "seed"]))
    solved = table.accuracy >= SOLVED
    plateaued = table.loss_drop < PLATEAU  # NaN (too short a curve) is not a plateau
    table["status"] = np.where(solved, "solved", np.where(plateaued, "plateaued", "not converged"))
    return table.reset_index()


@dataclass(frozen=True)
class Difference:
    """Accuracy of variant ``a`` minus variant ``b`` (mean over seeds), its 95% t-interval
    across seeds (NaN with one seed), and what may be said of it."""

    mean: float
    low: float
    high: float
    seeds: int
    verdict: str  # "higher", "lower", "the same", or why nothing is called

    def words(self, a: str, b: str) -> str:
        """The difference in a sentence's words."""
        numbers = f"{100 * self.mean:+.1f} points"
        if self.seeds >= 2:
            numbers += f", 95% interval across {self.seeds} seeds {100 * self.low:+.1f} to "
            numbers += f"{100 * self.high:+.1f}"
        if self.verdict in ("higher", "lower"):
            return f"{a} is {self.verdict} than {b} ({numbers})"
        if self.verdict == "the same":
            return f"{a} and {b} are the same within {SAME_WITHIN:.0%} ({numbers})"
        return f"{a} against {b}: {numbers}; no conclusion ({self.verdict})"


def difference(status: pd.DataFrame, a: str, b: str, tasks: list[str]) -> Difference:
    """Variant ``a``'s accuracy minus ``b``'s, averaged over ``tasks``, per seed (``status``
    from ``convergence``), and the verdict the module's rules allow."""
    part = status[status.task.isin(tasks)]
    wide = part.pivot_table(index="seed", columns="variant", values="accuracy", aggfunc="mean")
    converged = bool((part[part.variant.isin([a, b])].status != "not converged").all())
    return paired((wide[a] - wide[b]).to_numpy(), converged)


def paired(per_seed: np.ndarray, converged: bool, same_within: float = SAME_WITHIN) -> Difference:
    """The verdict on per-seed differences ``[seed]``: called where the models converged, on at
    least two seeds, the 95% t-interval excluding 0 and the mean at least ``same_within``."""
    n, mean = len(per_seed), float(np.mean(per_seed))
    low = high = math.nan
    if n >= 2:
        low, high = t_interval(mean, float(np.std(per_seed, ddof=1)), n, quantile=t975)
    if not converged:
        verdict = "not converged"
    elif n < 2:
        verdict = "one seed: no interval across seeds"
    elif (low > 0 or high < 0) and abs(mean) >= same_within:
        verdict = "higher" if mean > 0 else "lower"
    elif -same_within < low and high < same_within:
        verdict = "the same"
    else:
        verdict = "the interval across seeds is too wide"
    return Difference(mean, low, high, n, verdict)


def convergence_sentence(status: pd.DataFrame) -> str:
    """Which (task, variant) models did not converge, or that all did."""
    stuck = status[status.status == "not converged"]
    if stuck.empty:
        return "Every model converged (solved its task or stopped learning)."
    names = sorted({f"{v} on {t.replace('_', ' ')}" for t, v in zip(stuck.task, stuck.variant,
                                                                   strict=True)})  # fmt: skip
    return (
        f"Not converged, no conclusion drawn from them: {', '.join(names)} (the training "
        f"loss still fell by {PLATEAU:.0%} or more over the last quarter of training)."
    )
