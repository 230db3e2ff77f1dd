"""A long text is read, tokenized and cut in pieces (``probe.inputs.pieces``), and gives exactly
the windows its whole gives, for each tokenizer family and MiniLM's; a text with no space for a
long stretch is cut inside a word, and its windows say so. A one-line .txt of tens of megabytes
is read in bounded memory, and Ctrl-C during it is answered at once."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_corpus import expected_windows, tokenizer  # noqa: F401 (a fixture)
from tokenizers_util import FAMILIES

from probe.inputs import pieces
from probe.inputs.pieces import INSIDE_A_WORD, PIECE_CHARS, UNSPACED_CHARS, tokens_in_pieces
from probe.inputs.texts import _txt_pieces, corpus_spec, windows
from probe.inputs.windowing import Cutter, special_tokens

WORDS = ["the", "cat", "sat", "on", "mat", "Unbelievably", "strangers", "«they»", "$5",
         "tax,", "naïve", "東京", "don't", "x" * 150, "...", "(a)", "e\u0301", "\t",
         ""]  # fmt: skip
SEPARATORS = [" "] * 12 + ["  ", "\t", " \t ", "   "]


def long_text(seed: int, chars: int) -> str:
    """Words of many kinds (punctuation, accents, CJK, a word longer than WordPiece takes, empty
    ones), mostly single spaces between them, sometimes runs of spaces and tabs."""
    rng = random.Random(seed)
    parts, length = [], 0
    while length < chars:
        parts += [rng.choice(WORDS), rng.choice(SEPARATORS)]
        length += len(parts[-2]) + len(parts[-1])
    return "".join(parts)[:chars]


def whole(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False, verbose=False)["input_ids"]


def streamed(tok, text: str, chunk: int) -> tuple[list[int], list[bool], set[str]]:
    chunks = iter([text[i : i + chunk] for i in range(0, len(text), chunk)])
    ids, punct, why = [], [], set()
    for run, run_punct, cut in tokens_in_pieces(tok, chunks):
        ids, punct, why = ids + run, punct + run_punct, why | {cut}
    return ids, punct, why - {""}


def minilm():
    from transformers import AutoTokenizer

    from probe.pipeline.loading import resolve_name

    return AutoTokenizer.from_pretrained(resolve_name("minilm"))


TOKENIZERS = {**FAMILIES, "minilm": minilm}


@pytest.mark.parametrize("family", TOKENIZERS)
def test_pieces_give_the_tokens_of_the_whole_text(family, monkeypatch):
    """Long generated texts, read in chunks of several sizes, with pieces made small so that
    each text is cut many times: the tokens and punctuation of the whole text, every cut
    checked and none inexact."""
    tok = TOKENIZERS[family]()
    monkeypatch.setattr(pieces, "PIECE_CHARS", 512)
    monkeypatch.setattr(pieces, "CONTEXT_CHARS", 64)
    for seed in range(4):
        text = long_text(seed, 20_000 + 997 * seed)
        expected = whole(tok, text)
        for chunk in (37, 700, 5000):
            ids, punct, why = streamed(tok, text, chunk)
            assert ids == expected, (family, seed, chunk)
            assert why == set(), (family, seed, chunk)
        (_, expected_punct), = _tokenize_whole(tok, text)  # fmt: skip
        assert punct == expected_punct


def _tokenize_whole(tok, text):
    from probe.inputs.windowing import tokenize

    return tokenize(tok, [text])


@pytest.mark.parametrize("family", TOKENIZERS)
def test_a_text_without_spaces_is_cut_inside_a_word_and_says_so(family, monkeypatch):
    """A stretch with no space longer than UNSPACED_CHARS is cut inside a word, the reason
    given; the text around it, spaced, still gives the whole text's tokens before the stretch."""
    tok = TOKENIZERS[family]()
    monkeypatch.setattr(pieces, "PIECE_CHARS", 256)
    monkeypatch.setattr(pieces, "UNSPACED_CHARS", 2048)
    head = long_text(7, 3000)
    text = head + " " + "abcdefghij東京" * 600 + " " + long_text(8, 3000)
    ids, _, why = streamed(tok, text, 300)
    assert why == {INSIDE_A_WORD}
    before = whole(tok, head.rsplit(" ", 1)[0])
    assert ids[: len(before) - 5] == before[:-5]  # the spaced start is read as the whole


