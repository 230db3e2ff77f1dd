"""The timeline page's figures, the report's own SVG: per role, each head's score over the
steps, the points where a head holds the role filled in (the holders), its onset marked, and
beside it the model's loss on the run's inputs where it was measured."""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd

from analyses import svg
from analyses.figures import Figure
from analyses.vocabulary import Role
from probe.app.changes import roles_of
from probe.app.timeline_tables import role_score

MAX_HEADS = 8  # heads drawn per role: those that held it, the longest holders first


def role_figures(
    timeline: pd.DataFrame, onsets: pd.DataFrame, losses: Mapping[int, float] | None = None,
    loss_of: str = "its inputs",
) -> list[Figure]:  # fmt: skip
    """One figure per role some head holds and the run scores (``role_score``), in the order
    of ``onsets``' table.

    Parameters
    ----------
    timeline : ``timeline_table``'s table, ``[steps·layers·heads]``
    onsets : ``onsets``' table of it
    losses : {step: loss} on the run's inputs, drawn in a second panel where given
    loss_of : what the loss was measured on, for the panel's title
    """
    figures = []
    for role in dict.fromkeys(onsets.role):
        score = role_score(role, timeline.columns)
        if score is None:
            continue
        own = onsets[onsets.role == role]
        span = (own.last_held - own.first_held).to_numpy()
        chosen = own.iloc[span.argsort(kind="stable")[::-1][:MAX_HEADS]]
        panels = [_role_chart(timeline, role, score, chosen)]
        if losses:
            steps = sorted(losses)
            panels.append(svg.Chart(f"Loss on {loss_of}", [svg.Series(
                "loss", steps, [losses[s] for s in steps], "#333333")], "step", "loss",
                legend=False))  # fmt: skip
        alt = (
            f"Line chart of the {score} of the heads that hold the {role} role at some step, "
            "over the training steps; filled diamonds where a head holds the role, a square "
            "at its onset" + ("; beside it, the loss over the steps." if losses else ".")
        )
        title = f"{role}: each head's {score} over the steps"
        drawing = svg.charts(panels, alt=alt, size=(420, 220))
        figures.append(Figure(f"timeline-{role}", title, alt, drawing))
    return figures


def _role_chart(timeline: pd.DataFrame, role: str, score: str, heads: pd.DataFrame) -> svg.Chart:
    """Per head: its score as a line, the steps where it holds ``role`` as diamonds, its onset
    as a square."""
    colours = svg.spread(svg.VIRIDIS, max(2, len(heads)))
    series = []
    for k, row in enumerate(heads.itertuples()):
        mine = timeline[(timeline.layer == row.layer) & (timeline["head"] == row.head)]
        name, colour = f"{row.layer}-{row.head}", colours[k]
        series.append(svg.Series(name, mine.step.tolist(), mine[score].tolist(), colour,
                                 markers=False))  # fmt: skip
        holds = mine[mine.roles.map(lambda r: role in roles_of(r))]
        series.append(svg.Series(f"{name} holds it", holds.step.tolist(), holds[score].tolist(),
                                 colour, line=False, shape="diamond"))  # fmt: skip
        if not pd.isna(row.onset):
            at = mine[mine.step == row.onset]
            series.append(svg.Series(f"{name} onset", at.step.tolist(), at[score].tolist(),
                                     colour, line=False, shape="square"))  # fmt: skip
    try:
        title = f"{Role(role)} ({Role(role).code})"
    except ValueError:  # a role of an analysis outside probe's vocabulary
        title = role
    return svg.Chart(title, series, "step", score)
