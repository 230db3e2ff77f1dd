"""The ``probe`` command's first lines: a signal that arrives while the command starts (Python
imports typer, the analyses' registry and what the command needs, about a second) ends it in
one line with the shell's status (128 + the signal's number), as one that arrives later does,
instead of a traceback from the middle of an import or a silent end. Nothing has been written
then. The command's own answer to a signal takes over when it begins (``hand_over``).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

STARTING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _starting(signum: int, frame) -> None:
    said = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    os.write(2, f"error: {said} while starting; nothing was written\n".encode())
    os._exit(128 + signum)


def hand_over(terminated: Callable) -> None:
    """The command's own answers from here: SIGINT raises ``KeyboardInterrupt``, SIGTERM and
    SIGHUP call ``terminated``; a signal ignored when the process started stays ignored."""
    for stop in STARTING:
        if signal.getsignal(stop) is _starting:
            signal.signal(stop, signal.default_int_handler if stop == signal.SIGINT else terminated)


def command() -> None:
    """The installed ``probe`` command: ``probe.app.cli.command``, started as above."""
    for stop in STARTING:
        if signal.getsignal(stop) is not signal.SIG_IGN:  # nohup's, a background shell's
            signal.signal(stop, _starting)
    from probe.app.cli import command as run

    run()