def test_the_cutter_gives_the_windows_of_the_whole_text(tokenizer):  # noqa: F811
    """Texts longer than a piece among short ones: the windows test_corpus expects from the
    tokenizer alone, and no window inexact."""
    texts = ["a short one", long_text(1, 3 * PIECE_CHARS + 5), "", long_text(2, PIECE_CHARS + 1),
             "and the last"]  # fmt: skip
    given = [(p, True) for p in texts[:1]]
    for text in texts[1:]:
        given += [(text[i : i + 1000], i + 1000 >= len(text)) for i in range(0, len(text), 1000)]
        given += [("", True)] if not text else []
    rows = list(Cutter(tokenizer, 64).cut(given))
    assert [(r["window"], r["input_ids"]) for r in rows] == expected_windows(tokenizer, texts, 64)
    assert not any(r["inexact"] for r in rows)
    assert [r["text"] for r in rows if r["window"] == 0] == list(range(len(texts)))


@pytest.mark.parametrize(
    "content",
    [b"one\r\ntwo\rthree\n\n \nfour\r\n\r\nfive", b"a\n", b"\n", b"a\n\n", b"x" * 70_000 + b"\ny"],
)
def test_txt_lines_are_those_datasets_reads(tmp_path, content, monkeypatch):
    """probe's own .txt reader gives the lines datasets' text builder gives, long lines in
    pieces of at most PIECE_CHARS, even when a read ends inside a line or a \\r\\n."""
    import datasets

    from probe.inputs import texts

    monkeypatch.setattr(texts, "READ_CHARS", 7)
    path = tmp_path / "t.txt"
    path.write_bytes(content)
    rows = datasets.load_dataset("text", data_files=[str(path)], split="train", streaming=True)
    lines, line = [], ""
    for piece, last in _txt_pieces([str(path)]):
        assert len(piece) <= PIECE_CHARS
        line += piece
        if last:
            lines, line = [*lines, line], ""
    assert lines == [r["text"] for r in rows]
    assert texts._txt_lines(str(path)) == len(lines)


