"""How far to trust the circuit analysis's circuit, as tables and in words: the tables made from
``probe.circuit``'s ``Trust`` (``trust_tables``), the run's summary it adds to
``circuit_run`` (and so to ``run.json``), and the page's sentence (``trust_sentence``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from probe.lazy import lazy

if TYPE_CHECKING:
    import pandas as pd

    from analyses.circuit.task import Pair
    from probe.interventions.trust import Trust

np = lazy("numpy")
pd = lazy("pandas")

# What the edges left out can carry (probe.interventions.faithfulness.ABLATIONS, written here
# so that declaring the options imports no numpy; a test checks they agree).
ABLATIONS = ("corrupted", "mean", "zero", "resample")
NAMES = {
    "corrupted": "corrupted patching",
    "mean": "mean ablation",
    "zero": "zero ablation",
    "resample": "resample ablation",
}
UNSTABLE_JACCARD = 0.5  # a circuit whose Jaccard interval reaches below this is called unstable
LOW = 0.5  # a pair below this faithfulness is counted

SCHEMAS = {
    "circuit_stability": {
        "sender": "str", "receiver": "str", "input": "str", "in_circuit": "bool",
        "inclusion": "float", "stable": "bool",
    },
    "circuit_ablations": {
        "ablation": "str", "edges": "int", "total_edges": "int", "faithfulness": "float",
        "low": "float", "high": "float",
    },
    "circuit_scores": {
        "ablation": "str", "chose": "bool", "faithfulness": "float", "low": "float",
        "high": "float", "cpr": "float", "cmd": "float",
    },
    "circuit_pairs": {
        "pair": "int", "clean_text": "str", "corrupted_text": "str", "answer": "str",
        "clean": "float", "ablated": "float", "circuit": "float", "faithfulness": "float",
        "set_aside": "bool",
    },
}  # fmt: skip
RUN = {
    "ablation": "str", "resamples": "int", "stable_edges": "int", "jaccard": "float",
    "jaccard_low": "float", "jaccard_high": "float", "faithfulness_low": "float",
    "faithfulness_high": "float", "cpr": "float", "cmd": "float", "pairs_below_half": "int",
    "pairs_set_aside": "int", "disagreement": "str",
}  # fmt: skip


def trust_tables(
    trust: Trust, scores: pd.DataFrame, prompts: list[Pair] | None
) -> tuple[dict[str, pd.DataFrame], dict[str, Any]]:
    """The trust's tables, and what it adds to the run's row.

    Parameters
    ----------
    trust : probe.interventions.trust.Trust
    scores : pandas.DataFrame
        ``edges``' table with ``in_circuit``, in ``edges``' order (``trust.stability``'s).
    prompts : list of Pair, optional
        The task file's pairs, in the pairs' order; None for the repeats task.
    """
    stability = pd.DataFrame(columns=list(SCHEMAS["circuit_stability"]))
    if trust.stability is not None:
        stability = trust.stability.assign(in_circuit=scores.in_circuit.to_numpy())
        strongest = scores.score.abs().to_numpy().argsort(kind="stable")[::-1]
        stability = stability.iloc[strongest][list(SCHEMAS["circuit_stability"])]
    summary = trust.scores.assign(chose=trust.scores.ablation == trust.ablation)
    pairs = pd.DataFrame(columns=list(SCHEMAS["circuit_pairs"]))
    if trust.pairs is not None:
        pairs = trust.pairs.copy()
        given = prompts is not None
        for column, field in (("clean_text", "clean"), ("corrupted_text", "corrupted"),
                              ("answer", "answer")):  # fmt: skip
            pairs[column] = [getattr(p, field) for p in prompts] if given else ""
    chose = summary.set_index("ablation").loc[trust.ablation]
    kept = pairs[~pairs.set_aside.astype(bool)] if len(pairs) else pairs
    run = {
        "ablation": trust.ablation,
        "resamples": trust.resamples,
        "stable_edges": int(stability.stable[stability.in_circuit].sum()) if len(stability) else 0,
        "jaccard": trust.jaccard,
        "jaccard_low": trust.jaccard_low,
        "jaccard_high": trust.jaccard_high,
        "faithfulness_low": float(chose.low),
        "faithfulness_high": float(chose.high),
        "cpr": float(chose.cpr),
        "cmd": float(chose.cmd),
        "pairs_below_half": int((kept.faithfulness < LOW).sum()) if len(kept) else 0,
        "pairs_set_aside": int(pairs.set_aside.astype(bool).sum()) if len(pairs) else 0,
        "disagreement": trust.disagreement or "",
    }
    return {
        "circuit_stability": stability,
        "circuit_ablations": trust.ablations[list(SCHEMAS["circuit_ablations"])],
        "circuit_scores": summary[list(SCHEMAS["circuit_scores"])],
        "circuit_pairs": pairs[list(SCHEMAS["circuit_pairs"])],
    }, run


def unstable(run: Any) -> bool:
    """Whether the page calls the circuit unstable: its Jaccard's 95% interval reaches below
    ``UNSTABLE_JACCARD`` (resampled circuits often share less than half their edges with it),
    or fewer than half its edges are stable."""
    low = float(run.jaccard_low)
    if math.isnan(low):
        return False
    return low < UNSTABLE_JACCARD or 2 * int(run.stable_edges) < int(run.chosen_edges)


def trust_sentence(tables: dict[str, pd.DataFrame]) -> str | None:
    """The page's sentence on trust, e.g. "stable: 21 of 25 edges in ≥ 90% of resamples
    (Jaccard 0.93 [0.85, 1.00]); faithfulness 0.83 [0.78, 0.88] by corrupted patching, 0.41
    by mean ablation; 3 of 16 pairs below 0.5". None where the run has no trust columns."""
    runs, scores = tables.get("circuit_run"), tables.get("circuit_scores")
    if runs is None or runs.empty or scores is None or scores.empty or "jaccard" not in runs:
        return None
    r = runs.iloc[0]
    parts = []
    if not math.isnan(float(r.jaccard)):
        word = "unstable" if unstable(r) else "stable"
        parts.append(f"{word}: {int(r.stable_edges)} of {int(r.chosen_edges)} edges in ≥ 90% of "
                     f"resamples (Jaccard {r.jaccard:.2f} [{r.jaccard_low:.2f}, "
                     f"{r.jaccard_high:.2f}])")  # fmt: skip
    by = scores.set_index("ablation")
    chose = by.loc[r.ablation]
    text = f"faithfulness {chose.faithfulness:.2f}"
    if not math.isnan(float(chose.low)):
        text += f" [{chose.low:.2f}, {chose.high:.2f}]"
    text += f" by {NAMES[r.ablation]}"
    others = [f"{row.faithfulness:.2f} by {NAMES[name]}" for name, row in by.iterrows()
              if name != r.ablation]  # fmt: skip
    parts.append(", ".join([text, *others]))
    pairs = tables.get("circuit_pairs")
    if pairs is not None and len(pairs):
        kept = len(pairs) - int(r.pairs_set_aside)
        parts.append(f"{int(r.pairs_below_half)} of {kept} pairs below {LOW}")
    sentence = "; ".join(parts)
    if isinstance(r.disagreement, str) and r.disagreement:
        sentence += ". " + r.disagreement.rstrip(".")
    return sentence
