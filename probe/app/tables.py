"""Tables as CSV files with declared column types, so that a table read back from a report
folder is the table that was written (``Schema`` in ``analyses``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

    from analyses import Analysis

from analyses import DTYPES


class MissingColumnsError(ValueError):
    """A table without columns its schema declares."""

    def __init__(self, name: str, missing: list[str]) -> None:
        super().__init__(f"{name} lacks columns {missing}")
        self.missing = missing


def typed(table: pd.DataFrame, schema: dict[str, str], name: str = "table") -> pd.DataFrame:
    """``table`` with exactly the schema's columns, in its order and of its types (missing
    text is the empty string)."""
    missing = [c for c in schema if c not in table.columns]
    if missing:
        raise MissingColumnsError(name, missing)
    table = table[list(schema)].copy()
    for column, kind in schema.items():
        if kind == "str":
            table[column] = table[column].astype(object).where(table[column].notna(), "")
            table[column] = table[column].map(str)
        else:
            table[column] = table[column].astype(DTYPES[kind])
    return table.reset_index(drop=True)


# A table longer than this is written whole as a compressed columnar file beside its CSV
# (``.parquet``, zstd), and the CSV holds its first rows: a 32-layer model has about 1.5
# million edges.
CSV_ROWS = 100_000


def write(table: pd.DataFrame, path: Path) -> None:
    """Write a table that ``typed`` made (``read`` gives it back): ``path`` (CSV), and where it
    has more than ``CSV_ROWS`` rows, the whole table as ``path`` with ``.parquet`` and its
    first ``CSV_ROWS`` rows as the CSV."""
    from probe.files import write_file

    if len(table) > CSV_ROWS:
        whole = path.with_suffix(".parquet")
        write_file(whole, lambda tmp: table.to_parquet(tmp, index=False, compression="zstd"))
        table = table.head(CSV_ROWS)
    write_file(path, lambda tmp: table.to_csv(tmp, index=False))


def read(path: Path, schema: dict[str, str]) -> pd.DataFrame:
    """The table at ``path``, typed by ``schema``."""
    return typed(load(path, schema), schema)


def load(path: Path, schema: dict[str, str]) -> pd.DataFrame:
    """The table at ``path`` with the columns it has, those the schema declares parsed as
    declared (an older report's table, before ``probe.app.folder`` migrates it); the whole
    table from its ``.parquet`` file where ``write`` wrote one."""
    import pandas as pd

    whole = path.with_suffix(".parquet")
    if whole.exists():
        return pd.read_parquet(whole)

    text = [c for c, kind in schema.items() if kind == "str"]
    return pd.read_csv(
        path,
        dtype={c: DTYPES[kind] for c, kind in schema.items()},
        keep_default_na=False,
        na_values={c: [""] for c in schema if c not in text},
    )


def schemas(classes: Sequence[type[Analysis]]) -> dict[str, dict[str, str]]:
    """Every table a run of these analyses writes, ``heads`` included, with its schema.

    Raises
    ------
    analyses.ContractError
        When two analyses declare a table of the same name.
    """
    from analyses import ContractError

    tables, owner = {}, {}
    for cls in classes:
        for name, schema in cls.tables.items():
            if name in owner:
                raise ContractError(
                    f"analyses {owner[name]!r} and {cls.name!r} both declare a table {name!r}; "
                    "rename one"
                )
            tables[name], owner[name] = schema, cls.name
    return tables | {"heads": heads_schema(classes)}


def heads_schema(classes: Sequence[type[Analysis]]) -> dict[str, str]:
    """The columns of ``heads.csv`` and their types.

    Raises
    ------
    analyses.ContractError
        When two analyses would add a column of the same name.
    """
    from analyses import ContractError

    schema = {"layer": "int", "head": "int"}
    owner = dict.fromkeys(schema, "the head grid")
    for cls in classes:
        for column in cls.head_columns:
            if column in owner or column == "roles":
                raise ContractError(
                    f"the {cls.name} analysis adds a column {column!r} to heads.csv that "
                    f"{owner.get(column, 'the roles')} adds too; rename one"
                )
            owner[column] = f"the {cls.name} analysis"
        schema |= cls.head_columns
    return schema | {"roles": "str"}
