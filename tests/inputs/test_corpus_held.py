"""A local corpus is read from the files the plan opened (``CorpusSpec.sources``): a file deleted,
moved or replaced during the run gives the windows it gave when the run was planned; a file the
plan did not hold (past ``HELD_FILES``) and that is gone stops the run in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from test_corpus import tokenizer  # noqa: F401 (a fixture)

from probe.errors import ProbeError
from probe.inputs import texts
from probe.inputs.texts import corpus_spec, count_texts, windows

ROOT = Path(__file__).resolve().parents[2]
TEXTS = [f"the cat number {i} sat on the mat, and the dog lay by the door." for i in range(40)]


def write(path: Path, rows: list[str]) -> Path:
    if path.suffix == ".txt":
        path.write_text("".join(f"{r}\n" for r in rows))
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    elif path.suffix == ".csv":
        pd.DataFrame({"text": rows}).to_csv(path, index=False)
    else:
        pd.DataFrame({"text": rows}).to_parquet(path)
    return path


def read(spec, tokenizer) -> list:  # noqa: F811
    return [(w["input_ids"], w["text"], w["window"]) for w in windows(spec, tokenizer, 16)]


@pytest.mark.parametrize("suffix", [".txt", ".jsonl", ".csv", ".parquet"])
@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_corpus_file_deleted_or_replaced_after_the_plan(suffix, how, tmp_path, tokenizer):  # noqa: F811
    """The run reads the file it planned on: the same windows and count as before."""
    path = write(tmp_path / f"notes{suffix}", TEXTS)
    spec = corpus_spec(str(path))
    expected, count = read(spec, tokenizer), count_texts(spec)
    if how == "deleted":
        path.unlink()
    else:  # an editor's save: another file renamed over it
        write(tmp_path / f"other{suffix}", ["something else entirely"] * 3).rename(path)
    assert read(spec, tokenizer) == expected and count_texts(spec) == count
    assert spec.files == (str(path),) and spec.describe().startswith(str(path))


def test_a_corpus_folder_file_deleted_past_the_held_ones(tmp_path, tokenizer, monkeypatch):  # noqa: F811
    """A folder of more files than probe holds open: one of those not held, deleted, stops the
    run in one line naming it; those held are read as planned."""
    monkeypatch.setattr(texts, "HELD_FILES", 1)
    folder = tmp_path / "notes"
    folder.mkdir()
    first, second = (write(folder / f"{n}.txt", TEXTS[:3]) for n in "ab")
    spec = corpus_spec(str(folder))
    assert len(spec.held) == 1
    expected = read(spec, tokenizer)
    first.unlink()
    assert read(spec, tokenizer) == expected
    second.unlink()
    with pytest.raises(ProbeError) as error:
        count_texts(spec)
    assert str(error.value) == (f"corpus {folder}: {second} was deleted or moved while probe "
                                "read it; nothing was written: put it back and re-run")  # fmt: skip
    with pytest.raises(ProbeError, match=f"{second} was deleted or moved while probe read it"):
        read(spec, tokenizer)


def test_an_error_names_the_file_not_its_descriptor(tmp_path):
    """A held file that turns out unreadable is named by its path in the one line."""
    path = tmp_path / "notes.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + "{not json\n")
    with pytest.raises(ProbeError) as error:
        corpus_spec(str(path))
    assert str(error.value).startswith(f"corpus {path}, line 2: not JSON")
    assert "/proc/self/fd" not in str(error.value)


def test_a_child_process_reads_by_path():
    """The descriptors are this process's: a spec seen in another reads the paths."""
    spec = texts.CorpusSpec("x", "text", ("/a.txt",), held=("/proc/self/fd/9",), holder=-1)
    assert spec.sources() == ("/a.txt",)


@pytest.mark.slow
def test_probe_analyze_finishes_from_a_corpus_deleted_mid_run(tiny_model, tmp_path):
    """``probe analyze --corpus FILE`` with FILE deleted once the run is planned: the report of
    the undisturbed run, not a traceback."""
    corpus = write(tmp_path / "notes.jsonl", TEXTS)
    script = tmp_path / "deleting.py"
    script.write_text(
        "import os, sys\n"
        "from probe.app import analyze\n"
        "corpus, planned = sys.argv[1], analyze.execute\n"
        "def execute(*args, **kwargs):\n"
        "    os.unlink(corpus)\n"
        "    return planned(*args, **kwargs)\n"
        "analyze.execute = execute\n"
        "from probe.app.cli import main\n"
        "sys.argv = ['probe', 'analyze', *sys.argv[2:]]\n"
        "main()\n"
    )
    args = ["-m", str(tiny_model), "-a", "roles", "--corpus", str(corpus), "-q", "-o"]
    undisturbed = subprocess.run([sys.executable, "-m", "probe.app.cli", "analyze", *args,
                                  str(tmp_path / "a")], capture_output=True, text=True, cwd=ROOT,
                                 timeout=300)  # fmt: skip
    assert undisturbed.returncode == 0, undisturbed.stderr
    done = subprocess.run([sys.executable, str(script), str(corpus), *args, str(tmp_path / "b")],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert not corpus.exists()
    a, b = (json.loads((tmp_path / r / "run.json").read_text()) for r in "ab")
    assert a["inputs"] == b["inputs"] and a["inputs"]["text"]["windows"] == 40
    pd.testing.assert_frame_equal(*(pd.read_csv(tmp_path / r / "heads.csv") for r in "ab"))
