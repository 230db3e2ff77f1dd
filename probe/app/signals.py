"""How the ``probe`` command answers a signal: in one line, with the shell's status (128 + the
signal's number), never with a traceback or a half-written output. While the command starts
(Python imports typer, the analyses' registry and what the command needs, about a second) a
signal ends it at once (``answer_start``, nothing has been written then); once the command
begins (``hand_over``), SIGINT raises ``KeyboardInterrupt`` and SIGTERM and SIGHUP raise
``TerminatedError`` (``catch_hangups``), which unwind it.

It imports nothing but the standard library: ``probe.app.start`` installs its first answers
before anything else is imported.
"""

from __future__ import annotations

import os
import signal

STARTING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class TerminatedError(BaseException):
    """SIGTERM arrived (a cancelled job, or torchrun stopping the run after a process failed):
    raised so that the run unwinds and leaves no half-written report behind. Not an
    ``Exception``, as ``KeyboardInterrupt`` is not: a library's ``except Exception`` around the
    line it arrives on (transformers has many) would swallow it, and the run would go on."""


def terminated(signum, frame) -> None:
    raise TerminatedError(signal.Signals(signum).name)


def catch_hangups() -> None:
    """SIGTERM and SIGHUP (a closed terminal, a dropped ssh) unwind the command like an error,
    so that no staging folder or lock is left beside the output."""
    signal.signal(signal.SIGTERM, terminated)
    signal.signal(signal.SIGHUP, terminated)


def signal_name(stop: BaseException) -> str:
    """The signal that stopped a command, for its message: ``SIGINT (Ctrl-C)``, ``SIGTERM``…"""
    return "SIGINT (Ctrl-C)" if isinstance(stop, KeyboardInterrupt) else str(stop)


def exit_status(stop: BaseException) -> int:
    """The exit status of a command a signal stopped, as a shell gives it: 128 + the signal's
    number (Ctrl-C 130, SIGTERM 143, SIGHUP 129)."""
    if isinstance(stop, KeyboardInterrupt):
        return 128 + signal.SIGINT
    return 128 + signal.Signals[str(stop)]


def _starting(signum: int, frame) -> None:
    said = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    os.write(2, f"error: {said} while starting; nothing was written\n".encode())
    os._exit(128 + signum)


def answer_start() -> None:
    """A signal that arrives while the command starts ends it in one line; a signal ignored when
    the process started (nohup's, a background shell's) stays ignored."""
    for stop in STARTING:
        if signal.getsignal(stop) is not signal.SIG_IGN:
            signal.signal(stop, _starting)


def hand_over() -> None:
    """The command's own answers from here: SIGINT raises ``KeyboardInterrupt``, SIGTERM and
    SIGHUP raise ``TerminatedError``; a signal ignored when the process started stays ignored."""
    for stop in STARTING:
        if signal.getsignal(stop) is _starting:
            signal.signal(stop, signal.default_int_handler if stop == signal.SIGINT else terminated)
