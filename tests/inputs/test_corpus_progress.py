"""A corpus's progress bar counts texts: ``Texts.size()`` counts them from the files where that
needs no parsing, equal to what datasets reads, and the batches move the bar by exactly that
many, on one process or on each of several."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_corpus import TEXTS, tokenizer, write  # noqa: F401 (a fixture)

from probe.inputs.texts import corpus_spec
from probe.inputs.units import Source
from probe.inputs.units.texts import CHUNK_WINDOWS, Texts

MANY = [f"text number {i} " * (i % 7) for i in range(3 * CHUNK_WINDOWS)]  # several chunks


def read(unit: Texts, batch_size: int = 8) -> tuple[int, int]:
    """The bar's total movement and the texts this process read the first window of."""
    moved = sum(batch.progress for batch in unit.batches(batch_size))
    return moved, unit.tally()["texts"]


def odd_txt(folder) -> tuple:
    """A .txt whose lines end in \\n, \\r\\n and \\r, with blank lines and no final newline."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "odd.txt"
    path.write_bytes(b"one\r\ntwo\rthree\n\n \nfour\r\n\r\nfive")
    return path, 8


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet", "odd", "blank-jsonl", "many"])
def test_the_count_is_what_datasets_reads(tmp_path, tokenizer, kind):  # noqa: F811
    if kind == "odd":
        path, n = odd_txt(tmp_path)
    elif kind == "blank-jsonl":
        path, n = tmp_path / "c.jsonl", len(TEXTS)
        rows = [json.dumps({"text": t}) for t in TEXTS]
        path.write_text("\n\n".join(rows) + "\n  \n", encoding="utf-8")
    elif kind == "many":
        path, n = write(tmp_path, "txt", MANY), len(MANY)
    else:
        path, n = write(tmp_path, kind), len(TEXTS)
    unit = Texts(Source(corpus=corpus_spec(str(path)), context=16), tokenizer, 512)
    assert unit.size() == n
    assert read(unit) == (n, n)
    capped = Texts(Source(corpus=corpus_spec(str(path)), max_texts=3, context=16), tokenizer, 512)
    assert capped.size() == 3 and read(capped) == (3, 3)


def test_each_process_reaches_the_total(tmp_path, tokenizer):  # noqa: F811
    """Every process cuts every text and keeps its share of the windows: each one's bar goes
    the whole way, while the texts whose first window it holds add up to the corpus."""
    path = write(tmp_path, "txt", MANY)
    source = Source(corpus=corpus_spec(str(path)), context=16)
    shards = [Texts(source, tokenizer, 512, shard=(rank, 3)) for rank in range(3)]
    found = [read(unit) for unit in shards]
    assert [unit.size() for unit in shards] == [len(MANY)] * 3
    assert [moved for moved, _ in found] == [len(MANY)] * 3
    assert sum(texts for _, texts in found) == len(MANY)


@pytest.mark.parametrize("kind", ["json", "csv"])
def test_no_total_where_only_parsing_would_tell(tmp_path, tokenizer, kind):  # noqa: F811
    unit = Texts(Source(corpus=corpus_spec(str(write(tmp_path, kind)))), tokenizer, 512)
    assert unit.size() is None
    assert read(unit)[1] == len(TEXTS)


def test_a_parquet_folder_is_counted_from_its_metadata(tmp_path, tokenizer):  # noqa: F811
    folder = tmp_path / "parts"
    folder.mkdir()
    for i, part in enumerate((TEXTS[:2], TEXTS[2:])):
        pq.write_table(pa.Table.from_pylist([{"text": t} for t in part]), folder / f"{i}.parquet")
    unit = Texts(Source(corpus=corpus_spec(str(folder))), tokenizer, 512)
    assert unit.size() == len(TEXTS) and read(unit) == (len(TEXTS), len(TEXTS))


@pytest.mark.slow
def test_the_run_gives_the_corpus_bar_its_texts(minilm, tmp_path):
    """``probe analyze --corpus``: the bar's total is the texts, and it ends there."""
    from probe.app.analyze import analyze
    from probe.app.plan import Settings

    seen = {}

    def progress(description, total):
        def wrap(batches):
            seen[description] = [total, 0]
            for batch in batches:
                seen[description][1] += len(batch) if batch.progress is None else batch.progress
                yield batch

        return wrap

    path = write(tmp_path, "txt", MANY)
    settings = Settings(model="minilm", corpus=str(path), context=32, max_texts=500,
                        out=tmp_path / "r", analyses=["roles"])  # fmt: skip
    analyze(settings, progress=progress)
    assert seen == {"analysing corpus texts": [500, 500]}
