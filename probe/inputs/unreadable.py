"""What is wrong with a user's corpus file, in one line: the file, the line or row, what is
wrong, what to do.

The readers (🤗 datasets, pyarrow, the codecs) say it from inside: ``UnicodeDecodeError`` with
a byte offset into a buffer, ``ArrowInvalid`` with a row of a block, a footer that is not there.
When one of them fails, the files are read again here, streamed, to find the first place that
is wrong and to name it as the user sees the file (1-based lines, as editors count them;
0-based rows, as probe's tables count them).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Sequence

from probe.errors import ProbeError

BLOCK = 1 << 20  # bytes read at once while looking for what is wrong
SAVE_AS_UTF8 = "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"


def explain(
    name: str,
    builder: str,
    files: Sequence[str],
    error: BaseException,
    sources: Sequence[str] | None = None,
) -> ProbeError:
    """The one line for ``error``, raised by the reader of corpus ``name`` (its datasets
    ``builder`` and local ``files``), each file read from its ``sources`` (the file the plan
    opened: ``probe.inputs.texts.CorpusSpec.sources``) where given, and named by its path."""
    pairs = list(zip(sources or files, files, strict=True))  # (where it is read, its name)
    found = None
    if isinstance(error, UnicodeDecodeError) or builder in ("text", "json", "csv"):
        found = _first_bad_utf8(pairs)
    if found is None and builder == "json":
        found = _first_bad_json(pairs)
    if found is None and builder == "parquet":
        found = _first_bad_parquet(pairs)
    if found is not None:
        return ProbeError(f"corpus {found}")
    return ProbeError(f"corpus {name} cannot be read: {first_line(error)}")


def first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0][:300]


def _first_bad_utf8(files: Sequence[tuple[str, str]]) -> str | None:
    """``FILE, line N: …`` for the first byte that is not UTF-8, or None."""
    for source, path in files:
        decoder = codecs.getincrementaldecoder("utf-8")()
        line = 1
        try:
            with open(source, "rb") as f:
                while block := f.read(BLOCK):
                    pending = len(decoder.getstate()[0])  # a character cut by the last block
                    try:
                        decoder.decode(block)
                    except UnicodeDecodeError as e:
                        bad = min(max(e.start - pending, 0), len(block) - 1)
                        line += block.count(b"\n", 0, bad)
                        column = bad - (block.rfind(b"\n", 0, bad) + 1) + 1
                        byte = f"byte 0x{block[bad]:02x} (byte {column} of the line)"
                        what = f"{byte} is not UTF-8; {SAVE_AS_UTF8} or remove the line"
                        return f"{path}, line {line}: {what}"
                    line += block.count(b"\n")
                decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            return (f"{path}, line {line}: the file ends inside a character that is not whole "
                    "UTF-8; save the file as UTF-8 or remove the last line")  # fmt: skip
        except OSError:
            continue
    return None


def _first_bad_json(files: Sequence[tuple[str, str]]) -> str | None:
    """``FILE, line N: …`` for the first line of a JSON Lines file that is not a JSON object
    (or, for a .json file holding one document, the place where it breaks), or None."""
    for source, path in files:
        try:
            with open(source, encoding="utf-8") as f:
                if not path.lower().endswith(".jsonl") and not _lines_of_objects(f):
                    try:
                        json.load(f)
                    except json.JSONDecodeError as e:
                        return (f"{path}, line {e.lineno}: not JSON ({e.msg} at column "
                                f"{e.colno}); fix the file")  # fmt: skip
                    continue
                for number, text in enumerate(f, 1):
                    if not text.strip():
                        continue
                    try:
                        row = json.loads(text.rstrip("\r\n"))
                    except json.JSONDecodeError as e:
                        return (f"{path}, line {number}: not JSON ({e.msg} at column {e.colno}); "
                                "fix or remove the line")  # fmt: skip
                    if not isinstance(row, dict):
                        kind = type(row).__name__
                        return (f"{path}, line {number}: a JSON {kind}, not an object with the "
                                "text column; give one object per line")  # fmt: skip
        except (OSError, UnicodeDecodeError, ValueError):
            continue
    return None


def _lines_of_objects(f) -> bool:
    """Whether a .json file is JSON Lines (its first non-blank line is an object by itself);
    the file is left at its start."""
    try:
        for text in f:
            if text.strip():
                return isinstance(json.loads(text), dict)
        return True
    except json.JSONDecodeError:
        return False
    finally:
        f.seek(0)


def _first_bad_parquet(files: Sequence[tuple[str, str]]) -> str | None:
    """``FILE: …`` for the first .parquet file whose footer or row groups cannot be read, or
    None."""
    import pyarrow.parquet as pq

    for source, path in files:
        try:
            parquet = pq.ParquetFile(source)
        except Exception as e:  # pyarrow raises ArrowInvalid, OSError…
            return (f"{path}: not a whole .parquet file ({first_line(e)}); it was cut or "
                    "damaged: write it again")  # fmt: skip
        row = 0
        for group in range(parquet.num_row_groups):
            try:
                parquet.read_row_group(group)
            except Exception as e:
                return (f"{path}, rows {row}–{row + parquet.metadata.row_group(group).num_rows - 1}"
                        f" (row group {group}): damaged ({first_line(e)}); write the file "
                        "again")  # fmt: skip
            row += parquet.metadata.row_group(group).num_rows
    return None


def not_text(name: str, column: str, row: int, value: object) -> ProbeError:
    """The one line for a value of the text column that is not a string."""
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:39] + "…"
    return ProbeError(
        f"corpus {name}: text {row} (0-based) of column {column!r} is of type "
        f"{type(value).__name__} ({shown}), not a string; give a column of texts with --text-column"
    )
