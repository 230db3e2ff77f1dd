"""The timeline page's figures, the report's own SVG: per role, each head's score over the
steps, the points where a head holds the role filled in (the holders), its onset marked, and
beside it the model's loss on the run's inputs where it was measured."""

from __future__ import annotations

from collections.abc import Mapping
from html import escape

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


def render_page(
    card: dict, timeline: pd.DataFrame, onsets: pd.DataFrame, by_step: pd.DataFrame,
    losses: Mapping[int, float] | None = None, loss_of: str = "its inputs",
) -> str:  # fmt: skip
    """The timeline's self-contained page: what it found in words (the order of formation,
    moves between heads, identical checkpoints), a chart per role, the holders by step and the
    checkpoints with their reports. Every name and sentence is escaped."""
    figures = role_figures(timeline, onsets, losses, loss_of)
    said = "".join(f"<li>{escape(line)}</li>" for line in card.get("sentences", []))
    warned = "".join(f"<li>{escape(line)}</li>" for line in card.get("warnings", []))
    charts = "".join(
        f'<figure id="{escape(f.id)}"><figcaption>{escape(f.title)}</figcaption>{f.figure}</figure>'
        for f in figures
    )  # the figures are the report's own SVG, their text escaped where drawn (analyses.svg)
    held = by_step.pivot(index="step", columns="role", values="holders") if len(by_step) else None
    holders = (held.fillna("").to_html(escape=True, border=0) if held is not None
               else "<p>No head holds a role at any step.</p>")  # fmt: skip
    rows = "".join(
        f"<tr><td>{c['step']}</td><td><a href=\"steps/step-{c['step']}/index.html\">"
        f"{escape(str(c['name']))}</a></td><td>{escape(str(c['revision'] or ''))}</td>"
        f"<td><code>{escape(str(c['weights_sha256'] or '')[:12])}</code></td></tr>"
        for c in card.get("checkpoints", [])
    )  # fmt: skip
    title = escape(f"Timeline of {card.get('source')}")
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
        f"<style>{STYLE}</style></head><body><h1>{title}</h1>"
        f"<h2>What formed, and when</h2><ul>{said}</ul>"
        + (f'<h2>Warnings</h2><ul class="warnings">{warned}</ul>' if warned else "")
        + f"<h2>Each role's heads over the steps</h2>{charts or '<p>No role to draw.</p>'}"
        f"<h2>The heads that hold each role, by step</h2>{holders}"
        "<h2>Checkpoints</h2><table><tr><th>step</th><th>checkpoint</th><th>revision</th>"
        f"<th>weights (sha256)</th></tr>{rows}</table></body></html>"
    )


STYLE = ("body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem}"
         "table{border-collapse:collapse}td,th{padding:.2rem .6rem;border-bottom:1px solid #ddd}"
         ".warnings{color:#a40}figure{margin:1rem 0}")  # fmt: skip
