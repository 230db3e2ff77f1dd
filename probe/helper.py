"""A helper process for the work a run does after its batches: scikit-learn's fits.

The fits need every batch, so they come at the end; importing scikit-learn for them would cost
the run about 0.8 s more there, on one core, and a first fit on large data about 0.2 s more
than the next. Torch's import, at the start of the run, also runs on one core. So
``probe analyze`` forks a helper (``start``) before torch is imported: on the core that torch's
import leaves idle, it imports what the analyses will need and runs each once, small; then it
waits, taking no CPU while the batches run. At the end the analyses hand it their fits
(``call``).

Without a helper (in a notebook, a test, under torchrun's other processes, or once torch is
imported and so nothing is left to overlap), or when it has died, ``call`` does the work in
this process: the same function on the same arguments, so the same result. The helper
runs nothing but pure functions of their arguments, and writes nothing.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing
import pickle
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from contextlib import suppress
from multiprocessing.connection import Connection
from typing import Any, TypeVar

T = TypeVar("T")

_connection: Connection | None = None  # to the helper, while it lives
_exchange = threading.Lock()  # one request and its answer at a time on the pipe


def start(warmups: Iterable[str]) -> bool:
    """Fork the helper, which runs each of ``warmups`` (``"module:function"``, called with no
    arguments) and then waits for work.

    A warm-up imports what the work it stands for needs and runs it once on a small input, so
    that the first real call pays no first-call costs (a first fit on large data runs about 0.2 s
    slower than the next).

    Does nothing when a helper is running, when torch is already imported (a fork of a process
    whose torch has started threads is unsafe, and there is no import left to overlap), or where
    processes cannot be forked.

    Returns
    -------
    bool
        Whether a helper now runs.
    """
    global _connection
    if _connection is not None:
        return True
    if "torch" in sys.modules or "fork" not in multiprocessing.get_all_start_methods():
        return False
    ours, theirs = multiprocessing.Pipe()
    process = multiprocessing.get_context("fork").Process(
        target=_serve, args=(theirs, ours, tuple(warmups)), daemon=True
    )
    process.start()
    theirs.close()
    _connection = ours
    atexit.register(_stop, process)  # before multiprocessing's own, which waits for it
    return True


def _stop(process: multiprocessing.process.BaseProcess) -> None:
    """End the helper, whatever it is doing: it holds nothing that needs cleaning up."""
    process.kill()
    process.join()


def _serve(connection: Connection, parents: Connection, warmups: tuple[str, ...]) -> None:
    """The helper's life: warm up, then answer each ``(function, args)`` with ``(done, value)``
    until the parent's end of the pipe closes (it exits, or is killed)."""
    parents.close()  # the fork's copy of it, which would keep the pipe open
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the parent answers
    for stop in (signal.SIGTERM, signal.SIGHUP):  # ignored, perhaps, by whoever started the run
        signal.signal(stop, signal.SIG_DFL)
    for warmup in dict.fromkeys(warmups):
        module, _, function = warmup.partition(":")
        with suppress(Exception):  # a failed warm-up only leaves its first-call costs
            getattr(importlib.import_module(module), function)()
    while True:
        try:
            request = connection.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            function, args = pickle.loads(request)
            answer = pickle.dumps((True, function(*args)))
        except Exception:  # the parent does the work again, and raises it there
            answer = pickle.dumps((False, None))
        try:
            connection.send_bytes(answer)
        except OSError:  # the parent has gone, or stopped listening
            return


def call(function: Callable[..., T], *args: Any) -> T:
    """``function(*args)``, computed in the helper process if there is one, else here.

    ``function`` should be a module-level function (it is sent by name) whose value depends on
    its arguments alone and can be pickled. If it cannot be sent, if the helper has died, or if
    ``function`` fails in it, it runs here: the same value, or its exception raised here.
    """
    global _connection
    with _exchange:
        request = None
        if _connection is not None:
            with suppress(Exception):  # what cannot be sent (a lambda, say) is done here
                request = pickle.dumps((function, args))
        if request is not None:
            try:
                _connection.send_bytes(request)
                done, value = pickle.loads(_connection.recv_bytes())
            except (EOFError, OSError):  # the helper has died
                _connection.close()
                _connection = None
            except BaseException:  # an interrupt mid-exchange: the pipe may hold a stale answer
                _connection.close()
                _connection = None
                raise
            else:
                if done:
                    return value
    return function(*args)
