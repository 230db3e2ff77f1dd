"""The ``probe`` command stopped by a signal exits as a shell reports a process the signal
ended, 128 + its number (Ctrl-C 130, SIGTERM 143, SIGHUP 129), still saying so in one line:
a script or a job scheduler can tell an interrupted run from a failed one."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

SCRIPT = Path(sys.executable).parent / "probe"
# The installed command, or where it is not installed, what its script runs.
PROBE = [str(SCRIPT)] if SCRIPT.is_file() else [
    sys.executable, "-c", "import sys; from probe.app.cli import command; sys.exit(command())"
]  # fmt: skip


def _reading(pid: int, fifo: Path) -> bool:
    """Whether process ``pid`` has the FIFO open."""
    try:
        return any(os.path.samefile(os.path.join(f"/proc/{pid}/fd", fd), fifo)
                   for fd in os.listdir(f"/proc/{pid}/fd"))  # fmt: skip
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stop", "status", "line"),
    [
        (signal.SIGINT, 130, "error: interrupted; no report was written"),
        (signal.SIGTERM, 143, "error: stopped by SIGTERM; no report was written"),
        (signal.SIGHUP, 129, "error: stopped by SIGHUP; no report was written"),
    ],
)
def test_a_signal_exits_with_the_shell_s_status_and_one_line(tmp_path, stop, status, line):
    """``probe analyze`` waiting on a pipe given as --treebank (its plan, before torch):
    signalled, it answers in one line and exits 128 + the signal's number."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    writer: list = []  # the pipe's writer end, held open and silent: the run waits on it
    opener = threading.Thread(target=lambda: writer.append(open(fifo, "wb")), daemon=True)  # noqa: SIM115
    opener.start()
    run = subprocess.Popen([*PROBE, "analyze", "-m", "x", "-t", str(fifo), "-o",
                            str(tmp_path / "r")], stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not _reading(run.pid, fifo):
            assert time.monotonic() < deadline and run.poll() is None, run.stderr.read()
            time.sleep(0.02)
        run.send_signal(stop)
        _, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
        opener.join(5)
        for end in writer:
            end.close()
    assert (run.returncode, err) == (status, line + "\n")
    assert not (tmp_path / "r").exists()


def _waiting_on_a_pipe(tmp_path: Path, **popen) -> tuple[subprocess.Popen, list, threading.Thread]:
    """``probe analyze`` reading a silent pipe as its treebank (at plan time, before torch):
    the process, the pipe's writer end (once opened) and the thread that opens it."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    writer: list = []
    opener = threading.Thread(target=lambda: writer.append(open(fifo, "wb")), daemon=True)  # noqa: SIM115
    opener.start()
    run = subprocess.Popen([*PROBE, "analyze", "-m", "x", "-t", str(fifo), "-o",
                            str(tmp_path / "r")], stderr=subprocess.PIPE, text=True,
                           **popen)  # fmt: skip
    deadline = time.monotonic() + 60
    while not _reading(run.pid, fifo):
        assert time.monotonic() < deadline and run.poll() is None, run.stderr.read()
        time.sleep(0.02)
    return run, writer, opener


@pytest.mark.slow
def test_under_nohup_a_closed_terminal_does_not_stop_the_run(tmp_path):
    """SIGHUP ignored when the command starts (as nohup leaves it) stays ignored: the run goes
    on after it, to its own end (here, the empty treebank's one line)."""
    ignore = lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)  # noqa: E731
    run, writer, opener = _waiting_on_a_pipe(tmp_path, preexec_fn=ignore)
    try:
        run.send_signal(signal.SIGHUP)
        time.sleep(0.5)  # the signal has arrived, and been ignored
        assert run.poll() is None
        opener.join(5)
        writer[0].close()  # the treebank ends, empty: the run goes on to its own answer
        _, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    assert "SIGHUP" not in err and "Traceback" not in err, err
    assert run.returncode != 128 + signal.SIGHUP and len(err.splitlines()) == 1, err


@pytest.mark.slow
@pytest.mark.parametrize("gap", [0.0, 0.002, 0.02])
def test_two_ctrl_cs_give_one_line(tmp_path, gap):
    """A second Ctrl-C while the command unwinds from the first is ignored: one line, 130."""
    run, writer, opener = _waiting_on_a_pipe(tmp_path)
    try:
        run.send_signal(signal.SIGINT)
        time.sleep(gap)
        run.send_signal(signal.SIGINT)
        _, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
        opener.join(5)
        for end in writer:
            end.close()
    assert (run.returncode, err) == (130, "error: interrupted; no report was written\n")


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["analyze", "--help"]])
def test_a_full_disk_on_stdout_is_one_line(args):
    with open("/dev/full", "w") as full:
        done = subprocess.run([*PROBE, *args], stdout=full, stderr=subprocess.PIPE, text=True,
                              timeout=120)  # fmt: skip
    assert done.returncode == 1
    assert done.stderr == "error: could not write to standard output: No space left on device\n"


def test_a_report_written_then_a_full_disk_on_stdout_is_one_line(tiny_report):
    """The report is re-rendered (written whole), then its path cannot be printed."""
    with open("/dev/full", "w") as full:
        done = subprocess.run([*PROBE, "report", str(tiny_report)], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=120)  # fmt: skip
    assert (done.returncode, done.stderr.count("\n")) == (1, 1), done.stderr
    assert "could not write to standard output" in done.stderr
    assert (tiny_report / "index.html").is_file()


def test_python_dash_m_probe_is_the_command():
    done = subprocess.run([sys.executable, "-m", "probe", "--version"], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and done.stdout.startswith("probe "), done.stderr
