"""What changed in each head between two reports of the same shape: the one definition that
``probe compare`` (report A against report B) and ``probe timeline`` (each checkpoint against
the one before it) share, so that a comparison is a timeline of two points.

A head's change in a measure is its value in B minus its value in A (NaN where either is
missing); the roles it gained are those B gives it and A does not, the roles it lost the
reverse.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from probe.lazy import lazy

if TYPE_CHECKING:
    import pandas as pd
else:
    pd = lazy("pandas")


def roles_of(text: object) -> set[str]:
    """The roles in a ``heads.csv`` ``roles`` cell (``"induction;copying"``; empty or NaN:
    none)."""
    if text is None or text != text:  # NaN: a head with no role
        return set()
    return {role for role in str(text).split(";") if role}


def head_changes(a: pd.DataFrame, b: pd.DataFrame, measures: list[str]) -> pd.DataFrame:
    """Each head's change from ``a`` to ``b``, two ``heads.csv`` tables of the same shape.

    Parameters
    ----------
    a, b : pandas.DataFrame
        One row per head, ``[layers·heads]``: ``layer``, ``head``, the ``measures`` and
        ``roles``.
    measures : list of str
        The numeric columns to compare; both tables have them.

    Returns
    -------
    pandas.DataFrame
        One row per head both tables have, in ``a``'s order: ``layer, head``, then per measure
        ``{m}_a, {m}_b, {m}_change`` (b − a), then ``roles_a, roles_b, roles_gained,
        roles_lost`` (roles ``;``-joined, gained and lost sorted).
    """
    joined = a.merge(b, on=["layer", "head"], suffixes=("_a", "_b"))
    table = joined[["layer", "head"]].copy()
    for m in measures:
        table[f"{m}_a"], table[f"{m}_b"] = joined[f"{m}_a"], joined[f"{m}_b"]
        table[f"{m}_change"] = joined[f"{m}_b"] - joined[f"{m}_a"]
    roles_a, roles_b = joined.roles_a.map(roles_of), joined.roles_b.map(roles_of)
    table["roles_a"], table["roles_b"] = joined.roles_a.fillna(""), joined.roles_b.fillna("")
    table["roles_gained"] = [";".join(sorted(y - x)) for x, y in zip(roles_a, roles_b, strict=True)]
    table["roles_lost"] = [";".join(sorted(x - y)) for x, y in zip(roles_a, roles_b, strict=True)]
    return table
