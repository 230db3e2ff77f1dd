"""The claims' table in words: which claims a run's heads table makes (``listed_claims``),
every claim's verdicts after one Benjamini–Hochberg correction over every test of the run
(``verdicts``), and a claim and its verdict as the page and ``heads.csv`` write them
(``claim_name``, ``verdict``)."""

from __future__ import annotations

from analyses.claims.groups import GROUP_COLUMNS
from analyses.claims.inputs import CLAIMS, RELATION
from analyses.vocabulary import Role
from probe.inference import FDR, benjamini_hochberg
from probe.inputs.treebank import RELATIONS
from probe.lazy import lazy

np = lazy("numpy")
pd = lazy("pandas")


def listed_claims(heads: pd.DataFrame | None) -> pd.DataFrame:
    """One row per claim the page makes about a head: ``layer``, ``head``, ``claim`` (a role of
    ``CLAIMS``, or ``relation`` for a best relation named without the syntactic role) and
    ``relation`` (a syntactic claim's; empty otherwise)."""
    rows = []
    if heads is not None and len(heads):
        roles = heads["roles"] if "roles" in heads else pd.Series("", index=heads.index)
        best = heads["best_relation"] if "best_relation" in heads else roles.map(lambda _: "")
        for layer, head, held, relation in zip(heads.layer, heads["head"], roles, best,
                                               strict=True):  # fmt: skip
            held = set(str(held).split(";")) if isinstance(held, str) and held else set()
            named = relation if isinstance(relation, str) and relation in RELATIONS else ""
            if named:
                syntactic = str(Role.SYNTACTIC) in held
                rows.append((layer, head, str(Role.SYNTACTIC) if syntactic else RELATION, named))
            rows += [(layer, head, c, "") for c in CLAIMS[2:] if c in held]
    return pd.DataFrame(rows, columns=["layer", "head", "claim", "relation"]).astype(
        {"layer": "int64", "head": "int64", "claim": "object", "relation": "object"}
    )


def with_columns(table: pd.DataFrame) -> pd.DataFrame:
    """A kind of input's claims with every group column (``groups.GROUP_COLUMNS``' defaults on
    the rows of a claim no other head shares)."""
    table = table.copy()
    for column, default in GROUP_COLUMNS.items():
        if column not in table:
            table[column] = default
        table[column] = table[column].fillna(default) if isinstance(default, str) else table[column]
    return table


def verdicts(table: pd.DataFrame) -> pd.DataFrame:
    """Every claim's verdicts, the Benjamini–Hochberg correction over every test of the run (each
    claim's against its neighbours and its control, each group's two, each share's): confirmed
    alone where the head beats both its neighbours (unless they rest on fewer than two heads) and
    its control; the group confirmed where its joint effect beats the same two; a head's
    ``verdict``: ``confirmed alone``, ``only with its group`` (its share above 0 in a confirmed
    group), ``not confirmed``, or ``untested`` (too few inputs)."""
    table = table.reset_index(drop=True)
    first = ~table.duplicated("group") & table.group.ne("")  # a group's tests counted once
    tests = [np.where(table.tested.astype(bool), table.p, np.nan),
             np.where(table.tested.astype(bool), table.p_control, np.nan),
             np.where(first, table.group_p.astype(float), np.nan),
             np.where(first, table.group_p_control.astype(float), np.nan),
             table.share_p.astype(float).to_numpy()]  # fmt: skip
    called = benjamini_hochberg(np.concatenate(tests), FDR).reshape(len(tests), -1)
    by_group = {g: k for k, g in enumerate(table.group) if first[k]}
    spread = called[2:4][:, [by_group.get(g, k) for k, g in enumerate(table.group)]]
    weak = table.baseline_note.ne("").to_numpy()
    group_weak = table.group_note.ne("").to_numpy()
    alone = (called[0] | weak) & called[1] & table.tested.astype(bool).to_numpy()
    group = (spread[0] | group_weak) & spread[1] & table.group.ne("").to_numpy()
    table["confirmed"] = alone
    table["group_confirmed"] = group
    table["verdict"] = np.where(alone, "confirmed alone", np.where(
        group & called[4], "only with its group", np.where(
            table.tested.astype(bool), "not confirmed", "untested")))  # fmt: skip
    return table


def claim_name(row) -> str:
    """A claim in words: ``syntactic (obj)``, ``relation obj``, ``induction``."""
    if row.claim == RELATION:
        return f"relation {row.relation}"
    return f"{row.claim} ({row.relation})" if row.relation else str(row.claim)


def verdict(row) -> str:
    """``confirmed by ablation`` (alone), ``confirmed with its group (1-0 1-1)`` (only so),
    ``pattern only`` (tested, not confirmed), or why untested."""
    if bool(row.tested):
        if bool(row.confirmed):
            return "confirmed by ablation"
        if getattr(row, "verdict", "") == "only with its group":
            return f"confirmed with its group ({row.group})"
        return "pattern only"
    if row.baseline_from == "none" and row.clusters > 0:  # inputs, but every head claimed
        return "pattern only (untested: no unclaimed head to compare it with)"
    return "pattern only (too few inputs to test)"
