"""Inputs as a careful user or a hostile machine gives them: options out of range, environment
variables that are not numbers, pipes, cut or NaN weights, trickling and failing servers, two
threads on one model, closed terminals. Each ends in one line (or works), in seconds, and leaves
nothing behind."""

import gzip
import hashlib
import http.server
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
import torch

from probe.app.output import WriteError, write_file
from probe.errors import ProbeError
from probe.inputs.download import fetch
from probe.inputs.treebank import SAMPLE, check_conllu, download_url, read_conllu, treebank_paths

GOOD = SAMPLE.read_bytes()


def cli(*args: str, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    env = os.environ | {"HF_HUB_OFFLINE": "1"} | (env or {})
    return subprocess.run([sys.executable, "-m", "probe.app.cli", *args], capture_output=True,
                          text=True, env=env, timeout=300, **kwargs)  # fmt: skip


def one_line(done: subprocess.CompletedProcess, *messages: str) -> None:
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("error:") and done.stderr.count("\n") == 1, done.stderr
    assert all(m in done.stderr for m in messages), done.stderr


# --- the writer -------------------------------------------------------------------------------


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    page = write_file(tmp_path / "index.html", "old")

    def cut(path: Path) -> None:
        path.write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(WriteError, match="No space left on device"):
        write_file(page, cut)
    assert page.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["index.html"]


def test_a_link_is_replaced_never_written_through(tmp_path):
    thesis = tmp_path / "thesis.tex"
    thesis.write_text("years of work")
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "index.html").symlink_to(thesis)
    write_file(tmp_path / "report" / "index.html", "page")
    assert thesis.read_text() == "years of work"
    assert (tmp_path / "report" / "index.html").read_text() == "page"
    assert not (tmp_path / "report" / "index.html").is_symlink()


def test_written_files_follow_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        path = write_file(tmp_path / "t.csv", lambda p: p.write_text("a\n"))
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o640


# --- options and environment, before torch ------------------------------------------------------

