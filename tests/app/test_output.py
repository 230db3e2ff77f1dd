"""The output folder: never anything but probe's own report replaced, checked before any
compute, one run at a time, written whole or not at all, whatever signals and crashes do."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from probe.app import output
from probe.app.output import MARKER, reserved
from probe.errors import ProbeError

# A model name that cannot load: an error about the output path proves it was checked first.
NO_MODEL = "no-such-model-anywhere"


def probe_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "probe.app.cli", *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)  # fmt: skip


def one_line(result: subprocess.CompletedProcess, message: str) -> None:
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("error:") and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def report(folder: Path, text: str = "old") -> Path:
    """A folder as probe writes it."""
    folder.mkdir(parents=True)
    (folder / MARKER).write_text('{"kind": "report"}')
    (folder / "index.html").write_text(text)
    return folder


def test_overwrite_never_replaces_what_probe_did_not_write(tmp_path):
    thesis = tmp_path / "d"
    thesis.mkdir()
    (thesis / "thesis.tex").write_text("years of work")
    treebank = thesis / "mine.conllu"
    treebank.write_text((Path(output.__file__).parents[1] / "data" / "sample.conllu").read_text())
    result = probe_cli(
        "analyze", "-m", NO_MODEL, "-t", str(treebank), "-o", str(thesis), "--overwrite"
    )
    one_line(result, "is not a probe report")
    assert (thesis / "thesis.tex").read_text() == "years of work" and treebank.exists()


@pytest.mark.parametrize(
    ("make", "out", "message"),
    [
        (lambda d: (d / "afile").write_text("x"), "afile", "is a file"),
        (lambda d: (d / "afile").write_text("x"), "afile/sub", "afile is a file"),
        (lambda d: (d / "link").symlink_to(report(d / "real")), "link", "symbolic link"),
        (lambda d: None, "/proc/x", "is not writable"),
        (lambda d: report(d / "here"), ".", "holds the current folder"),
    ],
)
def test_output_paths_are_checked_before_any_compute(tmp_path, make, out, message):
    make(tmp_path)
    cwd = tmp_path / "here" if out == "." else tmp_path
    result = probe_cli("analyze", "-m", NO_MODEL, "-o", out, "--overwrite", cwd=cwd)
    one_line(result, message)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # nothing left


@pytest.mark.slow
def test_one_run_at_a_time(tmp_path):
    """While a run holds the place, a second fails at once, saying so; afterwards it may."""
    out = tmp_path / "report"
    with reserved(out, overwrite=False) as staging:
        (staging / "index.html").write_text("first")
        second = probe_cli("analyze", "-m", NO_MODEL, "-o", str(out))
        one_line(second, "another probe run is writing")
    assert (out / "index.html").read_text() == "first" and (out / MARKER).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]


def test_a_run_finds_the_place_taken_at_the_end(tmp_path):
    """Something else creates the folder while the run computes: nothing is replaced."""
    out = tmp_path / "report"
    with pytest.raises(ProbeError, match="created by something else"), reserved(out, False):
        out.mkdir()
        (out / "theirs.txt").write_text("theirs")
    assert [p.name for p in out.iterdir()] == ["theirs.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]


def test_a_failed_run_leaves_the_old_report_and_no_debris(tmp_path):
    out = report(tmp_path / "reports" / "model")
    with pytest.raises(RuntimeError), reserved(out, overwrite=True) as staging:
        (staging / "index.html").write_text("new")
        raise RuntimeError("the analysis failed")
    assert (out / "index.html").read_text() == "old"
    assert sorted(p.name for p in out.parent.iterdir()) == ["model"]
    nested = tmp_path / "new" / "deeper" / "model"
    with pytest.raises(RuntimeError), reserved(nested, overwrite=False):
        raise RuntimeError("failed before anything was written")
    assert not (tmp_path / "new").exists()  # the folders it made for the report, too


@pytest.mark.parametrize("atomic", [True, False])
def test_overwrite_swaps_the_reports(tmp_path, monkeypatch, atomic):
    """With renameat2 the old and new reports are exchanged in one step; without it (another
    system), by two renames."""
    if not atomic:
        monkeypatch.setattr(output, "_renameat2", lambda *args: False)
    out = report(tmp_path / "model")
    with reserved(out, overwrite=True) as staging:
        (staging / "index.html").write_text("new")
    assert (out / "index.html").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_an_old_report_caught_between_two_renames_comes_back(tmp_path):
    """A crash after the old report was moved aside and before the new one took its place
    (systems without an atomic exchange): the next run puts the old one back first."""
    out = tmp_path / "model"
    report(tmp_path / f".model.probe-old-{12345}")
    with reserved(out, overwrite=True) as staging:
        assert (out / "index.html").read_text() == "old"  # restored before the run
        (staging / "index.html").write_text("new")
    assert (out / "index.html").read_text() == "new"


def test_what_killed_runs_left_is_cleaned_up(tmp_path):
    """A run killed with SIGKILL leaves its staging folder and lock file; nobody holds the
    lock, so the next run takes the place and removes them."""
    out = tmp_path / "model"
    (tmp_path / ".model.probe-999-1").mkdir()
    (tmp_path / ".model.probe-999-1" / "index.html").write_text("half")
    (tmp_path / ".model.probe-lock").write_text("")
    with reserved(out, overwrite=False) as staging:
        (staging / "index.html").write_text("whole")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_the_report_follows_the_umask(tmp_path):
    previous = os.umask(0o022)
    try:
        with reserved(tmp_path / "model", overwrite=False) as staging:
            (staging / "index.html").write_text("x")
    finally:
        os.umask(previous)
    assert (tmp_path / "model").stat().st_mode & 0o777 == 0o755


@pytest.mark.slow
def test_sigterm_while_running_keeps_the_old_report(tmp_path, minilm):
    out = report(tmp_path / "model")
    args = [sys.executable, "-m", "probe.app.cli", "analyze", "-m", "minilm", "-o", str(out),
            "-t", "sample", "--overwrite", "-q"]  # fmt: skip
    child = subprocess.Popen(args, stderr=subprocess.PIPE, text=True,
                             env=os.environ | {"HF_HUB_OFFLINE": "1"})  # fmt: skip
    deadline = time.monotonic() + 60
    while not any(p.name.startswith(".model.probe-") and p.is_dir() for p in tmp_path.iterdir()):
        assert time.monotonic() < deadline and child.poll() is None
        time.sleep(0.05)
    time.sleep(1.0)  # well inside the run
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 143 and "stopped by SIGTERM" in err and "Traceback" not in err
    assert (out / "index.html").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


@pytest.mark.slow
def test_killed_at_random_points_leaves_the_old_report_or_the_new(tmp_path, minilm):
    """SIGKILL at random moments of a run that replaces a report: the folder is the old report
    or the whole new one, never a mix; what the killed run left is hidden, and the next run
    removes it."""
    import random

    out = report(tmp_path / "model")
    chance = random.Random(0)
    args = [sys.executable, "-m", "probe.app.cli", "analyze", "-m", "minilm", "-a", "spectra",
            "-o", str(out), "--overwrite", "-q"]  # fmt: skip
    start = time.monotonic()
    subprocess.run(args, check=True, env=os.environ | {"HF_HUB_OFFLINE": "1"})
    whole = time.monotonic() - start
    new = {p.name for p in out.iterdir()}
    for _ in range(5):
        if not out.exists():
            report(out, "old")
        child = subprocess.Popen(args, env=os.environ | {"HF_HUB_OFFLINE": "1"})
        time.sleep(chance.uniform(0, whole))
        child.kill()
        child.wait()
        names = {p.name for p in out.iterdir()}
        old = (out / "index.html").read_text() == "old"
        assert (old and names == {MARKER, "index.html"}) or names == new, names
        if not old:  # the run had finished: start again from an old report
            shutil.rmtree(out)
    assert all(p.name.startswith(".") for p in tmp_path.iterdir() if p.name != "model")
    with reserved(out, overwrite=True) as staging:
        (staging / "index.html").write_text("next")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


# A short-lived lock (probe figures, report and compare hold a report's for seconds) is waited
# for, within LOCK_WAIT_S and saying so; a run's (analyze: minutes) is refused at once.


def test_a_brief_holder_is_waited_for_and_said(tmp_path, monkeypatch, capsys):
    """A command holding the report's lock to read it (as figures does) lets go after a moment:
    a run to that report waits for it, says so on stderr, and then writes its report."""
    import threading

    out = report(tmp_path / "report")
    leaving = threading.Event()  # set as figures lets go (the lock is released right after)

    def figures():
        with output.locked(out, reading=True):
            held.set()
            time.sleep(0.5)
            leaving.set()

    held = threading.Event()
    monkeypatch.setattr(sys, "argv", ["probe", "figures", str(out)])
    holder = threading.Thread(target=figures)
    holder.start()
    held.wait(10)
    with reserved(out, overwrite=True) as staging:
        assert leaving.is_set()  # the place was taken only once figures let go
        (staging / "index.html").write_text("new")
    holder.join()
    assert (out / "index.html").read_text() == "new"
    said = capsys.readouterr().err
    assert said == (f"probe: {out} is held by probe figures (process {os.getpid()}); waiting "
                    f"for it, up to {output.LOCK_WAIT_S:g} s\n")  # fmt: skip


def test_a_brief_holder_is_waited_for_within_a_bound(tmp_path, monkeypatch):
    """One that holds it past LOCK_WAIT_S: the command fails in one line, nothing replaced."""
    out = report(tmp_path / "report")
    monkeypatch.setattr(output, "LOCK_WAIT_S", 0.3)
    monkeypatch.setattr(sys, "argv", ["probe", "report", str(out)])
    with (
        output.locked(out),
        pytest.raises(ProbeError) as error,
        reserved(out, overwrite=True) as staging,
    ):
        (staging / "index.html").write_text("new")
    assert str(error.value) == (f"{out} is still held by probe report (process {os.getpid()}) "
                                "after 0.3 s; run this again once it is done")  # fmt: skip
    assert (out / "index.html").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]


def test_a_runs_lock_is_refused_at_once_and_a_lock_without_a_holder_taken(tmp_path, monkeypatch):
    """Two runs into one folder: the second is refused at once, never made to wait (a wait of
    0 s would fail otherwise with another message); figures finding a run's lock refuse too."""
    out = report(tmp_path / "report")
    monkeypatch.setattr(output, "LOCK_WAIT_S", 0.0)
    with reserved(out, overwrite=True):
        for second in (lambda: reserved(out, overwrite=True), lambda: output.locked(out)):
            with pytest.raises(ProbeError, match="another probe run is writing"), second():
                pass
    with reserved(out, overwrite=True) as staging:  # the lock file its holder left is taken
        (staging / "index.html").write_text("new")


