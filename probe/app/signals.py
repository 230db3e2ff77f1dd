"""How the ``probe`` command answers a signal: in one line, with the shell's status (128 + the
signal's number), never with a traceback or a half-written output. While the command starts
(Python imports typer, the analyses' registry and what the command needs, about a second) a
signal ends it at once (``answer_start``, nothing has been written then); once the command
begins (``commanded``), SIGINT raises ``KeyboardInterrupt`` and SIGTERM and SIGHUP raise
``TerminatedError`` (``catch_hangups``), which unwind it. A second signal while it unwinds is
ignored (``stopping``): the command is already ending, and says so in one line. When the command
returns, every handler it set is put back as it was (``commanded``), so that a command run in a
process that goes on (typer's ``CliRunner``, a notebook) leaves no handler of its own behind. A
signal ignored when the command began (nohup's SIGHUP, a background shell's SIGINT) stays ignored.

It imports nothing but the standard library: ``probe.app.start`` installs its first answers
before anything else is imported.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

STARTING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class TerminatedError(BaseException):
    """SIGTERM arrived (a cancelled job, or torchrun stopping the run after a process failed):
    raised so that the run unwinds and leaves no half-written report behind. Not an
    ``Exception``, as ``KeyboardInterrupt`` is not: a library's ``except Exception`` around the
    line it arrives on (transformers has many) would swallow it, and the run would go on."""


def _again(signum, frame) -> None:
    """A signal while the command already unwinds from one (two Ctrl-Cs 20 ms apart): ignored,
    as the first one's answer is under way; the command ends in a moment."""


def _main_thread() -> bool:
    # Python sets handlers only from the main thread; a command run from another (a notebook's
    # worker) leaves the signals to its process.
    return threading.current_thread() is threading.main_thread()


def stopping() -> None:
    """From here, a further SIGINT, SIGTERM or SIGHUP is ignored (``_again``): the command
    unwinds or prints its last line whole. A signal ignored (``SIG_IGN``) stays so."""
    if not _main_thread():
        return
    for stop in STARTING:
        if signal.getsignal(stop) is not signal.SIG_IGN:
            signal.signal(stop, _again)


def interrupted(signum, frame) -> None:
    """Ctrl-C: unwind the command with ``KeyboardInterrupt``, the next signals ignored."""
    stopping()
    raise KeyboardInterrupt


def terminated(signum, frame) -> None:
    """SIGTERM or SIGHUP: unwind the command with ``TerminatedError``, the next ignored."""
    stopping()
    raise TerminatedError(signal.Signals(signum).name)


def catch_hangups() -> None:
    """SIGTERM and SIGHUP (a closed terminal, a dropped ssh) unwind the command like an error,
    so that no staging folder or lock is left beside the output. One ignored stays ignored (a
    run under nohup must outlive its terminal), and one already answered stays answered."""
    if not _main_thread():
        return
    for stop in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(stop) not in (signal.SIG_IGN, _again):
            signal.signal(stop, terminated)


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
    SIGHUP raise ``TerminatedError``; a signal ignored when the command began stays ignored."""
    if not _main_thread():
        return
    for stop in STARTING:
        if signal.getsignal(stop) is not signal.SIG_IGN:
            signal.signal(stop, interrupted if stop == signal.SIGINT else terminated)


@contextlib.contextmanager
def commanded() -> Iterator[None]:
    """A command's answers to signals (``hand_over``) while it runs; when it returns, or fails,
    the handlers as they were before it. Where they were the start's (``answer_start``: the
    installed command, whose process ends with it), a signal from here is ignored instead: the
    command has answered, and its process ends in a moment (a start's answer would wrongly say
    "while starting")."""
    if not _main_thread():
        yield
        return
    before = {stop: signal.getsignal(stop) for stop in STARTING}
    hand_over()
    try:
        yield
    finally:
        for stop, handler in before.items():
            if handler is _starting:
                handler = signal.SIG_IGN if signal.getsignal(stop) is signal.SIG_IGN else _again
            # None: a handler set outside Python; the default is the closest we can put back.
            signal.signal(stop, signal.SIG_DFL if handler is None else handler)
