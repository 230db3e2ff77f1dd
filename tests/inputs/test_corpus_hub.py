"""``--corpus hf:NAME[:CONFIG][@SPLIT]`` read for real through 🤗 datasets, from a stand-in hub on
127.0.0.1 that serves a dataset repository the way the hub's API does (info, tree, resolve), with
its split and config picked from the files' layout. The tables equal those of the same texts
given as a local file."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from probe.inputs.treebank import SAMPLE, read_conllu

REPO = "acme/tiny-corpus"
COMMIT = "1" * 40
TABLES = ("head_stats.csv", "head_similarity.csv")


class DatasetHub(http.server.BaseHTTPRequestHandler):
    """The hub's dataset endpoints that ``datasets.load_dataset(..., streaming=True)`` calls,
    for the one repository in ``self.server.folder``; it records each path asked for."""

    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self.answer(body=False)

    def do_GET(self):
        self.answer(body=True)

    def answer(self, body: bool) -> None:
        url = urlsplit(self.path)
        path, folder = unquote(url.path), self.server.folder
        self.server.asked.append(path)
        api, files = f"/api/datasets/{REPO}", f"/datasets/{REPO}/resolve/"
        if path.startswith(files):
            file = folder / path.removeprefix(files).partition("/")[2]
            if file.is_file():
                data = file.read_bytes()
                etag = f'"{hashlib.sha1(data).hexdigest()}"'
                return self.send(200, data, body, {"ETag": etag, "X-Repo-Commit": COMMIT})
            return self.send(404, b"", body, {"X-Error-Code": "EntryNotFound"})
        if path == api or path.startswith(f"{api}/revision/"):
            siblings = [{"rfilename": p.relative_to(folder).as_posix()} for p in walk(folder)]
            info = {"id": REPO, "sha": COMMIT, "private": False, "siblings": siblings}
            return self.send(200, json.dumps(info).encode(), body)
        if path.startswith(f"{api}/tree/"):
            below = path.removeprefix(f"{api}/tree/").partition("/")[2]
            deep = "recursive=true" in url.query.lower()
            return self.send(200, json.dumps(tree(folder, folder / below, deep)).encode(), body)
        self.send(404, b"", body, {"X-Error-Code": "RepoNotFound"})

    def send(self, status: int, data: bytes, body: bool, headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if body:
            self.wfile.write(data)


def walk(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def tree(root: Path, folder: Path, deep: bool) -> list[dict]:
    entries = []
    for p in sorted(folder.rglob("*") if deep else folder.iterdir()):
        name = p.relative_to(root).as_posix()
        if p.is_file():
            oid = hashlib.sha1(p.read_bytes()).hexdigest()
            entries.append({"type": "file", "path": name, "size": p.stat().st_size, "oid": oid})
        else:
            entries.append({"type": "directory", "path": name, "oid": "0" * 40})
    return entries


@contextmanager
def hub_serving(folder: Path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), DatasetHub)
    server.daemon_threads = True
    server.folder, server.asked = folder, []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server.asked
    finally:
        server.shutdown()
        server.server_close()


def texts() -> list[str]:
    """The sample treebank's sentences, as a corpus of plain text."""
    return [" ".join(s.words) for s in read_conllu(SAMPLE)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def analyze(tmp_path: Path, name: str, corpus: str, env: dict) -> Path:
    out = tmp_path / name
    argv = ["analyze", "-m", "minilm", "-a", "roles", "--corpus", corpus, "--text-column", "body",
            "--context", "16", "-o", str(out), "-q"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "probe.app.cli", *argv], capture_output=True,
                          text=True, env=os.environ | env, cwd=tmp_path, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return out


@pytest.mark.slow
def test_a_hub_dataset_is_read_through_datasets_as_a_local_file_is(minilm, tmp_path):
    """``hf:acme/tiny-corpus@validation`` with another text column: read from the stand-in hub
    (its validation split; the train split has one text), cut at ``--context``, and analysed
    into the tables a local jsonl of the same rows gives; run.json records the corpus."""
    sentences = texts()
    assert len(sentences) >= 20
    rows = [{"body": s, "text": "not this column", "n": i} for i, s in enumerate(sentences)]
    repo = tmp_path / "repo"
    write_jsonl(repo / "data" / "validation.jsonl", rows)
    write_jsonl(repo / "data" / "train.jsonl", [{"body": "the train split", "text": "", "n": 0}])
    local = write_jsonl(tmp_path / "texts" / "corpus.jsonl", rows)
    env = {"HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf")}
    with hub_serving(repo) as (endpoint, asked):
        hub = analyze(tmp_path, "hub", f"hf:{REPO}@validation", env | {"HF_ENDPOINT": endpoint})
    assert f"/datasets/{REPO}/resolve/{COMMIT}/data/validation.jsonl" in asked
    mine = analyze(tmp_path, "local", str(local), env | {"HF_HUB_OFFLINE": "1"})
    for table in TABLES:
        assert (hub / table).read_bytes() == (mine / table).read_bytes(), table
    run = json.loads((hub / "run.json").read_text())
    assert run["reads"]["roles"] == ["text"]
    assert f"hf:{REPO}@validation" in json.dumps(run["corpus"])
    assert run["inputs"]["text"]["texts"] == len(sentences)
    assert run["inputs"]["text"]["windows"] > len(sentences)  # --context 16 cut the longer ones