def test_a_long_line_gives_the_windows_of_the_whole_line(tmp_path, tokenizer):  # noqa: F811
    """Through windows(): a .txt and a .jsonl holding a long line between short ones."""
    texts = ["first", long_text(3, 5 * PIECE_CHARS), "last one"]
    (tmp_path / "c.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    with open(tmp_path / "c.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    expected = expected_windows(tokenizer, [t.replace("\t", "\t") for t in texts], 48)
    for name in ("c.txt", "c.jsonl"):
        rows = list(windows(corpus_spec(str(tmp_path / name)), tokenizer, 48))
        assert [(r["window"], r["input_ids"]) for r in rows] == expected, name
        assert [r["index"] for r in rows] == list(range(len(expected)))


BIG_MB = 20
ANALYZE = ["-a", "roles", "--max-texts", "1", "--context", "128", "-q"]


@pytest.fixture(scope="module")
def one_line(tmp_path_factory) -> Path:
    """A one-line .txt of BIG_MB megabytes."""
    path = tmp_path_factory.mktemp("big") / "one-line.txt"
    unit = long_text(5, 1 << 20).replace("\t", " ") + " "
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(BIG_MB):
            f.write(unit)
        f.write("\n")
    return path


def _environment() -> dict[str, str]:
    return os.environ | {"PYTHONPATH": str(Path(__file__).parents[2]), "HF_HUB_OFFLINE": "1",
                         "OMP_NUM_THREADS": "1"}  # fmt: skip


@pytest.mark.slow
def test_a_one_line_corpus_is_read_in_bounded_memory(one_line, tokenizer):  # noqa: F811
    """Reading and cutting the windows of a 20 MB line, in a subprocess: its peak memory grows
    by far less than the line, as much as reading a few pieces of it does."""
    code = (
        "import resource, sys\n"
        "from transformers import AutoTokenizer\n"
        "from probe.pipeline.loading import resolve_name\n"
        "from probe.inputs.texts import corpus_spec, windows\n"
        "tok = AutoTokenizer.from_pretrained(resolve_name('minilm'))\n"
        f"spec = corpus_spec({str(one_line)!r})\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "rows = windows(spec, tok, 128, max_texts=1)\n"
        "n = inexact = 0\n"
        "for row in rows:\n"
        "    n, inexact = n + 1, inexact + bool(row['inexact'])\n"
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print(n, inexact, (after - before) * 1024)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=_environment(), timeout=900)  # fmt: skip
    assert result.returncode == 0, result.stderr
    n, inexact, grown = map(int, result.stdout.split())
    print(f"{n} windows; peak RSS grew by {grown / 2**20:.1f} MiB for a {BIG_MB} MiB line")
    assert n > BIG_MB * 2**20 / 126 / 10 and inexact == 0  # a token per 10 characters at least
    assert grown < one_line.stat().st_size / 4


def _wait_until_reading(process: subprocess.Popen, path: Path) -> None:
    """Until the run has read a megabyte of ``path`` for its windows (past the plan's first
    piece, and not the quick count of its lines): where its descriptors of the file stand (the
    one the plan holds open stays at 0)."""
    deadline, seen = time.monotonic() + 600, 0
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        reading = False
        for fd in Path(f"/proc/{process.pid}/fd").iterdir():
            try:
                if os.readlink(fd) == str(path.resolve()):
                    info = Path(f"/proc/{process.pid}/fdinfo/{fd.name}").read_text()
                    position = int(info.split()[1])
                    reading |= 1 << 20 <= position < path.stat().st_size
            except (FileNotFoundError, ValueError):
                continue
        seen = seen + 1 if reading else 0
        if seen >= 3:  # three looks in a row: the slow reader, which tokenizes as it reads
            return
        time.sleep(0.2)
    raise AssertionError("the run never read the corpus")


@pytest.mark.slow
def test_ctrl_c_on_a_one_line_corpus_is_answered_in_one_line(one_line, tmp_path):
    """SIGINT while probe analyze reads the long line: one line, no report, soon."""
    out = tmp_path / "r"
    command = [sys.executable, "-m", "probe.app.cli", "analyze", "-m", "minilm", "-o", str(out),
               "--corpus", str(one_line), *ANALYZE]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=_environment(), start_new_session=True)  # fmt: skip
    try:
        _wait_until_reading(process, one_line)
        sent = time.monotonic()
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
        answered = time.monotonic() - sent
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    print(f"SIGINT answered in {answered:.2f} s")
    lines = stderr.strip().splitlines()
    assert process.returncode == 130 and len(lines) == 1, stderr
    assert "interrupted; no report was written" in lines[0]
    assert not out.exists()


def test_special_tokens_surround_each_window_of_a_long_text(tokenizer):  # noqa: F811
    prefix, suffix = special_tokens(tokenizer)
    text = long_text(4, 2 * UNSPACED_CHARS)
    given = [(text[:PIECE_CHARS], False), (text[PIECE_CHARS:], True)]
    rows = list(Cutter(tokenizer, 32).cut(given))
    assert all(r["input_ids"][: len(prefix)] == prefix for r in rows)
    assert all(r["input_ids"][len(r["input_ids"]) - len(suffix) :] == suffix for r in rows)
