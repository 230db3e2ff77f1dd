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
