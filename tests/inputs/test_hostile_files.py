"""A user's corpus file as it may come: not UTF-8, a JSON line broken at the start or in the
middle, a damaged or cut .parquet, a text column of numbers or objects, a pipe, a local folder
spelled as a hub dataset, and options no haystack can hold. Each ends in one line naming the
file, the line or row, what is wrong and what to do; never a library's traceback."""

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from induction import MODEL
from typer.testing import CliRunner

from probe.app.cli import app
from probe.errors import ProbeError
from probe.inputs.texts import corpus_spec

# A model that does not exist: an error about the corpus proves it was checked first.
MISSING = "/nonexistent/model-folder"
GOOD_LINE = '{"text": "t1 t2 t3"}\n'


def invoke(*args) -> object:
    return CliRunner().invoke(app, [str(a) for a in args])


def one_line(result, *messages: str) -> str:
    assert result.exit_code == 1, (result.output, result.exception)
    line = result.output.strip()
    assert line.startswith("error:") and "\n" not in line and "Traceback" not in line, line
    assert all(m in line for m in messages), line
    return line


def planned(corpus: Path | str, *more: str):
    """``probe analyze`` with a corpus and a model that does not exist: what the plan says."""
    return invoke("analyze", "-m", MISSING, "-a", "roles", "--corpus", corpus, *more,
                  "-o", Path(str(corpus)).parent / "out")  # fmt: skip


def run(corpus: Path, tmp_path: Path):
    """``probe analyze`` of the tiny induction model on ``corpus``, to the end."""
    return invoke("analyze", "-m", MODEL, "-a", "roles", "--corpus", corpus, "-q",
                  "-o", tmp_path / "out")  # fmt: skip


def test_a_text_file_that_is_not_utf8_is_named_with_its_line(tmp_path):
    corpus = tmp_path / "latin.txt"
    corpus.write_bytes(b"t1 t2\nt3 caf\xe9 t4\n")
    one_line(planned(corpus), f"{corpus}, line 2: byte 0xe9 (byte 7 of the line) is not UTF-8",
             "save the file as UTF-8")  # fmt: skip


@pytest.mark.parametrize("at", [0, 1500])
def test_a_broken_json_line_is_named_first_or_in_the_middle(tmp_path, at):
    corpus = tmp_path / "broken.jsonl"
    lines = [GOOD_LINE] * 3000
    lines[at] = '{"text": t5}\n'
    corpus.write_text("".join(lines))
    expected = (f"{corpus}, line {at + 1}: not JSON (Expecting value at column 10)",
                "fix or remove the line")  # fmt: skip
    result = planned(corpus) if at == 0 else run(corpus, tmp_path)  # the plan reads line 1 only
    one_line(result, *expected)
    assert not (tmp_path / "out").exists()


def test_a_cut_or_damaged_parquet_is_named(tmp_path):
    whole = tmp_path / "whole.parquet"
    texts = [f"t{i % 60 + 1} t{i * 7919 % 10007} " * 3 for i in range(5000)]  # distinct
    pq.write_table(pa.table({"text": texts}), whole, compression="snappy")
    data = whole.read_bytes()
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(data[:-30])
    one_line(planned(cut), f"{cut}: not a whole .parquet file", "write it again")
    damaged = tmp_path / "damaged.parquet"
    broken = bytearray(data)
    assert len(data) > 20_000  # the footer is far from the bytes damaged
    broken[1000:3000] = b"\xab" * 2000  # inside the first column chunk's pages
    damaged.write_bytes(broken)
    one_line(planned(damaged), f"{damaged}, rows 0–4999 (row group 0): damaged",
             "write the file again")  # fmt: skip


@pytest.mark.parametrize(
    ("values", "row", "kind"),
    [([5, 6], 0, "int (5)"), (["t1 t2", {"x": 1}], 1, "dict ({'x': 1})"),
     (["t1"] * 300 + [7.5], 300, "float (7.5)")],
)  # fmt: skip
def test_a_text_column_of_numbers_or_objects_names_the_row_and_type(tmp_path, values, row, kind):
    import json

    corpus = tmp_path / "mixed.jsonl"
    corpus.write_text("".join(json.dumps({"text": v}) + "\n" for v in values))
    result = planned(corpus) if row == 0 else run(corpus, tmp_path)
    one_line(result, f"text {row} (0-based) of column 'text' is of type {kind}, not a string",
             "--text-column")  # fmt: skip


def test_a_pipe_as_corpus_is_said_to_be_a_pipe(tmp_path):
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    one_line(planned(fifo), f"corpus {fifo} is not a regular file (a pipe", "save it to a file")


def test_a_local_folder_spelled_as_a_hub_dataset_is_refused(tmp_path):
    (tmp_path / "texts.txt").write_text("t1 t2\n")
    with pytest.raises(ProbeError, match="is a local path, not a hub dataset"):
        corpus_spec(f"hf:{tmp_path}")
    one_line(planned(f"hf:{tmp_path}"), f"give it without hf: (--corpus {tmp_path})")


@pytest.mark.parametrize("lengths", [str(10**22), "1024," + str(2**40)])
def test_haystacks_longer_than_any_context_are_refused_when_planned(tmp_path, lengths):
    one_line(invoke("analyze", "-m", MISSING, "-a", "retrieval", "--retrieval-lengths", lengths,
                    "-o", tmp_path / "out"), "is longer than any model's context")  # fmt: skip
