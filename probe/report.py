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

from analyses import Figure, roles
from analyses.roles import BEST_RELATION_COLUMNS
from probe.errors import ProbeError

matplotlib.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "probe", "figure.dpi": 100})

ROLE_CODES = {"previous-token": "P", "next-token": "N", "sink": "S", "broad": "B", "syntactic": "Y"}
# Columns the page reads from heads.csv; an analysis that did not run leaves them empty.
HEAD_COLUMNS = ("roles", *BEST_RELATION_COLUMNS)
TABLES = ("syntax", "syntax_baselines", "syntax_best", "heads", "head_similarity", "spectra")


def read_tables(folder: Path) -> dict[str, pd.DataFrame]:
    """The CSV tables of an earlier run (those that exist)."""
    tables = {}
    for name in TABLES:
        path = folder / f"{name}.csv"
        if path.exists():
            tables[name] = pd.read_csv(path, keep_default_na=False, na_values=[""])
    return tables


def embed(figure: Figure) -> Markup:
    """A figure as a self-contained <img> (PNG) or inline <svg>, with its alt text."""
    buffer = io.BytesIO()
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
    """Write ``index.html`` in ``folder`` from its ``run.json``, CSV tables and examples.

    Parameters
    ----------
    folder : path
        A folder written by ``probe analyze``.

    Returns
    -------
    Path
        The written ``index.html``.
    """
    from analyses import spectra, syntax

    folder = Path(folder)
    try:
        run = json.loads((folder / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ProbeError(f"{folder} is not a probe report folder (no readable run.json)") from e
    tables = read_tables(folder)
    examples_path = folder / "examples.json"
    examples = (
        json.loads(examples_path.read_text(encoding="utf-8"))
        if examples_path.exists()
        else {"sentences": [], "heads": {}}
    )

    figures: dict[str, list[Figure]] = {"syntax": [], "roles": [], "spectra": []}
    if "syntax" in tables:
        figures["syntax"] = syntax.figures(tables)
    if "heads" in tables and "special" in tables["heads"]:
        figures["roles"] = roles.figures(tables)
    if "spectra" in tables:
        figures["spectra"] = spectra.figures(tables)
    rendered = {
        section: [{"figure": f, "html": embed(f)} for f in items]
        for section, items in figures.items()
    }
    for items in figures.values():
        for f in items:
            f.figure.clear()

    heads = tables.get("heads")
    head_sections, grid = [], []
    if heads is not None:
        missing = [c for c in HEAD_COLUMNS if c not in heads]
        heads = heads.assign(**dict.fromkeys(missing, math.nan))
        heads["roles"] = heads["roles"].astype(object).where(heads["roles"].notna(), "")
        heads["best_relation"] = (
            heads["best_relation"].astype(object).where(heads["best_relation"].notna(), "")
        )
        for row in heads.to_dict("records"):
            key = f"{row['layer']}.{row['head']}"
            example = examples["heads"].get(key)
            svg = sentence = None
            if example is not None:
                sentence = examples["sentences"][example["sentence"]]
                svg = attention_svg(sentence["tokens"], example["pattern"])
            head_sections.append({"row": row, "example": example, "sentence": sentence, "svg": svg})
        n_heads = int(heads["head"].max()) + 1
        for layer, part in heads.groupby("layer"):
            cells = []
            for row in part.sort_values("head").to_dict("records"):
                role_list = [r for r in str(row["roles"]).split(";") if r]
                cells.append(
                    {
                        "layer": layer,
                        "head": row["head"],
                        "roles": role_list,
                        "codes": "".join(ROLE_CODES.get(r, "?") for r in role_list),
                        "primary": role_list[0] if role_list else "none",
                        # a relation is only worth showing where it earned the role
                        "relation": row["best_relation"] if "syntactic" in role_list else "",
                        "accuracy": row.get("best_relation_accuracy"),
                    }
                )
            grid.append({"layer": layer, "cells": cells})
    else:
        n_heads = 0

    env = Environment(
        loader=PackageLoader("probe", "templates"),
        autoescape=select_autoescape(["html", "j2"], default_for_string=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["num"] = _number
    env.filters["pct"] = lambda x: "–" if x is None or x != x else f"{100 * x:.1f}%"
    role_counts = {}
    if heads is not None:
        for r in heads["roles"]:
            for role in filter(None, str(r).split(";")):
                role_counts[role] = role_counts.get(role, 0) + 1
    html = env.get_template("report.html.j2").render(
        run=run,
        tables=tables,
        figures=rendered,
        heads=head_sections,
        grid=grid,
        n_heads=n_heads,
        role_codes=ROLE_CODES,
        role_counts=role_counts,
        thresholds=roles.Thresholds(**run.get("thresholds", {})).describe(),
        syntax_best=tables.get("syntax_best"),
        spectra_summary=_spectra_summary(tables.get("spectra")),
    )
    path = folder / "index.html"
    path.write_text(html, encoding="utf-8")
    return path


def _spectra_summary(table: pd.DataFrame | None) -> list[dict]:
    if table is None:
        return []
    summary = table.groupby(["layer", "circuit"]).effective_rank.mean().unstack("circuit")
    return [
        {"layer": layer, "QK": row.get("QK"), "OV": row.get("OV")}
        for layer, row in summary.iterrows()
    ]
