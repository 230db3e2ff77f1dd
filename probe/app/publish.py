"""A run's report, published: the analyses finished into tables (``publish``), the tables of
heads joined into ``heads.csv`` with their roles (``join_heads``), and the tables, examples,
page and ``run.json`` written into the staging folder that takes the output's place at once
(``probe.app.output.reserved``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import analyses
from analyses.vocabulary import Role, Thresholds
from probe.app import tables as table_io
from probe.app.card import Clock
from probe.app.execute import Outcome
from probe.app.output import write_file
from probe.app.plan import Plan
from probe.errors import ProbeError
from probe.pipeline import helper


def publish(plan: Plan, outcome: Outcome, folder: Path, status: Callable[[str], None]) -> None:
    """Finish the analyses into tables, and write them, the examples, the report and
    ``run.json`` into ``folder`` (the staging folder that ``reserved`` moves into place)."""
    from probe.app.page import compile_templates

    clock = Clock()
    # first: the helper process compiled the templates while torch imported, and answers at
    # once, where it would answer only after a fit handed to it
    compile_templates([analysis.name for analysis in outcome.analyses])
    classes = [type(a) for a in outcome.analyses]
    schemas = table_io.schemas(classes)
    handed = {analysis.name: analysis.hand_off() for analysis in outcome.analyses}
    # While the helper process works on what was handed to it, this one imports the page and
    # finishes the other analyses; those that wait on the helper finish last. The helper then
    # writes the files, each queued behind that work, while this one goes on.
    from probe.app import examples as examples_io
    from probe.app.report import render_html

    finished, tables, written = {}, {}, []
    # Those that read the others' heads (claims tested by ablation) finish after them.
    last = [a for a in outcome.analyses if a.reads_heads]
    for analysis in sorted(outcome.analyses, key=lambda a: (a.reads_heads, handed[a.name])):
        status(f"finishing: {analysis.title.lower()}")
        started = time.perf_counter()
        if analysis.reads_heads:
            others = [type(a) for a in outcome.analyses if a not in last]
            analysis.take_heads(join_heads(others, finished, plan.thresholds, outcome.n_layers,
                                           outcome.n_heads))  # fmt: skip
        done = analysis.finish()
        outcome.card.finish_s[analysis.name] = round(time.perf_counter() - started, 3)
        finished |= done
        for name in (name for name in done if name in schemas):
            tables[name] = table_io.typed(done[name], schemas[name], name)
            written.append(helper.submit(table_io.write, tables[name], folder / f"{name}.csv"))
    heads = join_heads(classes, finished, plan.thresholds, outcome.n_layers, outcome.n_heads)
    tables["heads"] = table_io.typed(heads, schemas["heads"], "heads")
    written.append(helper.submit(table_io.write, tables["heads"], folder / "heads.csv"))
    tables = {name: tables[name] for name in schemas}
    _summaries(outcome.card, tables)
    clock.lap("tables")
    examples = {"sentences": [], "heads": {}}
    if outcome.examples is not None:
        chosen, patterns = outcome.examples.choose(tables["heads"]), outcome.examples.patterns()
        written.append(helper.submit(examples_io.write, folder, chosen, patterns))
        examples = examples_io.assemble(chosen, patterns)
    status("rendering the report")
    card = outcome.card
    card.timings_s |= clock.timings
    html = render_html(card.as_dict(), tables, examples)
    write_file(folder / "index.html", html)
    for pending in written:  # every file in place (or written here, where the helper failed)
        pending.result()
    _check_written(folder, tables)
    clock.lap("render")
    card.timings_s["render"] = clock.timings["render"]
    card.timings_s["total"] = round(sum(v for k, v in card.timings_s.items() if k != "total"), 3)
    write_file(folder / "run.json", json.dumps(card.as_dict(), indent=2))


def _check_written(folder: Path, tables: dict) -> None:
    """Every table is in the folder before it is published (the helper wrote it, or the run)."""
    missing = [name for name in tables if not (folder / f"{name}.csv").is_file()]
    if missing:
        raise ProbeError(f"the report's table {missing[0]}.csv was not written; nothing was "
                         "replaced: re-run probe analyze")  # fmt: skip


def join_heads(
    classes: Sequence[type[analyses.Analysis]],
    tables: dict,
    thresholds: Thresholds,
    n_layers: int,
    n_heads: int,
):
    """``heads``: one row per head, joining what every analysis says about it, with its roles.

    Returns
    -------
    pandas.DataFrame
        ``layer``, ``head``, each analysis's ``head_columns`` (in the run's order), and
        ``roles`` (the roles granted, ``;``-separated, in the order of ``Role``).

    Raises
    ------
    analyses.ContractError
        When an analysis's ``heads`` gives columns other than those it declares.
    """
    import pandas as pd

    from probe.heads import all_heads

    heads = pd.DataFrame(all_heads(n_layers, n_heads), columns=["layer", "head"])
    granted = {}  # role -> held, per head: a role two analyses grant is held where either does
    for cls in classes:
        part = cls.heads(tables, thresholds)
        if part is not None:
            analyses.check_head_columns(cls, part)
            heads = heads.merge(part, on=["layer", "head"], how="left")
            for role in map(str, Role):
                if role in heads:
                    held = heads.pop(role).astype("boolean").fillna(False).to_numpy()
                    granted[role] = granted[role] | held if role in granted else held
    granted = {role: granted[role] for role in map(str, Role) if role in granted}
    heads["roles"] = [
        ";".join(role for role, held in granted.items() if held[i]) for i in range(len(heads))
    ]
    return heads


def _summaries(card, tables: dict) -> None:
    """What ``run.json`` repeats of the tables: the claims' ablations (``claims_run``) and the
    circuit's summary (``circuit_run``'s row)."""
    if "claims_run" in tables:
        card.claims = json.loads(tables["claims_run"].to_json(orient="records"))
    if "circuit_run" in tables and len(tables["circuit_run"]):
        card.circuit = json.loads(tables["circuit_run"].to_json(orient="records"))[0]
