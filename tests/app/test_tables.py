"""A table longer than CSV_ROWS is written whole as .parquet beside a CSV of its first rows, and
read back whole and typed."""

import pandas as pd

from probe.app import tables as table_io


def test_long_table_written_whole_as_parquet(tmp_path, monkeypatch):
    monkeypatch.setattr(table_io, "CSV_ROWS", 3)
    schema = {"sender": "str", "input": "str", "score": "float", "in_circuit": "bool"}
    table = table_io.typed(
        pd.DataFrame({"sender": ["embed", "0-1", "mlp0", "1-0", "1-1"],
                      "input": ["q", "", "k", "v", ""], "score": [3.0, -2.5, 1.0, 1e-9, 0.0],
                      "in_circuit": [True, True, False, False, False]}),
        schema,
    )  # fmt: skip
    table_io.write(table, tmp_path / "edges.csv")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["edges.csv", "edges.parquet"]
    pd.testing.assert_frame_equal(table_io.read(tmp_path / "edges.csv", schema), table)
    top = pd.read_csv(tmp_path / "edges.csv", keep_default_na=False)
    assert top.sender.tolist() == ["embed", "0-1", "mlp0"]  # the first rows, as CSV

    table_io.write(table.head(3), tmp_path / "short.csv")  # no longer than CSV_ROWS: CSV alone
    assert not (tmp_path / "short.parquet").exists()
    pd.testing.assert_frame_equal(table_io.read(tmp_path / "short.csv", schema), table.head(3))
