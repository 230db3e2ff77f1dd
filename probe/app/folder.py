"""What a report folder must hold before it is rendered or compared: the run card's fields, the
head grid of ``heads.csv``, and the layout's version (``schema`` in ``run.json``).

A folder comes from anywhere (cut by a full disk, edited by hand, written by an older probe), so
each is checked where it is read, and a failure is one line naming the file and what to do.

Layout versions: 1 is every folder written before ``schema`` was recorded; 2 names
importance's ``heads.csv`` column ``importance_effect``; 3, today's, adds the circuit's trust
(``circuit_stability``, ``circuit_ablations``, ``circuit_scores``, ``circuit_pairs`` and the
trust's columns of ``circuit_run``). A later probe that changes the layout
raises ``SCHEMA`` and adds a step to ``MIGRATIONS`` that rewrites what an older folder's files
hold in memory (its files are never changed), e.g. a ``head_stats`` column added with its value
for the older folder, or left empty to say it was not measured. Without a step, a table that
lacks a column is refused in one line naming the probe and layout version that wrote it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from probe.errors import ProbeError

if TYPE_CHECKING:
    import pandas as pd

SCHEMA = 3


def _importance_effect(run: dict, tables: dict) -> None:
    """1 → 2: importance's column of ``heads.csv`` was ``ablation_effect``, which now holds the
    claims' ablation (``analyses.claims``); it is ``importance_effect``."""
    heads = tables.get("heads")
    if heads is not None and "importance" in run.get("analyses", []):
        tables["heads"] = heads.rename(columns={"ablation_effect": "importance_effect"})


def _circuit_trust(run: dict, tables: dict) -> None:
    """2 → 3: the circuit's trust (#63), not measured by the older probe: its tables empty, its
    columns of ``circuit_run`` empty (numbers NaN, counts 0: ``resamples`` 0 says no resample
    was drawn, and the page then states no trust)."""
    if "circuit" not in run.get("analyses", []):
        return
    import pandas as pd

    from analyses import DTYPES
    from analyses.circuit import trust

    for name, schema in trust.SCHEMAS.items():
        if name not in tables:
            tables[name] = pd.DataFrame({c: pd.Series(dtype=DTYPES[k]) for c, k in schema.items()})
    circuit_run = tables.get("circuit_run")
    if circuit_run is not None:
        empty = {"int": 0, "float": math.nan, "str": ""}
        for column, kind in trust.RUN.items():
            if column not in circuit_run:
                circuit_run[column] = empty[kind]


# version -> the step that brings a run card and its tables from that version to the next
MIGRATIONS: dict[int, Callable[[dict, dict], None]] = {1: _importance_effect, 2: _circuit_trust}
# version -> the tables that version added: an older folder lacks their files (see migrate)
ADDED = {3: ("circuit_stability", "circuit_ablations", "circuit_scores", "circuit_pairs")}


def added_since(run: dict) -> set[str]:
    """The tables a layout later than the run's added, which its folder does not hold."""
    return {name for version, names in ADDED.items() if version > run.get("schema", 1)
            for name in names}  # fmt: skip


CARD = {"model": str, "layers": int, "heads": int, "analyses": list}


def check_run(run: object, folder: Path) -> dict:
    """The run card, with its layout brought to today's.

    Raises
    ------
    ProbeError
        For a card that lacks a field or holds a wrong one, or a layout this probe cannot read.
    """
    path = folder / "run.json"
    if not isinstance(run, dict):
        raise ProbeError(f"{folder} is not a probe report folder (no readable run.json: not a "
                         "JSON object); re-run probe analyze")  # fmt: skip
    for name, kind in CARD.items():
        value = run.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ProbeError(f"{folder} is not a probe report folder (no readable run.json: "
                             f"{path.name} has no valid {name!r}, a {kind.__name__}); the folder "
                             "was cut or edited: re-run probe analyze")  # fmt: skip
    if not (1 <= run["layers"] <= 100_000 and 1 <= run["heads"] <= 100_000):
        raise ProbeError(f"{path}: {run['layers']} layers x {run['heads']} heads is no model")
    if not all(isinstance(a, str) for a in run["analyses"]):
        raise ProbeError(f"{path}: 'analyses' must name analyses")
    version = run.get("schema", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ProbeError(f"{path}: layout version {version!r} is not one probe wrote")
    if version > SCHEMA:
        raise ProbeError(
            f"{folder} was written by a newer probe ({_writer(run)}, layout version {version}; "
            f"this probe reads up to {SCHEMA}): upgrade probe to render it"
        )
    return run


def migrate(run: dict, tables: dict) -> None:
    """Bring an older folder's card and tables (as read, before they are typed) to today's
    layout, in memory."""
    for version in range(run.get("schema", 1), SCHEMA):
        MIGRATIONS[version](run, tables)
    run["schema"] = SCHEMA


def missing_columns(path: Path, run: dict, missing: list[str]) -> ProbeError:
    """The one line for a table without the columns this probe's analyses write."""
    shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    return ProbeError(
        f"{path} cannot be read: it lacks columns this probe needs ({shown}); it was written by "
        f"{_writer(run)} (layout version {run.get('schema', 1)}) or cut or edited: re-run probe "
        "analyze to rebuild the folder"
    )


def check_heads(heads: pd.DataFrame, run: dict, path: Path) -> None:
    """``heads.csv`` holds one row per head of the run's grid, with known roles.

    Raises
    ------
    ProbeError
        Naming the first thing wrong.
    """
    from analyses.vocabulary import Role

    layers, n_heads = run["layers"], run["heads"]
    cells = set(zip(heads["layer"], heads["head"], strict=True))
    grid = {(layer, head) for layer in range(layers) for head in range(n_heads)}
    if len(heads) != len(grid) or cells != grid:
        raise ProbeError(
            f"{path} does not hold one row per head of the {layers} x {n_heads} grid in "
            f"run.json ({len(heads)} rows); the folder was cut or edited: re-run probe analyze"
        )
    known = set(map(str, Role))
    for roles in heads["roles"]:
        unknown = [r for r in str(roles).split(";") if r and r not in known]
        if unknown:
            raise ProbeError(f"{path}: unknown role {unknown[0]!r} (known: "
                             f"{', '.join(sorted(known))}); re-run probe analyze")  # fmt: skip
    numbers = heads.select_dtypes("number")
    if any(math.isinf(x) for x in numbers.to_numpy().ravel() if isinstance(x, float)):
        raise ProbeError(f"{path} holds an infinite value; re-run probe analyze")


@contextmanager
def disagreeing(*folders: Path) -> Iterator[None]:
    """Answer in one line what the checks above let through and the tables' readers trip on:
    tables of one folder that disagree with each other (a row of ``syntax.csv`` for a relation
    ``syntax_best.csv`` lacks…), which only an edit or a cut makes."""
    from jinja2 import TemplateError

    try:
        yield
    except (KeyError, ValueError, TypeError, IndexError, AttributeError, ArithmeticError,
            TemplateError) as e:  # fmt: skip
        detail = (str(e).splitlines() or [""])[0][:200]
        raise ProbeError(
            f"the tables of {' and '.join(map(str, folders))} disagree with each other "
            f"({type(e).__name__}: {detail}); the folder was cut or edited: re-run probe analyze"
        ) from None


def _writer(run: dict) -> str:
    packages = run.get("packages")
    version = packages.get("probe") if isinstance(packages, dict) else None
    return f"probe {version}" if isinstance(version, str) else "another probe"
