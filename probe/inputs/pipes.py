"""A treebank given as a pipe (a FIFO, or a shell's ``<(zcat x.conllu.gz)``) is read once.

A run reads its treebank more than once (a count for the progress bar, then the analysis), and a
pipe gives its bytes only once. So the pipe is copied, as it is read and in chunks (memory stays
flat), into a temporary file of probe's, and every later read of the pipe's name reads that copy:
the same bytes, so the same results as the same treebank given as a file. Messages, the run card
and the sentences' sources still name the pipe.

The copy never outlives the process. Where a process can reopen its own open files
(``/proc/self/fd``, Linux), the copy is unlinked as soon as it is made: it has no name, and the
system frees it however the process ends, SIGKILL included. Elsewhere it is removed at exit (the
command line turns SIGTERM and SIGHUP into an exit), and in any case when the run that read it
ends (``forget_copies``).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterable
from contextlib import suppress
from pathlib import Path
from typing import BinaryIO

from probe.distributed import Ranks
from probe.errors import ProbeError

CHUNK = 1 << 20
SELF_FD = "/proc/self/fd/{}"  # this process's open files, each reopened by its number
_copies: dict[Path, tuple[Path, BinaryIO]] = {}  # the pipe, as named -> its copy, kept open


def is_pipe(path: Path) -> bool:
    """Whether ``path`` is a pipe (a FIFO, ``/dev/fd/63`` from ``<(...)``, ``/dev/stdin`` fed by
    one)."""
    return path.is_fifo()


def read_from(path: Path) -> Path:
    """Where the bytes of ``path`` are read: its copy for a pipe copied, else itself."""
    copy = _copies.get(Path(path))
    return path if copy is None else copy[0]


def copy_pipe(path: Path) -> Path:
    """Read the pipe ``path`` to its end, once, into a temporary file of probe's (a second call
    for the same pipe gives the same copy). ``read_from(path)`` is then that copy.

    Raises
    ------
    ProbeError
        When the pipe cannot be read, or the copy cannot be written (a full disk: ``TMPDIR``
        names where it goes), or under torchrun (several processes cannot share one pipe).
    """
    path = Path(path)
    if path in _copies:
        return path
    processes = Ranks.from_environment().size
    if processes > 1:  # each would read a part of it, and none the whole
        raise ProbeError(f"treebank {path} is a pipe, which only one of the run's {processes} "
                         "processes could read; under torchrun give a file")  # fmt: skip
    try:
        fd, name = tempfile.mkstemp(prefix="probe-pipe-")
    except OSError as e:
        raise ProbeError(_cannot_copy(path, e)) from None
    copy = Path(SELF_FD.format(fd))
    if copy.exists():
        os.unlink(name)  # nameless from now on: gone with the process, however it ends
    else:
        copy = Path(name)
        atexit.register(forget, path)
    file = os.fdopen(fd, "wb")
    _copies[path] = (copy, file)
    try:
        with open(path, "rb") as source:
            _copy(source, file, path)
    except BaseException:
        forget(path)
        raise
    return path


def _copy(source: BinaryIO, file: BinaryIO, path: Path) -> None:
    try:
        shutil.copyfileobj(source, _Checked(file, path), CHUNK)
        file.flush()
    except OSError as e:
        raise ProbeError(f"cannot read treebank {path} (a pipe): {e.strerror or e}") from None


class _Checked:
    """``file``'s writes, a full disk said as such (not as a pipe that could not be read)."""

    def __init__(self, file: BinaryIO, path: Path) -> None:
        self.file, self.path = file, path

    def write(self, chunk: bytes) -> None:
        try:
            self.file.write(chunk)
        except OSError as e:
            raise ProbeError(_cannot_copy(self.path, e)) from None


def _cannot_copy(path: Path, error: OSError) -> str:
    return (f"cannot copy treebank {path} (a pipe, read once) into {tempfile.gettempdir()} "
            f"({error.strerror}); set TMPDIR to a writable folder with room, or save the "
            "treebank to a file")  # fmt: skip


def forget_copies(paths: Iterable[Path]) -> None:
    """Drop the copies of those of ``paths`` that are pipes: a run forgets its own when it ends,
    so that a later run in the same process, given a new pipe of the same name (``/dev/fd/63``
    again), reads that pipe, not this copy."""
    for path in paths:
        forget(path)


def forget(path: Path) -> None:
    """Drop the copy of the pipe ``path`` (its space is freed now)."""
    copy, file = _copies.pop(Path(path), (None, None))
    if file is None:
        return
    named = copy != Path(SELF_FD.format(file.fileno()))
    with suppress(OSError):
        file.close()
        if named:
            copy.unlink()
