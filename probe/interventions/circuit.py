"""The circuit search: the fewest top-scoring edges whose circuit recovers a share of the clean
metric (``circuit``), ranked by their scores (``edge_scores``) and measured exactly
(``edge_patching``), with the faithfulness curve it searched along and how far to trust it
(``trust``: stability, each ablation's curve, MIB's scores, each pair's faithfulness).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch
from torch import nn

from probe.errors import ProbeError
from probe.interventions.edge_patching import patch_edges
from probe.interventions.edge_scores import edges
from probe.interventions.faithfulness import ABLATIONS, check_ablation
from probe.interventions.gradients import memory_budget
from probe.interventions.guard import keeps_model
from probe.interventions.pairs import PER_PAIR, Batch, Metric, as_pairs, same_form
from probe.interventions.progress import advance, finish, long_work, shown
from probe.interventions.stability import RESAMPLES, check_resamples
from probe.interventions.trust import assess, sizes_for


@keeps_model
def circuit(
    model: nn.Module,
    clean: Batch,
    corrupted: Batch,
    metric: Metric,
    faithfulness: float = 0.8,
    *,
    scores: pd.DataFrame | None = None,
    method: str = "eap-ig",
    steps: int = 5,
    points: int = 16,
    max_bytes: int | None = None,
    ablation: str = "corrupted",
    ablations: Sequence[str] = ABLATIONS,
    resamples: int = RESAMPLES,
    seed: int = 0,
    ids: Sequence | None = None,
    progress: bool | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The fewest top-scoring edges whose circuit reaches ``faithfulness``, and the curve.

    Edges are ranked by the absolute value of their score (``edges``); the circuit of the top k
    is measured exactly (``patch_edges``). Faithfulness is (metric of the circuit − corrupted) /
    (clean − corrupted), the metrics averaged over pairs: 1 with every edge, 0 with none. The
    curve is measured at ``points`` edge counts spread from 0 to every edge, then the smallest
    count that reaches ``faithfulness`` is searched for by bisection between the last count
    below it and the first above (taking the curve as rising there). ``max_bytes`` bounds what
    ``edges`` and ``patch_edges`` hold at once, as theirs does.

    The edges left out take ``ablation``'s values (``patch_edges``); faithfulness is then
    normalised by that ablation's own run with no edge kept, as MIB does. Once the circuit is
    found, each of ``ablations`` is measured at no edge, at MIB's sizes (``MIB_SIZES``, the
    share of edges kept: ``mib_counts``), at the circuit's size and at every edge, and the
    result says how far to trust the circuit (``curve.attrs["trust"]``, a ``Trust``):

    - stability: the pairs are resampled (``resamples`` Poisson bootstrap resamples keyed by
      ``seed``) and the edges re-ranked on each from the per-pair scores ``edges`` summed (no
      forward pass): each edge's inclusion (``stable`` at ≥ 0.9) and the mean Jaccard of the
      resampled circuits with the circuit, with a 95% interval;
    - per ablation: the faithfulness at each size measured, with a 95% interval from 10
      bootstrap resamples of the pairs (no forward pass either), and MIB's CPR and CMD;
    - per pair: each pair's faithfulness under ``ablation``, the pairs whose clean-to-ablated
      difference is too small to divide by set aside, named by ``ids``;
    - a sentence where two ablations' intervals at the circuit do not overlap.

    With a scalar metric the intervals, stability and pairs are left out (NaN, None).

    Parameters
    ----------
    clean, corrupted, metric
        As ``edges`` takes them: a per-pair metric and a scalar one (their mean) give the same
        circuit.
    faithfulness : float
        The fraction of the clean metric's difference from the corrupted one to recover.
    scores : pandas.DataFrame, optional
        ``edges``'s table, where it was computed already; else ``edges`` runs with ``method``
        and ``steps``.
    progress : bool, optional
        tqdm progress bars on stderr (the edges', then the curve's): by default where stderr is a
        terminal (``probe.interventions.progress``); ``False`` never, ``True`` always.

    Returns
    -------
    circuit : pandas.DataFrame
        The chosen edges, ``edges``'s rows, strongest first.
    curve : pandas.DataFrame
        ``edges`` (how many of the top edges are kept), ``total_edges`` and ``faithfulness``,
        by ``edges``, under ``ablation``; ``attrs["target"]``, ``attrs["chosen"]``,
        ``attrs["metric"]`` (its form), ``attrs["ablation"]`` and ``attrs["trust"]`` (``Trust``).

    Raises
    ------
    ProbeError
        Where the clean and corrupted inputs score alike (faithfulness is then undefined),
        ``resamples`` is not an integer of at least 2, an ablation is unknown, or the resample
        ablation has one pair.
    """
    if not 0 <= faithfulness <= 1:
        raise ProbeError(f"faithfulness must be in [0, 1], not {faithfulness}")
    if points < 2:
        raise ProbeError(f"points must be at least 2 (no edge and every edge), not {points}")
    resamples = check_resamples(resamples)
    clean, corrupted, pairs = as_pairs(clean, corrupted, model)
    wanted = _ablations(ablation, ablations, pairs)
    max_bytes = memory_budget(model, max_bytes)  # once: every call below holds the same
    if scores is None:
        scores = edges(model, clean, corrupted, metric, method, steps, max_bytes=max_bytes,
                       resamples=resamples, seed=seed, progress=progress)  # fmt: skip
    total = len(scores)
    order = scores.score.abs().to_numpy().argsort(kind="stable")[::-1].copy()
    measure = _Measure(model, (clean, corrupted, metric), order, wanted, max_bytes, seed)
    sizes = sizes_for(total, total)  # the points each other ablation adds, at most
    runs = _measured(model, clean, pairs, points, total) + (len(wanted) - 1) * len(sizes)
    with shown("circuit", runs, progress, "curve point") as bar:
        ends = measure([total, 0])
        spread = ends[total] - ends[0]
        if abs(spread) < 1e-12:
            raise ProbeError(
                "the clean and corrupted inputs score alike: faithfulness is undefined"
            )
        grid = sorted({round(total * (i / (points - 1)) ** 2) for i in range(points)} - {0, total})
        found = ends | measure(grid)

        def faith(k: int) -> float:
            return (found[k] - ends[0]) / spread

        counts = sorted(found)
        above = next(k for k in counts if faith(k) >= faithfulness or k == total)
        below = max((k for k in counts if k < above), default=0)
        while above - below > 1:
            middle = (above + below) // 2
            found |= measure([middle])
            above, below = (middle, below) if faith(middle) >= faithfulness else (above, middle)
        for name in wanted:
            if name != ablation:  # every edge kept is the clean run, whatever the ablation
                measure.measured[name][total] = measure.measured[ablation][total]
            measure(sizes_for(total, above), name)
        finish(bar)  # the bisection ended, often before its bound: full
    curve = pd.DataFrame(
        {
            "edges": sorted(found),
            "total_edges": total,
            "faithfulness": [faith(k) for k in sorted(found)],
        }
    )
    form = same_form(measure.readings, pairs)
    trust = assess(measure.measured, ablation, total, above, scores, order, form == PER_PAIR,
                   seed, ids)  # fmt: skip
    curve.attrs = {"target": faithfulness, "chosen": above, "metric": form,
                   "max_bytes": max_bytes, "ablation": ablation, "trust": trust}  # fmt: skip
    return scores.iloc[order[:above]], curve


