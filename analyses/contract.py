"""The analysis contract: what every analysis must declare (a name, known units and column
types, measures among its head columns, a template with its macros, ``heads`` that give exactly
its declared columns), checked before any compute; ``ContractError`` when it does not.

``analyses.check_analysis`` runs these checks (once per class, and a shipped analysis's template
only in full); this module holds the checks themselves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from analyses.protocol import DTYPES, Analysis
from analyses.vocabulary import Role, Thresholds, unknown_to_report

if TYPE_CHECKING:
    import pandas as pd


class ContractError(ValueError):
    """An analysis breaks the contract every analysis keeps: a programming error, found when the
    analysis is looked up or planned, before any compute."""


def check_declaration(cls: type, key: str | None, *, template: bool, heads: bool) -> None:
    """The checks of ``analyses.check_analysis``: what ``cls`` declares, its ``template`` (parsed)
    and its ``heads`` (run on empty tables) where asked.

    Raises
    ------
    ContractError
        One line naming the analysis and what is wrong.
    """
    from probe.inputs import units

    who = (
        f"analysis {key or getattr(cls, 'name', cls.__name__)!r} ({cls.__module__}.{cls.__name__})"
    )

    def fail(what: str) -> None:
        raise ContractError(f"{who}: {what}")

    if not (isinstance(cls, type) and issubclass(cls, Analysis)):
        fail("is not a subclass of analyses.Analysis")
    for attribute in ("name", "title"):
        if not isinstance(getattr(cls, attribute, None), str):
            fail(f"declares no {attribute}")
    if key is not None and cls.name != key:
        fail(f"is registered as {key!r} but its name is {cls.name!r}; make them equal")
    for unit in cls.units():
        if unit not in units.UNITS:
            fail(f"reads the unknown unit {unit!r}; known: {', '.join(units.UNITS)}")
    stray = [u for u in cls.alongside if u not in cls.units()]
    if stray:
        fail(f"reads {stray[0]!r} alongside other analyses but does not read it (unit)")
    for table, schema in {**cls.tables, "heads.csv": cls.head_columns}.items():
        wrong = {c: t for c, t in schema.items() if t not in DTYPES}
        if wrong:
            fail(f"table {table} has columns of unknown types {wrong}; use {', '.join(DTYPES)}")
    if "heads" in cls.tables:
        fail("declares a table named 'heads', which the run writes from every analysis")
    for measure in cls.measures:
        if measure.column not in cls.head_columns:
            fail(f"measure {measure.column!r} is not one of its head_columns")
    if not isinstance(cls.lm_head, bool):
        fail(f"declares lm_head = {cls.lm_head!r}; make it True or False")
    names = [o.name for o in cls.options]
    if len(set(names)) != len(names):
        fail(f"declares an option twice: {names}")
    if template:
        _check_template(cls, fail)
    if heads:
        _check_heads(cls, fail)


def _check_template(cls: type[Analysis], fail: Callable[[str], None]) -> None:
    """The template parses and defines a ``section`` and a ``card`` macro (its filters are the
    report's, checked when the report is drawn)."""
    from jinja2 import TemplateError

    try:
        macros = _macros(cls.template())
    except (OSError, TemplateError) as e:
        fail(f"its template cannot be read or parsed ({e})")
    for macro in ("section", "card"):
        if macro not in macros:
            fail(f"its template has no {macro!r} macro; add one (it may be empty)")


@functools.lru_cache(maxsize=64)
def _macros(source: str) -> frozenset[str]:
    """The macros a template defines: parsed once per source, since every lookup of an
    analysis checks its template, and a run looks analyses up dozens of times."""
    from jinja2 import Environment, nodes

    return frozenset(m.name for m in Environment().parse(source).find_all(nodes.Macro))


def _check_heads(cls: type[Analysis], fail: Callable[[str], None]) -> None:
    """``heads`` on empty tables of the declared schemas gives exactly ``head_columns``, plus one
    bool column per role it grants."""
    import pandas as pd

    empty = {
        name: pd.DataFrame({c: pd.Series(dtype=DTYPES[t]) for c, t in schema.items()})
        for name, schema in cls.tables.items()
    }
    try:
        part = cls.heads(empty, Thresholds())
    except Exception as e:
        fail(f"heads() fails on empty tables of its declared schemas ({type(e).__name__}: {e})")
    if part is None:
        if cls.head_columns:
            fail(f"declares head_columns {list(cls.head_columns)} but heads() returns None")
        return
    try:
        check_head_columns(cls, part)
    except ContractError as e:
        fail(str(e).split(": ", 1)[1])


def check_head_columns(cls: type[Analysis], part: pd.DataFrame) -> None:
    """``part``, what ``cls.heads`` gave, has ``layer``, ``head``, exactly the declared
    ``head_columns``, and bool columns named by roles.

    Raises
    ------
    ContractError
        Naming the analysis and the columns that differ.
    """
    for role in sorted(set(part.columns) & set(map(str, Role))):
        lacks = unknown_to_report(role)
        if lacks:  # the report could not draw or describe a head holding it
            raise ContractError(
                f"analysis {cls.name!r}: heads() gives the role {role!r}, for which the report "
                f"lacks {'; '.join(lacks)}; add it there"
            )
    columns = set(part.columns) - set(map(str, Role))
    missing = {"layer", "head", *cls.head_columns} - columns
    extra = columns - {"layer", "head", *cls.head_columns}
    if missing or extra:
        raise ContractError(
            f"analysis {cls.name!r}: heads() gives columns that head_columns does not declare "
            f"({', '.join(sorted(extra)) or 'none'}) or lacks declared ones "
            f"({', '.join(sorted(missing)) or 'none'}); make them match"
        )
