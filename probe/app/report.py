"""Render a report folder's tables as one self-contained ``index.html``.

Everything the page needs is inside it: CSS and the small sorting script inline, figures and
example attention maps as inline SVG. Every text that comes from the model or the treebank is
escaped (Jinja2 autoescaping, ``analyses.svg``), so a token like ``</script>`` is shown, never
run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
from markupsafe import Markup

import analyses
from analyses.figures import Figure
from analyses.vocabulary import Direction, Role, Thresholds
from probe.app import examples as examples_io
from probe.app import findings
from probe.app import tables as table_io
from probe.app.page import (
    compile_templates,
    compiled,
    page_environment,
    page_template,
)
from probe.errors import ProbeError
from probe.heads import HeadId
from probe.patterns.viewer import View, viewer_script


def read_report(folder: Path) -> tuple[dict, dict[str, pd.DataFrame], dict]:
    """The run card, typed tables and examples of a folder written by ``probe analyze``,
    checked (``probe.app.folder``) and brought to today's layout.

    Raises
    ------
    ProbeError
        Naming the file that is missing or malformed, or the layout version it cannot read.
    """
    from probe.app import folder as layout

    try:
        run = json.loads((folder / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ProbeError(f"{folder} is not a probe report folder (no readable run.json)") from e
    run = layout.check_run(run, folder)
    unknown = [name for name in run["analyses"] if name not in analyses.REGISTRY]
    if unknown:
        raise ProbeError(f"{folder / 'run.json'} names an analysis this probe does not have "
                         f"({unknown[0]!r}); render it with the probe that wrote it")  # fmt: skip
    classes = [analyses.get(name) for name in run["analyses"]]
    try:
        Thresholds(**run.get("thresholds", {}))
    except (TypeError, ValueError) as e:
        raise ProbeError(f"{folder / 'run.json'}: bad thresholds ({e})") from None
    schemas, tables = table_io.schemas(classes), {}
    later = layout.added_since(run)
    for step in ("load", "typed"):  # an older layout is migrated in between
        for name, schema in schemas.items():
            path = folder / f"{name}.csv"
            if step == "load" and name in later and not path.exists():
                continue  # a table its layout did not have: the migration adds it
            try:
                if step == "load":
                    tables[name] = table_io.load(path, schema)
                else:
                    tables[name] = table_io.typed(tables[name], schema, name)
            except table_io.MissingColumnsError as e:
                raise layout.missing_columns(path, run, e.missing) from None
            except (OSError, ValueError, OverflowError) as e:
                raise ProbeError(f"{path} cannot be read ({str(e).splitlines()[0]})") from None
        if step == "load":
            layout.migrate(run, tables)
    layout.check_heads(tables["heads"], run, folder / "heads.csv")
    return run, tables, examples_io.read(folder, run["layers"], run["heads"])


def embed(figure: Figure) -> Markup:
    """A figure's inline SVG, as the page embeds it (drawn and escaped by ``analyses.svg``)."""
    return Markup(figure.figure)


def head_view(examples: dict, head: HeadId) -> tuple[Markup, str | None] | None:
    """A head's card view: its example sentences (navigable; the head view beside the heatmap),
    with the gold arcs of its relation, or of every dependency for a head without one; and, when
    the head gets its relation wrong on every sentence, a line saying so (the card then does not
    lead with the example)."""
    chosen = examples["heads"].get(head.key)
    if chosen is None:
        return None
    relation, direction = chosen["relation"], chosen["direction"]
    tokens, patterns, arcs, captions = [], [], [], []
    for shown in chosen["shown"]:
        sentence = examples["sentences"][shown["sentence"]]
        tokens.append(sentence["tokens"])
        patterns.append(sentence["pattern"][head.layer, head.head][None, None])
        arcs.append(gold_arcs(sentence, relation, direction))
        caption = "“" + " ".join(sentence["words"]) + "”"
        if relation == examples_io.COREFERENCE:
            caption += (f": from {shown['correct']} of {shown['words']} mention(s) it attends "
                        "most to an antecedent")  # fmt: skip
        elif relation:
            caption += (f": gets {shown['correct']} of {shown['words']} {relation} word(s) right "
                        f"({Direction(direction).label})")  # fmt: skip
        captions.append(caption)
    view = View(tokens, patterns, arcs=arcs, captions=captions, view="both")
    wrong = relation is not None and chosen["shown"][0]["correct"] == 0
    miss = f"wrong on every example sentence ({relation})" if wrong else None
    return Markup(view.html(script=False)), miss


