"""The command's console wraps to the terminal's width, at spaces, and where its output is not
a terminal (a file, a pipe, a CI log) not at all: rich cut every line at 80 columns."""

import fcntl
import itertools
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINE = " ".join(f"word{i}" for i in range(40))  # 269 characters
PRINT = (
    f"from probe.app.console import make_console; make_console().print({LINE!r}, highlight=False)"
)


def environment() -> dict[str, str]:
    """This environment, without what tells rich a width or a terminal of its own."""
    own = ("COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")
    env = {k: v for k, v in os.environ.items() if k not in own}
    return env | {"TERM": "xterm-256color", "PYTHONPATH": str(ROOT)}


@pytest.mark.slow
def test_a_pipe_gets_each_line_whole():
    done = subprocess.run([sys.executable, "-c", PRINT], capture_output=True, text=True,
                          env=environment(), timeout=120)  # fmt: skip
    assert done.returncode == 0 and done.stderr == LINE + "\n", done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("columns", [50, 120])
def test_a_terminal_gets_lines_as_wide_as_it_is(columns):
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    run = subprocess.Popen([sys.executable, "-c", PRINT], stdin=child, stderr=child,
                           stdout=subprocess.PIPE, env=environment())  # fmt: skip
    os.close(child)
    shown = b""
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:  # the child's end closed (EIO)
            break
        if not chunk:
            break
        shown += chunk
    os.close(main)
    assert run.wait(timeout=120) == 0
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown.decode()).replace("\r\n", "\n")
    lines = text.rstrip("\n").split("\n")
    assert all(len(line) <= columns for line in lines), lines
    for line, after in itertools.pairwise(lines):  # broken only where the next word did not fit
        assert len(line.rstrip()) + 1 + len(after.split()[0]) > columns, (line, after)
    assert " ".join(line.strip() for line in lines) == LINE  # broken at spaces only


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["analyze", "-m", "x", "--circuit-resamples", "2.5"],
         "error: Invalid value for '--circuit-resamples'"),
        (["analyze", "--circuit-pair", "3"], "error: No such option: --circuit-pair"),
        (["nosuch"], "error: No such command 'nosuch'; 'probe --help' lists the options"),
        (["experiment", "nosuch"], "error: No such command 'nosuch'; 'probe experiment --help'"),
        (["analyze", "-m"], "error: Option '-m' requires an argument"),
    ],
)  # fmt: skip
def test_what_click_refuses_is_one_line(args, said):
    """Click's usage, hint and error (three lines) become one line, status 2 as click's."""
    from typer.testing import CliRunner

    from probe.app.cli import app

    result = CliRunner().invoke(app, args, prog_name="probe")
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith(said), lines


def test_probe_alone_still_prints_its_help():
    from typer.testing import CliRunner

    from probe.app.cli import app

    result = CliRunner().invoke(app, [], prog_name="probe")
    assert "Usage: probe" in result.output and "analyze" in result.output