@pytest.mark.slow
def test_analyze_waits_for_figures_holding_the_report(tiny_model, tmp_path):
    """``probe analyze --overwrite`` started while ``probe figures`` holds the report's lock:
    it waits, says so in a line, and once figures lets go, replaces the report."""
    out = tmp_path / "report"
    args = ["analyze", "-m", str(tiny_model), "-t", "sample", "-a", "syntax", "-q", "-o", str(out)]
    first = probe_cli(*args)
    assert first.returncode == 0, first.stderr
    created = json.loads((out / "run.json").read_text())["created"]
    holding = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfrom pathlib import Path\n"
         "from probe.app.output import locked\n"
         "report, sys.argv = Path(sys.argv[1]), ['probe', 'figures', sys.argv[1]]\n"
         "with locked(report, reading=True):\n"
         "    print('held', flush=True)\n    sys.stdin.readline()\n", str(out)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holding.stdout.readline() == "held\n"
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    second = subprocess.Popen([sys.executable, "-m", "probe.app.cli", *args, "--overwrite"],
                              stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    said = second.stderr.readline()  # figures lets go once analyze says it waits
    holding.communicate("go\n", timeout=60)
    rest = second.communicate(timeout=300)[1]
    assert second.returncode == 0, said + rest
    assert said == (f"probe: {out} is held by probe figures (process {holding.pid}); waiting "
                    f"for it, up to {output.LOCK_WAIT_S:g} s\n") and rest == ""  # fmt: skip
    assert json.loads((out / "run.json").read_text())["created"] != created  # replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]
