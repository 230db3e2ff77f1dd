"""The text unit (``--corpus``): plain text in every accepted format, read through 🤗 datasets as a
stream, tokenized in batches, cut into windows and shared between processes; and the runs that
read it beside a treebank."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers as tf
from by_hand import set_patterns
from commands import fails_in_one_line, probe_analyze
from streams import context
from tokenizers_util import wordpiece
from typer.testing import CliRunner

import probe
from analyses.roles import Roles
from probe.app.cli import app
from probe.errors import ProbeError
from probe.inputs.texts import corpus_spec, windows
from probe.inputs.units import Source
from probe.inputs.units.texts import Texts
from probe.inputs.windowing import TEXTS_PER_MAP
from probe.pipeline.runner import stream

TEXTS = [
    "The cat sat on the mat.",
    "",
    "Attention heads, it seems, attend to punctuation!",
    "It costs $5 + tax, «they said».",
    " ".join(["tokens"] * 300),  # longer than a window
    "Short one",
]
# Each text's punctuation tokens, by hand: "$" and "+" are symbols (Unicode S), not punctuation.
PUNCTUATION = [["."], [], [",", ",", "!"], [",", "«", "»", "."], [], []]


def write(folder: Path, kind: str, texts=TEXTS, column: str = "text") -> Path:
    """``texts`` as a corpus file of ``kind`` (a folder: two .jsonl files, in name order)."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"id": i, column: t} for i, t in enumerate(texts)]
    path = folder / f"corpus.{kind}"
    if kind == "txt":
        path.write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    elif kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    elif kind == "json":
        path.write_text(json.dumps(rows), encoding="utf-8")
    elif kind == "csv":
        with path.open("w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, ["id", column])
            writer.writeheader()
            writer.writerows(rows)
    elif kind == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path = folder / "parts"
        half = len(texts) // 2
        write(path / "a", "jsonl", texts[:half], column).rename(path / "a.jsonl")
        write(path / "b", "jsonl", texts[half:], column).rename(path / "b.jsonl")
    return path


def touch(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from probe.pipeline.loading import resolve_name

    return AutoTokenizer.from_pretrained(resolve_name("minilm"))


def expected_windows(tokenizer, texts, context):
    """Each text's windows computed from the tokenizer alone: its tokens without special ones,
    cut every ``context - 2`` tokens, each cut between [CLS] and [SEP]."""
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    found = []
    for t in texts:
        ids = tokenizer(t, add_special_tokens=False, verbose=False)["input_ids"]
        width = context - 2
        cuts = [ids[i : i + width] for i in range(0, len(ids), width)] or [[]]
        found += [(w, [cls, *c, sep] if ids else []) for w, c in enumerate(cuts)]
    return found


@pytest.mark.parametrize("kind", ["txt", "jsonl", "json", "csv", "parquet", "folder"])
def test_every_format_gives_the_windows_of_the_tokenizer(tmp_path, tokenizer, kind):
    """Each accepted kind of file (a .jsonl and a folder of them with another text column)
    gives every text, in order, cut as the tokenizer alone would cut it; short texts exactly
    as the tokenizer encodes them, with its special tokens; punctuation as listed by hand."""
    column = "body" if kind in ("jsonl", "folder") else "text"
    spec = corpus_spec(str(write(tmp_path, kind, column=column)), column)
    rows = list(windows(spec, tokenizer, 64))
    expected = expected_windows(tokenizer, TEXTS, 64)
    assert [(r["window"], r["input_ids"]) for r in rows] == expected
    assert [r["index"] for r in rows] == list(range(len(expected)))
    assert rows[0]["input_ids"] == tokenizer(TEXTS[0])["input_ids"]
    firsts = [r for r in rows if r["window"] == 0]
    for row, punctuation in zip(firsts, PUNCTUATION, strict=True):
        tokens = tokenizer.convert_ids_to_tokens(row["input_ids"][1:-1])
        assert [t for t, p in zip(tokens, row["punct"], strict=True) if p] == punctuation
    assert all(len(r["input_ids"]) <= 64 for r in rows) and max(r["window"] for r in rows) > 0


def test_shards_share_the_windows_one_in_turn(tmp_path, tokenizer):
    """Under 2 or 3 processes each window goes to one process, with its place in the whole."""
    spec = corpus_spec(str(write(tmp_path, "txt")))
    whole = {r["index"]: r["input_ids"] for r in windows(spec, tokenizer, 16)}
    for size in (2, 3):
        parts = [list(windows(spec, tokenizer, 16, shard=(rank, size))) for rank in range(size)]
        assert sorted(r["index"] for part in parts for r in part) == sorted(whole)
        assert all(whole[r["index"]] == r["input_ids"] for part in parts for r in part)
        assert all(r["index"] % size == rank for rank, part in enumerate(parts) for r in part)


class Counting:
    """A tokenizer that counts the texts it is given to tokenize."""

    def __init__(self, tokenizer):
        self.tokenizer, self.texts = tokenizer, 0

    def __call__(self, texts, **kwargs):
        self.texts += len(texts) if isinstance(texts, list) else 1
        return self.tokenizer(texts, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_reading_stops_where_the_run_does(tmp_path, tokenizer):
    """Of 100,000 lines, --max-texts 10 tokenizes 10, and a stop after 5 windows at most one
    batch of texts: the stream is read no further than it is used."""
    path = tmp_path / "big.txt"
    path.write_text("a short line of text\n" * 100_000, encoding="utf-8")
    spec = corpus_spec(str(path))
    counting = Counting(tokenizer)
    assert len(list(windows(spec, counting, 64, max_texts=10))) == 10
    assert counting.texts <= 10 + 2  # and the two texts that find the special tokens
    counting = Counting(tokenizer)
    assert len(list(windows(spec, counting, 64, stop=5))) == 5
    assert counting.texts <= TEXTS_PER_MAP + 2


def test_the_unit_batches_and_counts_what_it_read(tmp_path, tokenizer):
    """The unit's batches hold every window once, each text token its own word; its tally
    counts texts, windows, tokens and the empty text, and adds up over shards."""
    spec = corpus_spec(str(write(tmp_path, "csv")))
    source = Source(corpus=spec, context=32)
    unit = Texts(source, tokenizer, 512)
    batches = list(unit.batches(batch_size=8))
    expected = [ids for _, ids in expected_windows(tokenizer, TEXTS, 32) if ids]
    got = {}
    for batch in batches:
        for b, index in enumerate(batch.index.tolist()):
            n = int(batch.attention_mask[b].sum())
            got[index] = batch.input_ids[b, :n].tolist()
            words = batch.word_of_token[b, :n]
            assert words.tolist() == [-1, *range(n - 2), -1] and batch.n_words[b] == n - 2
            assert batch.special[b, :n].tolist() == [True, *[False] * (n - 2), True]
    assert [got[i] for i in sorted(got)] == expected
    tally = unit.tally()
    tokens = sum(len(ids) - 2 for ids in expected)
    assert dict(tally) == {"texts": 6, "windows": len(expected), "tokens": tokens,
                           "skipped": {"no tokens": 1}}  # fmt: skip
    halves = [Texts(source, tokenizer, 512, shard=(r, 2)) for r in range(2)]
    for half in halves:
        list(half.batches(batch_size=3))
    merged = halves[0].tally()
    merged.merge(halves[1].tally())
    assert merged == tally


def test_roles_on_a_corpus_by_hand(tmp_path):
    """Roles on corpus windows with patterns set by hand: the statistics the sentences give
    (test_roles), from plain text with no annotation; punctuation found from the text."""
    words = [
        ["the", "cat", "sat", "on", "the", "mat", "."],
        ["the", "dogs", "were", "barking", "at", "strangers", "yesterday", ",", "wow", "."],
    ]
    tokenizer = wordpiece()
    lengths = np.array([len(tokenizer(" ".join(w))["input_ids"]) for w in words])
    config = tf.BertConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                           intermediate_size=64, vocab_size=200)  # fmt: skip
    model = tf.BertModel(config).eval()
    path = touch(tmp_path / "c.txt", "".join(" ".join(w) + "\n" for w in words))
    unit = Texts(Source(corpus=corpus_spec(str(path))), tokenizer, 64)
    analysis = Roles(context(2, 4), js_query_share=1.0)
    with probe.hooks(model, {"blocks.0.attn.hook_pattern": set_patterns}):
        stream(model, unit.batches(batch_size=2), [analysis])
    stats = analysis.finish()["head_stats"].set_index(["layer", "head"])
    n, total = lengths, lengths.sum()
    prev, uniform = stats.loc[(0, 0)], stats.loc[(0, 2)]
    assert prev.previous == pytest.approx((n - 1).sum() / total)
    assert uniform.entropy == pytest.approx((n * np.log(n)).sum() / total)
    assert uniform.special == pytest.approx(2 * len(n) / total)
    assert uniform.punct == pytest.approx((1 + 2) / total)  # "." and ",", ".": one key each


@pytest.mark.parametrize(
    ("make", "args", "message"),
    [
        (lambda d: d / "missing.txt", [], "does not exist"),
        (lambda d: touch(d / "c.xml", "<t/>"), [], "unknown kind of file"),
        (
            lambda d: write(d, "jsonl", column="body"),
            [],
            "has no column 'text'; its columns are 'id', 'body': name one with --text-column",
        ),
        (lambda d: write(d, "csv"), ["--text-column", "body"], "its columns are 'id', 'text'"),
        (lambda d: touch(d / "e.jsonl", ""), [], "holds no text"),
        (lambda d: write(d, "txt") and write(d, "csv") and d, [], "mixes csv and text files"),
        (lambda d: d, [], "holds no .txt, .jsonl"),
        (lambda d: write(d, "txt"), ["-a", "syntax"], "no analysis of this run reads --corpus"),
        (lambda d: None, ["--max-texts", "3"], "--max-texts says how to read --corpus"),
        (lambda d: write(d, "txt"), ["--context", "2"], "leaves no room for text"),
    ],
)
def test_bad_corpora_fail_in_one_line(tmp_path, minilm, make, args, message):
    folder = tmp_path / "in"
    folder.mkdir()
    corpus = make(folder)
    given = ["--corpus", str(corpus)] if corpus is not None else []
    analyses = [] if "-a" in args else ["-a", "roles"]
    out = tmp_path / "r"
    fails_in_one_line(["analyze", "-m", "minilm", "-o", str(out), *analyses, *given, *args],
                      message)  # fmt: skip
    assert not out.exists()


@pytest.mark.slow
def test_a_corpus_is_checked_before_torch(tmp_path):
    """The plan reads the corpus's first row to check it, or finds a hub name it cannot have,
    without importing torch."""
    corpus = write(tmp_path, "jsonl", column="body")
    code = (
        "import sys\nfrom probe.app.plan import Settings, plan\n"
        "from probe.errors import ProbeError\n"
        f"plan(Settings('minilm', analyses=['roles'], corpus={str(corpus)!r}, "
        f"text_column='body', out={str(tmp_path / 'r')!r}))\n"
        f"try:\n    plan(Settings('minilm', analyses=['roles'], corpus={str(corpus)!r}, "
        f"out={str(tmp_path / 'r')!r}))\nexcept ProbeError as e:\n    print(e)\n"
        "try:\n    plan(Settings('minilm', analyses=['roles'], corpus='hf:no-such/corpus', "
        f"out={str(tmp_path / 'r')!r}))\nexcept ProbeError as e:\n    print(e)\n"
        "print('torch' in sys.modules)"
    )
    env = os.environ | {"PYTHONPATH": str(Path(__file__).parents[2]), "HF_HUB_OFFLINE": "1"}
    env |= {"HF_DATASETS_CACHE": str(tmp_path / "cache"), "HF_HOME": str(tmp_path / "home")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-3:-1] == [
        f"corpus {corpus} has no column 'text'; its columns are 'id', 'body': name one with "
        "--text-column",
        "corpus hf:no-such/corpus: the hub cannot be reached (offline?) and the dataset is not in "
        "the datasets cache (Couldn't reach 'no-such/corpus' on the Hub (OfflineModeIsEnabled)); "
        "give a local file instead",
    ]
    assert lines[-1] == "False"


@pytest.mark.parametrize(
    "offline", [{"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": "http://127.0.0.1:9"}]
)
@pytest.mark.slow
def test_a_hub_corpus_offline_fails_in_one_line(tmp_path, offline):
    """A hub name that is not cached, offline or with a hub that does not answer: one line,
    before the model is loaded, and no report."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"} | offline
    env |= {"HF_DATASETS_CACHE": str(tmp_path / "cache"), "HF_HOME": str(tmp_path / "home")}
    out = tmp_path / "r"
    name = "hf:no-such-user/no-such-corpus:en@validation"
    command = [sys.executable, "-m", "probe.app.cli", "analyze", "-m", "minilm", "-a", "roles",
               "--corpus", name, "-o", str(out)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: corpus hf:no-such-user/no-such-corpus:en@validation: the hub cannot be reached"
    ), result.stderr
    assert not out.exists()


@pytest.mark.slow
def test_a_run_reads_the_treebank_and_the_corpus(tmp_path, tokenizer):
    """syntax reads the treebank, roles the corpus: run.json and the report say which input each
    read, with its size."""
    corpus = write(tmp_path, "jsonl", column="body")
    out = tmp_path / "r"
    args = ["analyze", "-m", "minilm", "-q", "-t", "sample", "-n", "8", "-a", "syntax,roles",
            "--corpus", str(corpus), "--text-column", "body", "--max-texts", "5",
            "--context", "32", "-o", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    run = json.loads((out / "run.json").read_text())
    assert run["reads"] == {"syntax": ["sentence"], "roles": ["text"]}
    assert run["corpus"] == f"{corpus} (column 'body')"
    expected = [ids for _, ids in expected_windows(tokenizer, TEXTS[:5], 32) if ids]
    assert run["inputs"]["text"] == {"texts": 5, "windows": len(expected),
                                     "tokens": sum(len(i) - 2 for i in expected),
                                     "skipped": {"no tokens": 1}}  # fmt: skip
    assert run["inputs"]["sentence"]["read"] == 8
    html = (out / "index.html").read_text()
    assert f"{len(expected)} windows" in html and "roles: corpus windows" in html
    assert "syntax: sentences" in html


@pytest.mark.slow
def test_two_processes_give_the_tables_of_one_on_a_corpus(tmp_path, minilm):
    """torchrun, 2 processes with gloo, another batch size: the corpus's tables as in one."""
    corpus = write(tmp_path, "parquet")
    args = ["-a", "roles,importance", "--corpus", str(corpus), "--context", "24",
            "--importance-sentences", "6"]  # fmt: skip
    one = probe_analyze(tmp_path / "one", *args, "--batch-size", "8")
    assert one.returncode == 0, one.stderr
    two = probe_analyze(tmp_path / "two", *args, "--batch-size", "3", processes=2)
    assert two.returncode == 0, two.stderr
    tables = sorted(p.name for p in (tmp_path / "one").glob("*.csv"))
    assert tables == sorted(p.name for p in (tmp_path / "two").glob("*.csv"))
    for name in tables:
        a, b = (pd.read_csv(tmp_path / r / name, keep_default_na=False) for r in ("one", "two"))
        assert list(a.columns) == list(b.columns) and a.shape == b.shape, name
        for column in a.columns:
            if a[column].dtype.kind == "f":
                np.testing.assert_allclose(b[column], a[column], atol=1e-5, rtol=0,
                                           err_msg=f"{name}:{column}")  # fmt: skip
            else:
                assert a[column].tolist() == b[column].tolist(), f"{name}:{column}"
    runs = [json.loads((tmp_path / r / "run.json").read_text()) for r in ("one", "two")]
    assert runs[0]["inputs"] == runs[1]["inputs"] and runs[1]["processes"] == 2


def test_a_hub_name_is_parsed_and_checked():
    with pytest.raises(ProbeError, match="name a hub dataset"):
        corpus_spec("hf:")


def test_cross_attention_reads_a_corpus(tmp_path):
    """An encoder-decoder model: roles and cross-attention read the corpus's windows, the decoder
    each window itself, so cross-attention counts every token of every window as a query."""
    from models import SEQ2SEQ

    folder = tmp_path / "t5"
    config = SEQ2SEQ["t5"]()
    config.vocab_size = 128  # the test tokenizer's
    tf.AutoModel.from_config(config).save_pretrained(folder)
    tokenizer = wordpiece()
    tokenizer.save_pretrained(folder)
    corpus = write(tmp_path, "txt")
    out = tmp_path / "r"
    args = ["analyze", "-m", str(folder), "-a", "roles,cross", "--corpus", str(corpus),
            "--context", "16", "-q", "-o", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    windows = [ids for _, ids in expected_windows(tokenizer, TEXTS, 16) if ids]
    cross = pd.read_csv(out / "cross_attention.csv")
    # The decoder reads [start] + the window's first n - 1 tokens: n queries; one more where
    # the window is padded (decoder_inputs lets the start of the padding read the last token).
    tokens = sum(len(ids) for ids in windows)
    assert cross.queries.nunique() == 1 and tokens <= cross.queries[0] <= tokens + len(windows)
    run = json.loads((out / "run.json").read_text())
    assert run["reads"] == {"roles": ["text"], "cross": ["text"]} and run["treebank"] == []


@pytest.mark.slow
def test_sink_alpha_on_a_corpus_equals_eager_attentions(tmp_path, tokenizer):
    """taxonomy's sink α on corpus windows: the attention of each window's first 64 queries to
    its first token, as MiniLM's own eager attention weights give it."""
    from probe.patterns.headtypes import SINK_TOKENS
    from probe.pipeline.loading import resolve_name

    corpus = write(tmp_path, "parquet")
    out = tmp_path / "r"
    args = ["analyze", "-m", "minilm", "-a", "taxonomy", "--corpus", str(corpus),
            "--context", "80", "--repeat-sequences", "2", "--repeat-length", "5", "-q",
            "-o", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    model = tf.AutoModel.from_pretrained(resolve_name("minilm"), attn_implementation="eager")
    sums, queries = 0, 0
    for _, ids in expected_windows(tokenizer, TEXTS, 80):
        if ids:
            attentions = model(torch.tensor([ids]), output_attentions=True).attentions
            pattern = torch.stack(attentions)[:, 0]  # [layer, head, q, k]
            sums = sums + pattern[:, :, :SINK_TOKENS, 0].sum(-1).double()
            queries += min(len(ids), SINK_TOKENS)
    table = pd.read_csv(out / "taxonomy.csv").sort_values(["layer", "head"])
    np.testing.assert_allclose(table.sink_alpha, (sums / queries).flatten().detach(), atol=1e-5)
    assert (table.sink_queries == queries).all()


def test_an_analysis_reads_a_corpus_only_when_one_is_given():
    """``Either`` picks the corpus when the run has one, else the treebank; every alternative
    counts where options and contracts are checked."""
    import analyses

    roles, taxonomy, syntax = (analyses.get(n) for n in ("roles", "taxonomy", "syntax"))
    assert roles.units() == ("text", "sentence")
    assert roles.units({"treebank"}) == ("sentence",)
    assert roles.units({"treebank", "corpus"}) == ("text",)
    assert taxonomy.units({"treebank", "corpus"}) == ("repeats", "text")
    assert syntax.units({"treebank", "corpus"}) == ("sentence",)