BEFORE_TORCH = """
import sys
from probe.app.cli import main
sys.argv = ["probe", *sys.argv[1:]]
try:
    main()
except SystemExit:
    pass
assert "torch" not in sys.modules, "torch was imported"
"""


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--device", "tpu"], {}, "unknown --device 'tpu'; use cpu, cuda, cuda:N, mps or auto"),
        (["--seed", "-1"], {}, "--seed -1 is out of range"),
        (["--seed", str(2**70)], {}, f"--seed {2**70} is out of range"),
        (["-n", str(2**70)], {}, f"--max-sentences {2**70} is out of range"),
        (["-o", "newdir/.."], {}, "ends in '..'"),
        (["-o", "x" * 230], {}, "is too long"),
        ([], {"PROBE_HTTP_TIMEOUT": "abc"}, "PROBE_HTTP_TIMEOUT='abc' is not a number of seconds"),
        ([], {"PROBE_HTTP_TIMEOUT": "-1"}, "PROBE_HTTP_TIMEOUT='-1' is not a number of seconds"),
        ([], {"PROBE_HTTP_TIMEOUT": "0"}, "PROBE_HTTP_TIMEOUT='0' is not a number of seconds"),
        ([], {"PROBE_HTTP_DEADLINE": "nan"}, "PROBE_HTTP_DEADLINE='nan' is not a number"),
        ([], {"PROBE_HTTP_MIN_RATE": "0"}, "PROBE_HTTP_MIN_RATE='0' is not a number of bytes a"),
        ([], {"PROBE_HTTP_MIN_RATE": "1e400"}, "PROBE_HTTP_MIN_RATE='1e400' is not a number"),
    ],
)
@pytest.mark.slow
def test_options_and_environment_are_checked_before_torch(tmp_path, args, env, message):
    argv = ["analyze", "-m", "no-such-model", "-t", "sample", *args]
    if "-o" not in args:
        argv += ["-o", str(tmp_path / "r")]
    done = subprocess.run([sys.executable, "-c", BEFORE_TORCH, *argv], capture_output=True,
                          text=True, env=os.environ | env, cwd=tmp_path, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr  # the script's own assertion: torch not imported
    assert done.stderr.startswith("error:") and message in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and list(tmp_path.iterdir()) == []


def feed(fifo: Path, data: bytes, pause: threading.Event | None = None,
         remove: bool = False) -> threading.Thread:  # fmt: skip
    """A writer thread that gives ``data`` to the FIFO (as ``zcat`` would a process
    substitution), halfway waiting for ``pause`` to be set when it is given; and then, with
    ``remove``, removes the FIFO."""

    def write():
        with open(fifo, "wb") as pipe:
            pipe.write(data[: len(data) // 2])
            pipe.flush()
            if pause is not None:
                pause.wait(60)
            with suppress(BrokenPipeError):  # its reader was killed
                pipe.write(data[len(data) // 2 :])
        if remove:
            fifo.unlink()

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_a_pipe_gives_the_tables_of_the_same_file_and_leaves_nothing(tiny_model, tmp_path):
    """A FIFO fed a gzip treebank (``<(cat x.conllu.gz)``) is read once, into a copy: the
    tables equal, byte for byte, those of the same treebank given as a file, the run card names
    the pipe, and the temporary folder is left as it was."""
    data = gzip.compress(GOOD)
    (tmp_path / "t.conllu.gz").write_bytes(data)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {"TMPDIR": str(scratch)}
    args = ["analyze", "-m", str(tiny_model), "-q", "-t"]
    done = cli(*args, str(tmp_path / "t.conllu.gz"), "-o", str(tmp_path / "file"), env=env)
    assert done.returncode == 0, done.stderr
    writer = feed(fifo, data)
    done = cli(*args, str(fifo), "-o", str(tmp_path / "pipe-run"), env=env)
    writer.join(10)
    assert done.returncode == 0, done.stderr
    tables = sorted(p.relative_to(tmp_path / "file") for p in (tmp_path / "file").rglob("*.csv"))
    assert len(tables) >= 3 and tables == sorted(
        p.relative_to(tmp_path / "pipe-run") for p in (tmp_path / "pipe-run").rglob("*.csv")
    )
    for table in tables:
        piped, filed = tmp_path / "pipe-run" / table, tmp_path / "file" / table
        assert piped.read_bytes() == filed.read_bytes(), table
    card = json.loads((tmp_path / "pipe-run" / "run.json").read_text())
    assert card["treebank"] == [str(fifo)]
    assert card["sentences_analysed"] == len(read_conllu(SAMPLE))
    assert list(scratch.iterdir()) == []


@pytest.mark.slow
def test_two_runs_in_one_process_read_their_own_pipes(tiny_model, tmp_path):
    """Two commands in one process, each given a new pipe of the same name, which its writer
    removes once written: each run reads its own pipe whole (the sample, then a part of it)."""
    from typer.testing import CliRunner

    from probe.app.cli import app

    fifo = tmp_path / "pipe"
    first_ten = b"\n\n".join(GOOD.split(b"\n\n")[:10]) + b"\n\n"
    for number, data in enumerate([GOOD, first_ten]):
        os.mkfifo(fifo)
        writer = feed(fifo, data, remove=True)
        out = tmp_path / str(number)
        args = ["analyze", "-m", str(tiny_model), "-t", str(fifo), "-q", "-o", str(out)]
        result = CliRunner().invoke(app, args)
        writer.join(10)
        assert result.exit_code == 0, result.output
        card = json.loads((out / "run.json").read_text())
        assert card["sentences_read"] == len(read_conllu(io_path(tmp_path, data)))


def io_path(folder: Path, data: bytes) -> Path:
    """``data`` as a file (to count its sentences with the reader a file gets)."""
    path = folder / "expected.conllu"
    path.write_bytes(data)
    return path


@pytest.mark.slow
def test_a_run_killed_while_it_reads_a_pipe_leaves_no_copy(tmp_path):
    """SIGKILL halfway through the pipe: the copy had no name, and none is left."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    pause = threading.Event()
    writer = feed(fifo, GOOD * 50, pause)
    run = subprocess.Popen([sys.executable, "-m", "probe.app.cli", "analyze", "-m", "x", "-t",
                            str(fifo), "-o", str(tmp_path / "r")], env=os.environ | {
                            "TMPDIR": str(scratch), "HF_HUB_OFFLINE": "1"})  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not _reading(run.pid, fifo):
        time.sleep(0.05)
    time.sleep(0.5)  # the first half is in the copy, a file without a name
    copies = [os.readlink(f"/proc/{run.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{run.pid}/fd")]
    assert any("probe-pipe-" in c and c.endswith("(deleted)") for c in copies), copies
    run.kill()
    run.wait(30)
    pause.set()
    writer.join(1)
    assert list(scratch.iterdir()) == [] and not (tmp_path / "r").exists()


def _reading(pid: int, fifo: Path) -> bool:
    """Whether process ``pid`` has the FIFO open."""
    try:
        return any(os.path.samefile(os.path.join(f"/proc/{pid}/fd", fd), fifo)
                   for fd in os.listdir(f"/proc/{pid}/fd"))  # fmt: skip
    except OSError:
        return False


def test_a_pipe_s_copy_is_removed_where_it_cannot_be_nameless(tmp_path, monkeypatch):
    """Without /proc/self/fd the copy is a named file of probe's, removed when dropped (at exit
    for a run); reads of the pipe's name read the copy, messages name the pipe."""
    from probe.inputs import pipes

    monkeypatch.setattr(pipes, "SELF_FD", str(tmp_path / "no-proc" / "{}"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    bad = GOOD + b"1\tx\tx\tX\t_\t_\t7\tdep\t_\t_\n\n"
    feed(fifo, bad)
    try:
        (path,) = treebank_paths([str(fifo)])
        (copy,) = (tmp_path / "tmp").iterdir()
        assert path == fifo and copy.read_bytes() == bad and pipes.read_from(fifo) == copy
        with pytest.raises(ProbeError, match=rf"{fifo}:\d+: head 7 out of range"):
            read_conllu(path)
    finally:
        pipes.forget(fifo)
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_pipe_under_torchrun_is_refused(tmp_path, monkeypatch):
    """Several processes reading one pipe would each get a part of it: refused, before any is
    read."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ProbeError, match="only one of the run's 2 processes could read"):
        treebank_paths([str(fifo)])


def test_out_may_not_hold_the_treebank(tmp_path):
    from probe.app.output import MARKER

    folder = tmp_path / "old"
    folder.mkdir()
    (folder / MARKER).write_text('{"kind": "report"}')
    (folder / "mine.conllu").write_bytes(GOOD)
    one_line(cli("analyze", "-m", "x", "-t", str(folder / "mine.conllu"), "-o", str(folder),
                 "--overwrite"), "holds an input of this command")  # fmt: skip
    assert (folder / "mine.conllu").read_bytes() == GOOD


# --- treebanks ----------------------------------------------------------------------------------


def chain(n: int, cycle: bool = False) -> str:
    """One sentence of ``n`` words, each the head of the one before (the last is the root); with
    ``cycle``, the last word's head is the first instead (no root: the first word is root)."""
    rows = []
    for i in range(1, n + 1):
        head, rel = (i + 1, "dep") if i < n else (0, "root")
        if cycle and i == 1:
            head, rel = 0, "root"
        if cycle and i == n:
            head, rel = 2, "dep"
        rows.append(f"{i}\tw{i}\tw\tX\t_\t_\t{head}\t{rel}\t_\t_")
    return "\n".join(rows) + "\n\n"


@pytest.mark.slow
def test_a_long_chain_is_a_tree_and_a_long_cycle_is_found(tmp_path):
    (tmp_path / "chain.conllu").write_text(chain(40_000))
    (sentence,) = read_conllu(tmp_path / "chain.conllu")
    assert sentence.heads[:3] == [1, 2, 3] and sentence.heads[-1] == -1
    (tmp_path / "cycle.conllu").write_text(chain(40_000, cycle=True))
    with pytest.raises(ProbeError, match=r"cycle.conllu:2: word 2 is in a cycle of heads"):
        read_conllu(tmp_path / "cycle.conllu")


def test_gzip_is_told_by_its_bytes_not_its_name(tmp_path):
    (tmp_path / "t.part").write_bytes(gzip.compress(GOOD))
    assert len(read_conllu(tmp_path / "t.part")) == len(read_conllu(SAMPLE))


# --- servers ------------------------------------------------------------------------------------


class Handler(http.server.BaseHTTPRequestHandler):
    """``self.server.routes``: path -> bytes, or a failure: trickle, 500, html, silent."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        route = self.server.routes.get(self.path.split("?")[0], self.server.routes.get("*"))
        if route == "silent":
            time.sleep(30)
            return
        if route is None or isinstance(route, int):
            self.send_response(route or 404)
            self.send_header("X-Error-Code", "RepoNotFound" if route is None else "")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/html" if route == "html" else "text/plain")
        body = b"<html>login</html>" if route == "html" else route
        self.send_header("Content-Length", str(len(GOOD) if route == "trickle" else len(body)))
        self.end_headers()
        if route == "trickle":
            for byte in GOOD:  # one byte a second would do; ten a second keeps the test short
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.1)
        else:
            self.wfile.write(body)


@contextmanager
def serving(routes: dict):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads, server.routes = True, routes
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
def test_a_trickling_server_meets_the_deadline(tmp_path, monkeypatch):
    monkeypatch.setenv("PROBE_HTTP_TIMEOUT", "5")
    monkeypatch.setenv("PROBE_HTTP_DEADLINE", "1.5")
    start = time.monotonic()
    late = pytest.raises(
        ProbeError, match=r"too slow, cut after \d+\.\d s .*PROBE_HTTP_DEADLINE=1\.5 s"
    )
    with serving({"/t.conllu": "trickle"}) as base, late:
        fetch(f"{base}/t.conllu", tmp_path / "c" / "t.conllu", validate=check_conllu)
    assert time.monotonic() - start < 10 and not list((tmp_path / "c").iterdir())


def paced(monkeypatch, stretch: str, rate: str, wait: str):
    """A ``Pace`` with these settings and a clock the test moves (``clock[0]``, seconds)."""
    from probe.inputs import download

    clock = [0.0]
    monkeypatch.setattr(download.time, "monotonic", lambda: clock[0])
    env = {"PROBE_HTTP_DEADLINE": stretch, "PROBE_HTTP_MIN_RATE": rate, "PROBE_HTTP_TIMEOUT": wait}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return download.Pace("x", "hint"), clock


def run(pace, clock, pieces) -> float | None:
    """Feed ``(seconds later, bytes)`` pieces; the clock when the pace cut, or None."""
    for later, size in pieces:
        clock[0] += later
        try:
            pace.add(size)
        except ProbeError:
            return clock[0]
    return None


def test_a_pace_cuts_a_slow_or_stalled_download_and_never_a_steady_one(monkeypatch):
    """Stretches of 100 s at 1,000 bytes a second, waits of at most 10 s: a steady 1,000 B/s
    for a day is never cut; 999 B/s is cut at the end of the first stretch; a byte a second
    after a fast start is cut within two stretches; ten minutes of the caller's own work
    between two requests (longer than any network wait and its retry) does not count, and the
    15 s silences of waits that time out and are retried do."""
    steady = [(1, 1000)] * 86_400
    assert run(*paced(monkeypatch, "100", "1000", "10"), steady) is None
    assert run(*paced(monkeypatch, "100", "1000", "10"), [(1, 999)] * 1000) == 100
    stall = [(1, 10**6)] * 50 + [(1, 1)] * 1000
    assert 100 <= run(*paced(monkeypatch, "100", "1000", "10"), stall) <= 250
    work = [(1, 2000)] * 50 + [(600, 0)] + [(1, 2000)] * 500
    assert run(*paced(monkeypatch, "100", "1000", "10"), work) is None
    retries = [(15, 1000)] * 100  # a wait times out (10 s), the retry gets a little, and so on
    assert run(*paced(monkeypatch, "100", "1000", "10"), retries) == 105
    pace, clock = paced(monkeypatch, "100", "1000", "10")
    assert run(pace, clock, [(5, 0)] * 30) == 100  # requests without bytes: the network's time
    with pytest.raises(ProbeError, match=r"x: too slow, cut after 100\.0 s \(0 bytes in the"):
        pace.add(10**9)  # and once cut, cut


@pytest.mark.parametrize(
    ("route", "message"),
    [
        ("html", "the server sent a web page"),
        (500, "500 Internal Server Error (a server error: try again later)"),
        (None, "404 Not Found (not found: check the URL)"),
    ],
)
def test_failed_downloads_say_what_failed_and_name_no_part_file(tmp_path, monkeypatch, route,
                                                                message):  # fmt: skip
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path))
    with serving({"/x/t.conllu": route}) as base, pytest.raises(ProbeError) as caught:
        download_url(f"{base}/x/t.conllu")
    assert message in str(caught.value) and ".part" not in str(caught.value)
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_a_gzip_url_is_read_and_pinned(tmp_path, monkeypatch):
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path))
    data = gzip.compress(GOOD)
    pin = hashlib.sha256(data).hexdigest()
    with serving({"/x/en.conllu.gz": data}) as base:
        (path,) = download_url(f"{base}/x/en.conllu.gz#sha256={pin}")
    assert path.name == "en.conllu.gz" and path.read_bytes() == data
    assert len(read_conllu(path)) == len(read_conllu(SAMPLE))


@pytest.mark.slow
def test_a_url_treebank_is_streamed_in_flat_memory(tmp_path, monkeypatch):
    """8 MB of CoNLL-U downloaded and validated, every sentence, while Python holds less than
    2 MB more; a fault in its last sentence is found."""
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path))
    big = GOOD * (8_000_000 // len(GOOD))
    with serving({"/big.conllu": big}) as base:
        tracemalloc.start()
        try:
            (path,) = download_url(f"{base}/big.conllu")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert path.stat().st_size == len(big)
    assert peak < 2_000_000, peak  # the server's copy was made before tracing began
    last = pytest.raises(ProbeError, match=r"bad\.conllu:\d+: head 7 out of range")
    with serving({"/bad.conllu": big + b"1\tx\tx\tX\t_\t_\t7\tdep\t_\t_\n\n"}) as base, last:
        download_url(f"{base}/bad.conllu")


@pytest.mark.parametrize(
    ("route", "message"),
    [
        (None, "the hub has no model 'acme/no-such-model' (404 not found)"),
        (500, "(500, a server error); try again later"),
        ("silent", "the hub did not answer within 2 s"),
    ],
)
@pytest.mark.slow
def test_the_hub_s_answers_are_told_apart_in_seconds(tmp_path, route, message):
    with serving({"*": route}) as base:
        env = {"HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": base,
               "PROBE_HTTP_TIMEOUT": "2"}  # fmt: skip
        start = time.monotonic()
        done = cli("analyze", "-m", "acme/no-such-model", "-o", str(tmp_path / "r"), env=env)
        seconds = time.monotonic() - start
    one_line(done, message)
    assert seconds < 60, seconds  # not the hub client's minute of retries per call


# --- models -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_cut_weight_file_is_named(tiny_model, tmp_path):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    one_line(cli("analyze", "-m", str(folder), "-t", "sample", "-o", str(tmp_path / "r")),
             f"{weights} is cut or damaged")  # fmt: skip
    weights.write_bytes(b"\x00" * 50)
    one_line(cli("analyze", "-m", str(folder), "-t", "sample", "-o", str(tmp_path / "r")),
             f"{weights} is cut or damaged")  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


@pytest.fixture(scope="module")
def nan_model(tiny_model, tmp_path_factory) -> Path:
    import shutil

    import transformers as tf

    folder = tmp_path_factory.mktemp("nan") / "model"
    model = tf.BertModel.from_pretrained(tiny_model)
    with torch.no_grad():
        model.encoder.layer[1].attention.self.query.weight[3, 5] = float("nan")
    model.save_pretrained(folder)
    for file in tiny_model.iterdir():
        if file.name.startswith("tok") or "special" in file.name:
            shutil.copy(file, folder)
    return folder


@pytest.mark.parametrize("analysis", ["syntax", "spectra"])
@pytest.mark.slow
def test_a_model_with_nan_weights_is_refused_naming_the_tensor(nan_model, tmp_path, analysis):
    done = cli("analyze", "-m", str(nan_model), "-t", "sample", "-a", analysis, "-o",
               str(tmp_path / "r"))  # fmt: skip
    one_line(done, "weight encoder.layer.1.attention.self.query.weight is not finite")
    assert list(tmp_path.iterdir()) == []


class Reader:
    """A consumer that reads nothing: the runner checks what it hands on."""

    def begin_batch(self, batch):
        pass

    def update(self, batch, layer, capture):
        raise AssertionError("a pattern that is not finite was handed on")

    def end_batch(self, batch):
        pass


def test_attention_that_is_not_finite_is_refused_naming_the_hook(tiny_model):
    """Finite weights whose scores overflow: every pattern is NaN, and no count absorbs it."""
    import transformers as tf

    from probe.inputs.corpus import Corpus
    from probe.inputs.treebank import load_treebank
    from probe.pipeline.runner import stream

    model = tf.BertModel.from_pretrained(tiny_model).eval()
    tokenizer = tf.AutoTokenizer.from_pretrained(tiny_model)
    with torch.no_grad():
        for name in ("query", "key"):
            getattr(model.encoder.layer[0].attention.self, name).weight.fill_(1e30)
    batches = Corpus(load_treebank("sample")[:4], tokenizer, 64).batches(4)
    with pytest.raises(ProbeError, match=r"blocks\.0\.attn\.hook_pattern is not finite"):
        stream(model, batches, [Reader()])


# --- threads, signals, the viewer ---------------------------------------------------------------


def test_a_second_thread_tracing_the_same_model_is_refused_at_once(tiny_model):
    import transformers as tf

    import probe

    model = tf.BertModel.from_pretrained(tiny_model).eval()
    ids = torch.tensor([[2, 10, 11, 12, 3]])
    inside, release, failures = threading.Event(), threading.Event(), []

    def first():
        with torch.no_grad(), probe.trace(model, "hook_pattern") as cache:
            inside.set()
            release.wait(30)
            model(input_ids=ids)
        assert len(cache) == 2

    def second():
        inside.wait(30)
        try:
            with probe.trace(model, "hook_pattern"):
                pass
        except ProbeError as e:
            failures.append(str(e))
        finally:
            release.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert failures and "being traced or hooked in another thread" in failures[0]
    with torch.no_grad(), probe.trace(model, "hook_pattern") as cache:  # free again afterwards
        model(input_ids=ids)
    with (  # and nested traces of one thread are fine
        torch.no_grad(),
        probe.trace(model, "hook_pattern") as again,
        probe.trace(model, "hook_z") as inner,
    ):
        model(input_ids=ids)
    assert len(cache) == len(again) == 2 and len(inner) == 2


def test_show_refuses_text_longer_than_the_model_takes(tiny_model):
    import transformers as tf

    import probe

    model = tf.BertModel.from_pretrained(tiny_model).eval()
    tokenizer = tf.AutoTokenizer.from_pretrained(tiny_model)
    limit = model.config.max_position_embeddings
    with pytest.raises(ProbeError, match=f"the model takes at most {limit}"):
        probe.show(model, tokenizer, "the cat " * limit)


@pytest.mark.slow
def test_a_closed_terminal_leaves_no_staging_folder_or_lock(tiny_model, tmp_path):
    out = tmp_path / "r"
    # Enough repeated sequences that the run is still going when the signal comes, however fast
    # the machine: the staging folder is made before the model loads.
    args = [sys.executable, "-m", "probe.app.cli", "analyze", "-m", str(tiny_model), "-t",
            "sample", "-a", "taxonomy", "--repeat-sequences", "1000000", "--repeat-length", "8",
            "-q", "-o", str(out)]  # fmt: skip
    child = subprocess.Popen(args, stderr=subprocess.PIPE, text=True,
                             env=os.environ | {"HF_HUB_OFFLINE": "1"})  # fmt: skip
    deadline = time.monotonic() + 120
    while not any(p.name.startswith(".r.probe-") and p.is_dir() for p in tmp_path.iterdir()):
        assert time.monotonic() < deadline and child.poll() is None
        time.sleep(0.05)
    child.send_signal(signal.SIGHUP)
    _, err = child.communicate(timeout=120)
    assert child.returncode == 129 and "stopped by SIGHUP" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


SWALLOWING_LIBRARY = """
import os, signal, time
from probe.app.signals import TerminatedError, catch_hangups
catch_hangups()
signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGHUP))
signal.alarm(1)  # a second from now, the terminal closes
deadline = time.monotonic() + 30
try:
    while time.monotonic() < deadline:
        try:  # as a library guards an optional step
            time.sleep(0.01)
        except Exception:
            pass
except TerminatedError as e:
    print("unwound by", e)
"""


@pytest.mark.slow
def test_a_library_s_except_exception_cannot_swallow_the_signal():
    """SIGHUP or SIGTERM may arrive while a library runs a line inside ``except Exception``
    (transformers has many): the run must still unwind, as it does for Ctrl-C."""
    done = subprocess.run([sys.executable, "-c", SWALLOWING_LIBRARY], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.stdout.strip() == "unwound by SIGHUP", (done.stdout, done.stderr)