def gold_arcs(sentence: dict, relation: str | None, direction: str | None) -> list[tuple[int, int]]:
    """The treebank's arcs as (query, key) token pairs, first token to first token: those of
    ``relation`` read in ``direction``, or every arc from dependent to head; for coreference,
    from each scored mention's head word to its antecedents'."""
    first = {}
    for position, word in enumerate(sentence["word_of_token"]):
        first.setdefault(word, position)
    if relation == examples_io.COREFERENCE:
        return [(first[m], first[a]) for m, antecedents in sentence.get("coreference", [])
                for a in antecedents if m in first and a in first]  # fmt: skip
    arcs = []
    for word, (head, rel) in enumerate(zip(sentence["heads"], sentence["relations"], strict=True)):
        if head < 0 or word not in first or head not in first:
            continue
        if relation is None or rel == relation:
            pair = (first[word], first[head])
            arcs.append(pair[::-1] if direction == Direction.HEAD_TO_DEPENDENT else pair)
    return arcs


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
    from probe.app.folder import disagreeing
    from probe.app.output import locked, write_file

    folder = Path(folder)
    if not folder.is_dir():
        raise ProbeError(f"{folder} is not a folder; give a folder written by probe analyze")
    with locked(folder):  # not while `analyze --overwrite` replaces it
        report = read_report(folder)
        with disagreeing(folder):
            html = render_html(*report)
        return write_file(folder / "index.html", html)


def _grid(heads: pd.DataFrame, measures: list[analyses.Measure]) -> list[dict]:
    """The overview: per layer, each head's roles, with the measures the analyses show for a
    role it holds (a syntactic head's relation and accuracy)."""
    grid = []
    for layer, part in heads.groupby("layer"):
        cells = []
        for row in part.sort_values("head").to_dict("records"):
            roles = [Role(r) for r in row["roles"].split(";") if r]
            shown = [m for m in measures if m.role in roles and m.column in row]
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
                    "label": " ".join(m.show(row[m.column]) for m in shown if m.format == "text"),
                    "notes": "; ".join(f"{m.label} {m.show(row[m.column])}" for m in shown),
                }
            )
        grid.append({"layer": layer, "cells": cells})
    return grid


def render_html(run: dict, tables: dict[str, pd.DataFrame], examples: dict) -> str:
    """The report page: the overview first (what the analyses found, every head's roles), one
    section per analysis (its template's ``section`` macro), a card per head, and the run card
    (collapsed)."""
    env = page_environment()
    compile_templates(run["analyses"])
    classes = [analyses.get(name) for name in run["analyses"]]
    sections = []
    for cls in classes:
        figures = cls.figures(tables)
        data = cls.section(tables, run)  # the card macro reads it too
        names = env.make_globals({"measures": cls.measures, "data": data})
        code = compiled(cls.template())
        macros = env.template_class.from_code(env, code, names).module
        sections.append(
            {
                "name": cls.name,
                "title": cls.title,
                "figures": [{"figure": f, "html": embed(f)} for f in figures],
                "data": data,
                "macros": macros,
            }
        )

    heads = tables["heads"]
    thresholds = Thresholds(**run.get("thresholds", {}))
    tested = tested_roles(classes, tables, thresholds)
    cards = []
    for row in heads.to_dict("records"):
        head = HeadId(row["layer"], row["head"])
        view, miss = head_view(examples, head) or (None, None)
        roles = [r for r in row["roles"].split(";") if r]
        cards.append({"id": head, "row": row, "roles": roles, "view": view, "miss": miss,
                      "line": findings.describe(row, bool(tested))})  # fmt: skip
    grid = _grid(heads, [m for cls in classes for m in cls.measures if m.role is not None])
    answers = [{"name": cls.name, "title": cls.title, "text": a.text,
                "heads": [HeadId(layer, head) for layer, head in a.heads]}
               for cls in classes if (a := cls.answer(tables, run)) is not None]  # fmt: skip
    role_counts = {}
    for r in heads["roles"]:
        for role in filter(None, r.split(";")):
            role_counts[role] = role_counts.get(role, 0) + 1
    return page_template().render(
        run=run,
        viewer_script=Markup(viewer_script()) if any(c["view"] for c in cards) else "",
        sections=sections,
        cards=cards,
        grid=grid,
        n_heads=int(heads["head"].max()) + 1,
        roles=list(Role),
        tested=tested,
        role_counts=role_counts,
        lead=findings.lead(heads, tables),
        answers=answers,
        finish_reads={cls.name: cls.finish_reads(tables, run) for cls in classes},
        thresholds=thresholds,
    )


def tested_roles(classes, tables: dict[str, pd.DataFrame], thresholds: Thresholds) -> list[Role]:
    """The roles the run's analyses test (grant to a head or not), in the order of ``Role``."""
    tested = set()
    for cls in classes:
        part = cls.heads(tables, thresholds)
        if part is not None:
            tested |= set(part.columns) & set(map(str, Role))
    return [role for role in Role if str(role) in tested]
