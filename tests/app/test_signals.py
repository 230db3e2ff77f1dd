"""The command's answers to signals, run in a process that goes on (typer's ``CliRunner``, as the
tests and a notebook run it): every handler it set is put back when it returns."""

import signal

import pytest
from typer.testing import CliRunner

from probe.app.cli import app
from probe.app.signals import STARTING, commanded, stopping

runner = CliRunner()


def _handlers() -> dict:
    return {stop: signal.getsignal(stop) for stop in STARTING}


def _mine(signum, frame) -> None:  # a caller's own handler, which must be there afterwards
    """A handler of the process that runs the command."""


@pytest.mark.parametrize(
    "args",
    [
        ["report", "/no/such/folder"],  # fails in one line
        ["analyze", "-m", "minilm", "-a", "taxonmy", "-o", "/tmp/never-written"],  # plan-time
        ["--version"],  # eager: no command runs
    ],
)
def test_a_command_leaves_the_handlers_as_they_were(args):
    before = _handlers()
    result = runner.invoke(app, args)
    assert result.exit_code in (0, 1), result.output
    assert _handlers() == before


def test_a_report_rendered_in_process_leaves_a_caller_s_handlers(tiny_report):
    previous = {stop: signal.signal(stop, _mine) for stop in STARTING}
    try:
        result = runner.invoke(app, ["report", str(tiny_report)])
        assert result.exit_code == 0, result.output
        assert _handlers() == dict.fromkeys(STARTING, _mine)
    finally:
        for stop, handler in previous.items():
            signal.signal(stop, handler)


def test_an_ignored_signal_stays_ignored_and_the_others_come_back():
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup leaves it
    try:
        before = _handlers()
        with commanded():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in (before[signal.SIGTERM], None)
            stopping()  # the command answers a signal: the next ones are ignored...
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN  # ...this one still so
        assert _handlers() == before
    finally:
        signal.signal(signal.SIGHUP, previous)
