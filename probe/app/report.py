"""Render a report folder's tables as one self-contained ``index.html``.

Everything the page needs is inside it: CSS and the small sorting script inline, heatmaps as
base64 PNG, line charts and example attention maps as inline SVG. Every text that comes from the
model or the treebank is escaped (Jinja2 autoescaping), so a token like ``</script>`` is shown,
never run.
"""

from __future__ import annotations

import base64
import io
import json
import math
import re
from pathlib import Path

import matplotlib
import pandas as pd
from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup, escape

import analyses
from analyses.figures import Figure
from analyses.vocabulary import Role, Thresholds
from probe.app import tables as table_io
from probe.errors import ProbeError
from probe.heads import HeadId

# Below this many sentences a report says, at the top, that its findings are preliminary (the
# 76-sentence sample gives 35 sink heads where 300 EWT sentences give 14).
PRELIMINARY = 500

matplotlib.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "probe", "figure.dpi": 100})


def read_report(folder: Path) -> tuple[dict, dict[str, pd.DataFrame], dict]:
    """The run card, typed tables and examples of a folder written by ``probe analyze``.

    Raises
    ------
    ProbeError
        Naming the file that is missing or malformed.
    """
    try:
        run = json.loads((folder / "run.json").read_text(encoding="utf-8"))
        classes = [analyses.get(name) for name in run["analyses"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ProbeError(f"{folder} is not a probe report folder (no readable run.json)") from e
    try:
        Thresholds(**run.get("thresholds", {}))
    except (TypeError, ValueError) as e:
        raise ProbeError(f"{folder / 'run.json'}: bad thresholds ({e})") from None
    tables = {}
    for name, schema in table_io.schemas(classes).items():
        path = folder / f"{name}.csv"
        try:
            tables[name] = table_io.read(path, schema)
        except (OSError, ValueError) as e:
            raise ProbeError(f"{path} cannot be read ({str(e).splitlines()[0]})") from None
    return run, tables, read_examples(folder / "examples.json")


def read_examples(path: Path) -> dict:
    """``examples.json``, checked: each head's example names one of its sentences."""
    if not path.exists():
        return {"sentences": [], "heads": {}}
    try:
        examples = json.loads(path.read_text(encoding="utf-8"))
        n = len(examples["sentences"])
        if any(not 0 <= int(h["sentence"]) < n for h in examples["heads"].values()):
            raise ValueError("a head's example sentence is out of range")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ProbeError(f"{path} is malformed ({str(e).splitlines()[0]})") from None
    return examples


def embed(figure: Figure) -> Markup:
    """A figure as a self-contained <img> (PNG) or inline <svg>, with its alt text."""
    buffer = io.BytesIO()
    if figure.format == "markup":
        return Markup(figure.figure)
    if figure.format == "svg":
        figure.figure.savefig(buffer, format="svg", metadata={"Date": None})
        svg = buffer.getvalue().decode()
        svg = svg[svg.index("<svg") :]  # drop the XML prolog and the DOCTYPE's external DTD
        svg = re.sub(r"<metadata>.*?</metadata>", "", svg, flags=re.S)
        svg = svg.replace("<svg ", f'<svg role="img" aria-label="{escape(figure.alt)}" ', 1)
        return Markup(svg)
    figure.figure.savefig(buffer, format="png", dpi=100)
    data = base64.b64encode(buffer.getvalue()).decode()
    return Markup(
        f'<img src="data:image/png;base64,{data}" alt="{escape(figure.alt)}" loading="lazy">'
    )


def attention_svg(
    tokens: list[str], pattern: list[list[float]], floor: float = 0.04, per_token: int = 4
) -> Markup:
    """bertviz-style map: tokens on the left attend to tokens on the right; line opacity is the
    weight. Each token's ``per_token`` largest weights of at least ``floor`` are drawn (a broad
    head would otherwise draw every pair and weigh down the page)."""
    row, width, left, right = 17, 330, 110, 220
    height = row * len(tokens) + 8
    parts = [
        f'<svg class="attn" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        'role="img" aria-label="attention from each token (left) to each token (right)">'
    ]
    for i, weights in enumerate(pattern):
        y1 = row * i + 12
        strongest = sorted(range(len(weights)), key=weights.__getitem__, reverse=True)
        for j in strongest[:per_token]:
            w = weights[j]
            if w >= floor:
                y2 = row * j + 12
                parts.append(
                    f'<line x1="{left + 4}" y1="{y1 - 4}" x2="{right - 4}" y2="{y2 - 4}" '
                    f'stroke-opacity="{min(w, 1):.2f}" stroke-width="{1 + 2 * w:.1f}"/>'
                )
    for i, token in enumerate(tokens):
        y = row * i + 12
        text = escape(token)
        parts.append(f'<text x="{left}" y="{y}" text-anchor="end">{text}</text>')
        parts.append(f'<text x="{right}" y="{y}">{text}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


def _number(x, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def render(folder: str | Path) -> Path:
    """Write ``index.html`` in ``folder`` again from its ``run.json``, tables and examples.

    Parameters
    ----------
    folder : path
        A folder written by ``probe analyze``.

    Returns
    -------
    Path
        The written ``index.html``.
    """
    folder = Path(folder)
    html = render_html(*read_report(folder))
    path = folder / "index.html"
    try:
        path.write_text(html, encoding="utf-8")
    except OSError as e:
        raise ProbeError(f"cannot write {path} ({e.strerror})") from None
    return path


def _treebank(path: str) -> Markup:
    """A treebank as the run card names it: a bundled one by name, not by this machine's path."""
    from probe.treebank import BUNDLED

    names = {
        str(BUNDLED["ewt-dev"]): "UD English EWT r2.15 dev (bundled with probe; CC BY-SA 4.0)",
        str(BUNDLED["sample"]): "the hand-written sample (bundled with probe)",
    }
    return Markup(escape(names[path])) if path in names else Markup(f"<code>{escape(path)}</code>")


def environment() -> Environment:
    """The Jinja environment of every page probe writes: its templates, everything escaped."""
    return Environment(
        loader=PackageLoader("probe.app", "templates"),
        autoescape=select_autoescape(["html", "j2"], default_for_string=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )


def render_html(run: dict, tables: dict[str, pd.DataFrame], examples: dict) -> str:
    """The report page: the run card, an overview of every head's roles, one section per
    analysis (its template's ``section`` macro), and a card per head."""
    env = environment()
    env.filters["num"] = _number
    env.filters["pct"] = lambda x: "–" if x is None or x != x else f"{100 * x:.1f}%"
    env.globals["HeadId"] = HeadId
    env.globals["PRELIMINARY"] = PRELIMINARY
    env.filters["treebank"] = _treebank

    sections = []
    for name in run["analyses"]:
        cls = analyses.get(name)
        figures = cls.figures(tables)
        sections.append(
            {
                "name": name,
                "title": cls.title,
                "figures": [{"figure": f, "html": embed(f)} for f in figures],
                "data": cls.section(tables, run),
                "macros": env.from_string(cls.template()).module,
            }
        )
        for f in figures:
            if not isinstance(f.figure, str):  # a matplotlib figure, whose memory is freed now
                f.figure.clear()

    heads = tables["heads"]
    rows = heads.to_dict("records")
    cards = []
    for row in rows:
        head = HeadId(row["layer"], row["head"])
        example = examples["heads"].get(head.key)
        svg = sentence = None
        if example is not None:
            sentence = examples["sentences"][example["sentence"]]
            svg = attention_svg(sentence["tokens"], example["pattern"])
        roles = [r for r in row["roles"].split(";") if r]
        cards.append({"id": head, "row": row, "roles": roles, "example": example,
                      "sentence": sentence, "svg": svg})  # fmt: skip
    grid = []
    for layer, part in heads.groupby("layer"):
        cells = []
        for row in part.sort_values("head").to_dict("records"):
            roles = [Role(r) for r in row["roles"].split(";") if r]
            syntactic = Role.SYNTACTIC in roles
            cells.append(
                {
                    "id": HeadId(row["layer"], row["head"]),
                    "roles": roles,
                    # a role whose 95% interval reaches below its threshold is marked "?"
                    "codes": "".join(
                        r.code + ("?" if str(r) in str(row.get("uncertain_roles", "")) else "")
                        for r in roles
                    ),
                    "primary": roles[0] if roles else "none",
                    # a relation is only worth showing where it earned the role
                    "relation": row.get("best_relation", "") if syntactic else "",
                    "accuracy": row.get("best_relation_accuracy"),
                }
            )
        grid.append({"layer": layer, "cells": cells})
    role_counts = {}
    for r in heads["roles"]:
        for role in filter(None, r.split(";")):
            role_counts[role] = role_counts.get(role, 0) + 1
    return env.get_template("report.html.j2").render(
        run=run,
        sections=sections,
        cards=cards,
        grid=grid,
        n_heads=int(heads["head"].max()) + 1,
        roles=list(Role),
        role_counts=role_counts,
        thresholds=Thresholds(**run.get("thresholds", {})),
    )
