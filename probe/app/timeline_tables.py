"""``probe timeline``'s tables and sentences, from each checkpoint's ``heads.csv``:

- ``timeline.csv``: a row per step, layer and head, with every column the steps' ``heads.csv``
  have (each per-head score, ``roles``, and ``confirmed`` where claims ran);
- ``roles_by_step.csv``: a row per step and role, with the heads that hold it;
- ``onsets.csv``: a row per head and role it held, with the first step from which it holds the
  role at every later checkpoint, and the step at which its score for the role rose most;
- the page's sentences: the order in which roles formed, and where a role moved between heads.

A head's change from one checkpoint to the next is ``probe.app.changes.head_changes``', the
definition ``probe compare`` uses for its two reports.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import pairwise

import numpy as np
import pandas as pd

from probe.app.changes import head_changes, roles_of
from probe.heads import HeadId

KEYS = ["step", "layer", "head"]
# The heads.csv column that scores each role, the first one a run has (a role given by two
# analyses, previous-token by roles and by taxonomy, is scored by the first): the score whose
# rise marks the role forming. tests/test_timeline.py checks it against the analyses' Measure
# declarations where they name a role.
ROLE_SCORES = {
    "previous-token": ("previous_token_score", "previous"),
    "next-token": ("next",),
    "sink": ("special", "sink_alpha"),
    "broad": ("entropy_normalised",),
    "syntactic": ("best_relation_accuracy",),
    "coreference": ("coref_accuracy",),
    "induction": ("induction_score",),
    "duplicate-token": ("duplicate_token_score",),
    "copying": ("copying_score",),
    "retrieval": ("retrieval_score",),
}


def timeline_table(heads: Mapping[int, pd.DataFrame]) -> pd.DataFrame:
    """``timeline.csv``: every step's ``heads.csv`` stacked.

    Parameters
    ----------
    heads : {step: heads table}
        Each one row per head ``[layers·heads]``, as ``heads.csv`` has it: ``layer``, ``head``,
        the per-head scores, ``roles`` (``;``-joined; empty or NaN for none) and, where claims
        ran, ``confirmed``.

    Returns
    -------
    pandas.DataFrame
        ``[steps·layers·heads]`` rows sorted by step, layer and head: ``step, layer, head``,
        then every column any step has, in the order they first appear (NaN where a step's
        table lacks one); ``roles`` is ``""`` for a head with none.
    """
    if not heads:
        raise ValueError("timeline_table needs at least one step's heads table")
    parts = [table.assign(step=int(step)) for step, table in sorted(heads.items())]
    table = pd.concat(parts, ignore_index=True, sort=False)
    rest = [c for c in table.columns if c not in KEYS]
    table = table[KEYS + rest].sort_values(KEYS, kind="stable").reset_index(drop=True)
    table["roles"] = table["roles"].fillna("").astype(str) if "roles" in table else ""
    return table


def score_columns(timeline: pd.DataFrame) -> list[str]:
    """The numeric per-head columns of a timeline (scores, effects), booleans left out."""
    return [
        c for c in timeline.columns
        if c not in KEYS and pd.api.types.is_numeric_dtype(timeline[c])
        and not pd.api.types.is_bool_dtype(timeline[c])
    ]  # fmt: skip


def role_score(role: str, columns) -> str | None:
    """The column that scores ``role`` among ``columns`` (``ROLE_SCORES``); None if none."""
    return next((c for c in ROLE_SCORES.get(role, ()) if c in columns), None)


def step_changes(timeline: pd.DataFrame) -> pd.DataFrame:
    """Each head's change from one checkpoint to the next (``head_changes``).

    Returns
    -------
    pandas.DataFrame
        ``[(steps - 1)·layers·heads]``: ``step`` (the later checkpoint), ``previous_step``,
        then ``head_changes``' columns for every score column.
    """
    steps = sorted(timeline.step.unique())
    measures = score_columns(timeline)
    parts = []
    for before, after in pairwise(steps):
        a = timeline[timeline.step == before].drop(columns="step")
        b = timeline[timeline.step == after].drop(columns="step")
        change = head_changes(a, b, measures)
        change.insert(0, "previous_step", before)
        change.insert(0, "step", after)
        parts.append(change)
    if not parts:
        return pd.DataFrame(columns=["step", "previous_step", "layer", "head"])
    return pd.concat(parts, ignore_index=True)


def roles_by_step(timeline: pd.DataFrame) -> pd.DataFrame:
    """``roles_by_step.csv``: a row per step and role any step gives, with its holders.

    Returns
    -------
    pandas.DataFrame
        ``[steps·roles]``: ``step, role, holders, count``; ``holders`` the heads holding it
        (``"1-0;1-3"``, in layer and head order; ``""`` where none do at that step). Roles in
        the order they are first held.
    """
    held = _held(timeline)
    roles = list(dict.fromkeys(held.role))
    rows = []
    for step in sorted(timeline.step.unique()):
        at = held[held.step == step]
        for role in roles:
            heads = at[at.role == role]
            rows.append({"step": step, "role": role, "count": len(heads),
                         "holders": ";".join(f"{l}-{h}" for l, h in zip(heads.layer, heads["head"],
                                                                       strict=True))})  # fmt: skip
    return pd.DataFrame(rows, columns=["step", "role", "holders", "count"])


def _held(timeline: pd.DataFrame) -> pd.DataFrame:
    """One row per step, head and role it holds: ``step, layer, head, role``, sorted."""
    rows = [
        (step, layer, head, role)
        for step, layer, head, text in zip(timeline.step, timeline.layer, timeline["head"],
                                           timeline.roles, strict=True)
        for role in sorted(roles_of(text))
    ]  # fmt: skip
    held = pd.DataFrame(rows, columns=["step", "layer", "head", "role"])
    return held.sort_values(KEYS, kind="stable").reset_index(drop=True)


def onsets(timeline: pd.DataFrame) -> pd.DataFrame:
    """``onsets.csv``: a row per head and role it holds at some checkpoint.

    Returns
    -------
    pandas.DataFrame
        ``layer, head, role``; ``onset``, the first step from which the head holds the role
        at every later checkpoint (missing where it does not hold it at the last);
        ``first_held``, ``last_held``; ``score``, the column scoring the role (``ROLE_SCORES``;
        ``""`` where the run has none); ``rise_step``, the checkpoint at which that score rose
        most from the one before (``head_changes``), and ``rise``, by how much (missing where no
        score, or a single checkpoint). Sorted by onset (missing last), layer and head.
    """
    steps = sorted(timeline.step.unique())
    held = _held(timeline)
    changes = step_changes(timeline)
    rows = []
    for (layer, head, role), own in held.groupby(["layer", "head", "role"], sort=False):
        holds = set(own.step)
        onset = None
        for step in reversed(steps):  # back from the last checkpoint while it holds
            if step not in holds:
                break
            onset = step
        score = role_score(role, timeline.columns)
        rise_step, rise = None, np.nan
        if score is not None and len(steps) > 1:
            mine = changes[(changes.layer == layer) & (changes["head"] == head)]
            rises = mine[f"{score}_change"].to_numpy(dtype=float)
            if np.isfinite(rises).any():
                at = int(np.nanargmax(rises))
                rise_step, rise = int(mine.step.iloc[at]), float(rises[at])
        rows.append({"layer": layer, "head": head, "role": role, "onset": onset,
                     "first_held": min(holds), "last_held": max(holds), "score": score or "",
                     "rise_step": rise_step, "rise": rise})  # fmt: skip
    columns = ["layer", "head", "role", "onset", "first_held", "last_held", "score",
               "rise_step", "rise"]  # fmt: skip
    table = pd.DataFrame(rows, columns=columns)
    for c in ("onset", "first_held", "last_held", "rise_step"):
        table[c] = table[c].astype("Int64")
    return table.sort_values(["onset", "layer", "head"], na_position="last",
                             kind="stable").reset_index(drop=True)  # fmt: skip


def head_list(heads) -> str:
    """Heads in words, runs of a layer's consecutive heads joined: ``[(1, 0), (1, 1), (1, 2),
    (1, 3), (0, 2)]`` → ``"0-2, 1-0..1-3"``; two consecutive heads are named both (``1-0,
    1-1``)."""
    heads = sorted({HeadId(int(layer), int(head)) for layer, head in heads})
    runs: list[list[HeadId]] = []
    for h in heads:
        if runs and runs[-1][-1].layer == h.layer and runs[-1][-1].head + 1 == h.head:
            runs[-1].append(h)
        else:
            runs.append([h])
    parts = []
    for run in runs:
        parts += [f"{run[0]}..{run[-1]}"] if len(run) > 2 else [str(h) for h in run]
    return ", ".join(parts)


def formation_sentence(
    table: pd.DataFrame, losses: Mapping[int, float] | None = None, loss_of: str = "its inputs"
) -> str | None:
    """The order in which roles formed, in words, from ``onsets``' table: each role's heads
    with their onset, roles in the order of their first onset; the loss beside a role's first
    onset where it fell markedly (by at least a tenth of its whole fall over the run) since the
    checkpoint before.

    "previous-token 0-0 from step 200; induction 1-1 from step 600, 1-0, 1-2..1-3 from step
    800, as the loss on repeated tokens fell from 3.90 to 0.40"

    Parameters
    ----------
    table : ``onsets``' table
    losses : {step: the model's loss on the run's inputs}, where it was measured
    loss_of : what the loss was measured on, for the sentence

    Returns None where no role holds at the last checkpoint.
    """
    formed = table[table.onset.notna()]
    if formed.empty:
        return None
    losses = dict(losses or {})
    steps = sorted(losses)
    total_fall = max(losses.values()) - min(losses.values()) if losses else 0.0
    first = formed.groupby("role", sort=False).onset.min().sort_values(kind="stable")
    parts = []
    for role, start in first.items():
        own = formed[formed.role == role]
        groups = [
            f"{head_list(zip(g.layer, g['head'], strict=True))} from step {int(step)}"
            for step, g in own.groupby("onset", sort=True)
        ]
        text = f"{role} {', '.join(groups)}"
        before = [s for s in steps if s < start]
        if before and start in losses and total_fall > 0:
            a, b = losses[before[-1]], losses[int(start)]
            if a - b >= 0.1 * total_fall:
                text += f", as the loss on {loss_of} fell from {a:.2f} to {b:.2f}"
        parts.append(text)
    return "; ".join(parts)


def move_sentences(timeline: pd.DataFrame) -> list[str]:
    """Where a role moved from one head to another: at a checkpoint where some heads lost it and
    others gained it (``head_changes``' ``roles_lost`` and ``roles_gained``), and where heads
    held a role and no longer hold it at the last checkpoint.

    "induction moved from 1-1 to 1-2 at step 900"; "name-mover: 4-6 held it from step 2000 to
    step 9000, not after"
    """
    changes = step_changes(timeline)
    lines = []
    for step, at in changes.groupby("step", sort=True):
        lost = _by_role(at, "roles_lost")
        gained = _by_role(at, "roles_gained")
        for role in lost:
            if role in gained:
                lines.append(f"{role} moved from {head_list(lost[role])} to "
                             f"{head_list(gained[role])} at step {step}")  # fmt: skip
    last = timeline.step.max()
    table = onsets(timeline)
    gone = table[table.onset.isna()]
    for row in gone.itertuples():
        if row.last_held < last:
            lines.append(f"{row.role}: {row.layer}-{row.head} held it from step "
                         f"{row.first_held} to step {row.last_held}, not after")  # fmt: skip
    return lines


def _by_role(changes: pd.DataFrame, column: str) -> dict[str, list[tuple[int, int]]]:
    out: dict[str, list[tuple[int, int]]] = {}
    for layer, head, text in zip(changes.layer, changes["head"], changes[column], strict=True):
        for role in roles_of(text):
            out.setdefault(role, []).append((int(layer), int(head)))
    return out


def sentences(
    timeline: pd.DataFrame, losses: Mapping[int, float] | None = None,
    loss_of: str = "its inputs", warnings: list[str] | None = None,
) -> list[str]:  # fmt: skip
    """What the timeline's page says in words: the order of formation, then each move of a
    role between heads, then each warning (identical weights)."""
    first = formation_sentence(onsets(timeline), losses, loss_of)
    found = [f"Roles formed in this order: {first}." if first else
             "No role holds at the last checkpoint."]  # fmt: skip
    found += [f"{line[0].upper()}{line[1:]}." for line in move_sentences(timeline)]
    return found + list(warnings or [])
