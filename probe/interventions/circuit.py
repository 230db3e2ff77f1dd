"""The circuit search: the fewest top-scoring edges whose circuit recovers a share of the clean
metric (``circuit``), ranked by their scores (``edge_scores``) and measured exactly
(``edge_patching``), with the faithfulness curve it searched along.
"""

from __future__ import annotations

import pandas as pd
import torch
from torch import nn

from probe.errors import ProbeError
from probe.interventions.edge_patching import patch_edges
from probe.interventions.edge_scores import edges
from probe.interventions.gradients import memory_budget
from probe.interventions.guard import keeps_model
from probe.interventions.pairs import Batch, Metric, as_pairs, same_form
from probe.interventions.progress import advance, finish, long_work, shown


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
        by ``edges``; ``attrs["target"]``, ``attrs["chosen"]`` and ``attrs["metric"]`` (its
        form).

    Raises
    ------
    ProbeError
        Where the clean and corrupted inputs score alike (faithfulness is then undefined).
    """
    if not 0 <= faithfulness <= 1:
        raise ProbeError(f"faithfulness must be in [0, 1], not {faithfulness}")
    if points < 2:
        raise ProbeError(f"points must be at least 2 (no edge and every edge), not {points}")
    max_bytes = memory_budget(model, max_bytes)  # once: every call below holds the same
    if scores is None:
        scores = edges(
            model, clean, corrupted, metric, method, steps, max_bytes=max_bytes, progress=progress
        )
    total = len(scores)
    order = scores.score.abs().to_numpy().argsort(kind="stable")[::-1].copy()

    def kept_for(counts: list[int]) -> torch.Tensor:
        flags = torch.zeros(len(counts), total, dtype=torch.bool)
        for i, k in enumerate(counts):
            flags[i, torch.from_numpy(order[:k])] = True
        return flags

    clean, corrupted, pairs = as_pairs(clean, corrupted, model)
    measured = _measured(model, clean, pairs, points, total)
    readings = []

    def measure(counts: list[int]) -> dict[int, float]:
        flags = kept_for(counts)
        values = patch_edges(model, clean, corrupted, metric, flags, max_bytes=max_bytes)
        readings.append(values)
        advance(len(counts))
        return {k: float(v) for k, v in zip(counts, values.mean(-1), strict=True)}

    with shown("circuit", measured, progress, "curve point") as bar:
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
        finish(bar)  # the bisection ended, often before its bound: full
    curve = pd.DataFrame(
        {
            "edges": sorted(found),
            "total_edges": total,
            "faithfulness": [faith(k) for k in sorted(found)],
        }
    )
    curve.attrs = {"target": faithfulness, "chosen": above, "metric": same_form(readings, pairs),
                   "max_bytes": max_bytes}  # fmt: skip
    return scores.iloc[order[:above]], curve


def _measured(model: nn.Module, clean: dict, pairs: int, points: int, total: int) -> int:
    """The curve's runs at most (the grid, then the bisection), warned of where every pair's
    cannot finish in a day."""
    measured = points + max(1, total).bit_length()
    tokens = clean["input_ids"].shape[-1] if "input_ids" in clean else 1
    long_work("probe.circuit()", f"{pairs:,} pairs", model, pairs * tokens * measured)
    return measured