def _ablations(ablation: str, ablations: Sequence[str], pairs: int) -> list[str]:
    """The ablations to measure, the chosen one first, checked (``check_ablation``). One pair
    has no other to take values from: the resample ablation is then left out of those measured
    beside, and refused as the chosen one."""
    wanted = list(dict.fromkeys([ablation, *ablations]))
    for name in wanted:
        check_ablation(name, pairs if name == ablation else 2)
    return [name for name in wanted if name != "resample" or pairs > 1]


class _Measure:
    """The per-pair metrics of the circuits of the top k edges under each ablation, measured
    exactly (``patch_edges``) once each: ``measured[ablation][k]`` ``[pairs]``; ``readings``
    keeps every call's for their form."""

    def __init__(self, model, task, order, wanted, max_bytes, seed) -> None:
        self.model, self.task, self.order = model, task, order
        self.max_bytes, self.seed = max_bytes, seed
        self.ablation = wanted[0]
        self.measured: dict[str, dict[int, np.ndarray]] = {name: {} for name in wanted}
        self.readings: list[torch.Tensor] = []

    def __call__(self, counts: list[int], name: str | None = None) -> dict[int, float]:
        """The mean metric of each count's circuit under ``name`` (the chosen ablation)."""
        name = name or self.ablation
        todo = [k for k in dict.fromkeys(counts) if k not in self.measured[name]]
        if todo:
            flags = torch.zeros(len(todo), len(self.order), dtype=torch.bool)
            for i, k in enumerate(todo):
                flags[i, torch.from_numpy(self.order[:k])] = True
            values = patch_edges(self.model, *self.task, flags, max_bytes=self.max_bytes,
                                 ablation=name, seed=self.seed)  # fmt: skip
            self.readings.append(values)
            self.measured[name] |= dict(zip(todo, values.double().numpy(), strict=True))
            advance(len(todo))
        return {k: float(self.measured[name][k].mean()) for k in counts}


def _measured(model: nn.Module, clean: dict, pairs: int, points: int, total: int) -> int:
    """The curve's runs at most (the grid, then the bisection), warned of where every pair's
    cannot finish in a day."""
    measured = points + max(1, total).bit_length()
    tokens = clean["input_ids"].shape[-1] if "input_ids" in clean else 1
    long_work("probe.circuit()", f"{pairs:,} pairs", model, pairs * tokens * measured)
    return measured
