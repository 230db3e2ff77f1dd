"""A helper process for the work a run does after its batches: scikit-learn's fits, and
writing the report's files.

The fits need every batch, so they come at the end; importing scikit-learn for them would cost
the run about 0.8 s more there, on one core, and a first fit on large data about 0.2 s more
than the next. Torch's import, at the start of the run, also runs on one core. So
``probe analyze`` forks a helper (``start``) before torch is imported: on the core that torch's
import leaves idle, it imports what the analyses will need and runs each once, small (and
compiles the report's templates, ``probe.app.page``); then it waits, taking no CPU while the
batches run. At the end the analyses hand it their fits (``submit``), the run hands it the
tables to write, and it does each in turn while the run finishes the other analyses and the
page.

Without a helper (in a notebook, a test, under torchrun's other processes, or once torch is
imported and so nothing is left to overlap), or when it has died, the work is done in this
process: the same function on the same arguments, so the same result. The helper runs nothing
but functions of their arguments: pure ones, and the writes of files the run names.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing
import pickle
import queue
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from multiprocessing.connection import Connection
from typing import Any, Generic, TypeVar

T = TypeVar("T")

_connection: Connection | None = None  # to the helper, while it lives
_process: multiprocessing.process.BaseProcess | None = None  # the helper, while it lives
# The helper is given up when its CPU time has not grown for this long while the run waits on
# it; where its CPU time cannot be read (no /proc), when it has not answered in UNMEASURED_S.
STALL_S = 60.0
UNMEASURED_S = 1800.0
# Seconds to wait for a helper that was sent SIGKILL to be gone, before its work is redone here
# (a process in the middle of a write to a slow disk dies once that write returns).
REAPED_S = 10.0
_exchange = threading.Lock()  # held while the pipe is written or read


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
    global _connection, _process
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
    _connection, _process = ours, process
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
    with suppress(ImportError):  # one core: the run's threads keep the others while it works
        from threadpoolctl import threadpool_limits

        threadpool_limits(1)
    # A thread reads the work as it comes, so that the run never waits to send work while the
    # helper is busy with earlier work: it queues it and goes on.
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read, args=(connection, inbox), daemon=True).start()
    while (message := inbox.get()) is not None:
        head, buffers = message
        try:
            function, args = pickle.loads(head, buffers=buffers)
            answer = _pickled((True, function(*args)))
        except Exception:  # the parent does the work again, and raises it there
            answer = _pickled((False, None))
        try:
            _send(connection, answer)
        except OSError:  # the parent has gone, or stopped listening
            return


def _read(connection: Connection, inbox: queue.SimpleQueue) -> None:
    """Put each message the parent sends in ``inbox``, then None once its end of the pipe
    closes."""
    while True:
        try:
            inbox.put(_receive_message(connection))
        except (EOFError, OSError):
            inbox.put(None)
            return


Message = tuple[list[int], bytes, list[memoryview]]


def _pickled(obj: Any) -> Message:
    """``obj`` pickled, with the memory of its arrays left where it is (pickle's protocol 5),
    so that sending it copies nothing more: the probe's sample is 33 MB on EWT dev."""
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    raw = [buffer.raw() for buffer in buffers]
    return [r.nbytes for r in raw], head, raw


def _send(connection: Connection, message: Message) -> None:
    sizes, head, raw = message
    connection.send_bytes(pickle.dumps(sizes))
    connection.send_bytes(head)
    for r in raw:
        connection.send_bytes(r)


def _receive_message(connection: Connection) -> tuple[bytes, list[bytearray]]:
    """What ``_send`` sent: the pickle and its buffers, writable as the sender's arrays were."""
    sizes = pickle.loads(connection.recv_bytes())
    head = connection.recv_bytes()
    buffers = [bytearray(size) for size in sizes]
    for buffer in buffers:
        connection.recv_bytes_into(buffer)
    return head, buffers


class Pending(Generic[T]):
    """The value of ``function(*args)``, handed to the helper by ``submit``: ``result()`` waits
    for it, or computes it here when the helper could not (see ``call``)."""

    def __init__(self, function: Callable[..., T], args: tuple) -> None:
        self._function, self._args = function, args
        self._answer: tuple[bool, Any] = (False, None)  # (done, value): not done is done here

    def result(self) -> T:
        """The value: from the helper, once it answers, or computed here."""
        with _exchange:
            while self in _waiting:  # answers come in the order the work was sent
                _receive()
        if not self._answer[0]:
            self._answer = (True, self._function(*self._args))
        self._args = ()  # the value is kept, what it came from need not be
        return self._answer[1]


_waiting: deque[Pending] = deque()  # sent to the helper, their answers not yet read


def submit(function: Callable[..., T], *args: Any) -> Pending[T]:
    """Hand ``function(*args)`` to the helper process and return at once, so that it is computed
    there while the run goes on; ``Pending.result()`` gives its value.

    The conditions on ``function`` are ``call``'s. The helper does the work in the order it was
    submitted, one piece at a time; a piece submitted while earlier ones are out is queued
    there, and the run goes on. While it works, the run leaves it a core: torch's threads here
    are one fewer, since a parallel op whose thread shares a core with the helper stalls until
    the scheduler gives that thread its turn.
    """
    pending = Pending(function, args)
    with _exchange:
        message = None
        if _connection is not None:
            with suppress(Exception):  # what cannot be sent (a lambda, say) is done here
                message = _pickled((function, args))
        if message is not None:
            try:
                with _watched():  # a message larger than the pipe waits for the helper to read
                    _send(_connection, message)
            except OSError:  # the helper has died (or was given up)
                _let_go(_ended())
            except BaseException:  # an interrupt mid-message: the helper would misread the next
                _let_go()
                raise
            else:
                _waiting.append(pending)
                _leave_a_core(True)
    return pending


def call(function: Callable[..., T], *args: Any) -> T:
    """``function(*args)``, computed in the helper process if there is one, else here.

    ``function`` should be a module-level function (it is sent by name) whose value depends on
    its arguments alone and can be pickled. If it cannot be sent, if the helper has died, or if
    ``function`` fails in it, it runs here: the same value, or its exception raised here.
    """
    return submit(function, *args).result()


def _receive() -> None:
    """Read the answer to the oldest work out (the caller holds ``_exchange``)."""
    pending = _waiting[0]
    try:
        with _watched():
            head, buffers = _receive_message(_connection)
    except (EOFError, OSError):  # the helper has died (or was given up): the work is done here
        _let_go(_ended())
    except BaseException:  # an interrupt mid-exchange: the pipe may hold a stale answer
        _let_go()
        raise
    else:
        with suppress(Exception):  # an answer this process cannot read: the work is done here
            pending._answer = pickle.loads(head, buffers=buffers)
        _waiting.popleft()
        if not _waiting:
            _leave_a_core(False)


def poll() -> None:
    """Read the answers the helper has sent already, without waiting for any other: once its
    work is done, the run takes back the core it left it (``_leave_a_core``) between the steps
    of a long computation of its own, not at the next ``result()`` after it."""
    with _exchange:
        while _waiting and _connection is not None and _connection.poll():
            _receive()


def _let_go(why: str | None = None) -> None:
    """Stop using the helper: the work out and later work are done in this process. The helper
    is ended, and gone before this returns (within ``REAPED_S``), so that no write of its own
    lands after the run has redone it. ``why`` it was let go, where it failed, goes to stderr."""
    global _connection, _process
    _connection.close()
    _connection = None
    if _process is not None:  # a helper let go mid-exchange may still be working: end it
        with suppress(Exception):
            _process.kill()
            _process.join(REAPED_S)
        _process = None
    _waiting.clear()
    _leave_a_core(False)
    if why:
        with suppress(Exception):  # a closed stderr: the run goes on all the same
            print(f"probe: {why}; the run does its work itself", file=sys.stderr, flush=True)


def abandon() -> None:
    """End the helper now, whatever it is doing, and do later work in this process: for a run
    that fails, so that nothing the helper was writing lands in a folder being removed."""
    with _exchange:
        if _connection is not None:
            _let_go()


_stalled: list[str] = []  # why the watchdog ended the helper, once it has


def _ended() -> str:
    """Why the helper's pipe closed: the watchdog ended it, or it died (killed, out of memory)."""
    return _stalled.pop() if _stalled else "the helper process ended unexpectedly (killed?)"


@contextmanager
def _watched() -> Iterator[None]:
    """Kill the helper if it makes no progress while the block exchanges with it, so that a
    send or receive blocked on a stalled helper ends (in ``EOFError`` or ``OSError``)."""
    process = _process
    if process is None or process.pid is None:
        yield
        return
    done = threading.Event()
    watchdog = threading.Thread(target=_watch, args=(process, done), daemon=True)
    watchdog.start()
    try:
        yield
    finally:
        done.set()
        watchdog.join()


def _watch(process: multiprocessing.process.BaseProcess, done: threading.Event) -> None:
    """Until ``done``: kill ``process`` once its CPU time has not grown for ``STALL_S`` (or,
    where it cannot be read, once ``UNMEASURED_S`` have passed)."""
    last, since = _cpu_ticks(process.pid), time.monotonic()
    started = since
    while not done.wait(min(1.0, STALL_S / 4)):
        now, ticks = time.monotonic(), _cpu_ticks(process.pid)
        if ticks is None:
            stalled = now - started >= UNMEASURED_S
        else:
            if ticks != last:
                last, since = ticks, now
            stalled = now - since >= STALL_S
        if stalled:
            waited = UNMEASURED_S if ticks is None else STALL_S
            _stalled[:] = [f"the helper process made no progress for {waited:g} s (stopped?) "
                           "and was ended"]  # fmt: skip
            with suppress(Exception):
                process.kill()  # SIGKILL ends a stopped process too; its pipe end closes
            return


def _cpu_ticks(pid: int) -> int | None:
    """The CPU time ``pid`` has used (user + system, in clock ticks), or None where it cannot be
    read (no /proc, or the process has gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    if fields[0] in (b"Z", b"X"):  # ended: its pipe closes, or has closed
        return None
    return int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat(5)


_lent: int | None = None  # torch's thread count before a core was left to the helper


def _leave_a_core(busy: bool) -> None:
    """One torch thread fewer here while the helper is ``busy`` (see ``submit``), as many as
    before once it is not."""
    global _lent
    torch = sys.modules.get("torch")
    if torch is None:
        return
    if busy and _lent is None and torch.get_num_threads() > 1:
        _lent = torch.get_num_threads()
        torch.set_num_threads(_lent - 1)
    elif not busy and _lent is not None:
        torch.set_num_threads(_lent)
        _lent = None
