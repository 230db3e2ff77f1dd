"""The output folder of a run: checked and reserved before any compute, written whole or not at
all, and never anything but probe's own report replaced.

A run reserves ``out`` by locking ``.<name>.probe-lock`` beside it (``flock``: released by the
system even if the process is killed), so that a second run to the same place fails at once.
The lock file names its holder: a command that holds it for seconds (figures, report, compare)
is waited for, up to ``LOCK_WAIT_S`` and saying so, rather than a run's work thrown away.
The report is written into a staging folder beside ``out``, marked as probe's with
``.probe-report``, and moved into place in one step: a rename, or with ``--overwrite`` an atomic
exchange with the old report (Linux ``renameat2``), after which the old one is removed. A
failure, a signal or a crash leaves the old report, or none, and no staging folder once the next
run has reserved the place; a run that fails ends its helper process (``probe.pipeline.helper``)
before it removes the staging folder, so that none of the helper's writes lands in it after.

Every file probe writes goes through ``write_file`` (``probe.files``): a temporary file in the
same folder, then a rename. ``locked`` takes the lock a run takes, so that ``probe report`` cannot
write into a report that ``analyze --overwrite`` is replacing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path

from probe.errors import ProbeError
from probe.files import WriteError, write_file
from probe.pipeline import helper

__all__ = ["WriteError", "write_file"]  # the writer of every file, here beside the folders it fills

MARKER = ".probe-report"  # in every folder probe writes: what --overwrite may replace
# What each command writes, named in its marker: --overwrite replaces only a folder of the same
# kind, so that `probe figures R --out R --overwrite` cannot replace the report R with figures.
KINDS = {"report": "a report (probe analyze)", "figures": "figures (probe figures)",
         "comparison": "a comparison (probe compare)",
         "experiment": "an experiment's report (probe experiment)",
         "timeline": "a timeline (probe timeline)"}  # fmt: skip
FIGURE_FILES = (".pdf", ".svg", ".png")
BRIEF = ("figures", "comparison")  # the kinds a command writes in seconds, from tables alone
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2  # renameat2's flags, from linux/fs.h
AT_FDCWD = -100
# The longest name beside ``out`` that a run makes: ``.<name>.probe-<pid>-<monotonic ns>``.
PREFIX_LENGTH = len(".") + len(".probe-") + 7 + 1 + 20
NAME_MAX = 255
# A command that finds a folder's lock held by one that holds it for seconds (figures, report,
# compare: ``brief``) waits up to this long for it, and says so, rather than throw away what it
# has done; one held by a run (analyze, experiment: minutes) is refused at once.
LOCK_WAIT_S = 60.0
LOCK_POLL_S = 0.1


def refuse_inputs(out: Path, inputs: Sequence[Path], option: str = "--out") -> None:
    """Fail when ``out`` is, holds or lies inside one of the command's inputs: replacing it
    would delete what the command reads.

    Raises
    ------
    ProbeError
        Naming the input.
    """
    target = out.resolve()
    for given in inputs:
        source = Path(given).resolve()
        if target == source or target in source.parents:
            raise ProbeError(
                f"{option} {out} {'is' if target == source else 'holds'} an input of this "
                f"command ({given}); replacing it would destroy it: choose another {option}"
            )


@contextmanager
def locked(*folders: Path, reading: bool = False) -> Iterator[None]:
    """Hold the lock a run to each folder holds (``analyze``, ``compare``), for a command that
    reads the folders (``reading``) or rewrites a file inside them.

    Raises
    ------
    ProbeError
        When a run is writing one of the folders, or (unless only ``reading``: a report in a
        read-only place is read unlocked, as no one can replace it) the lock cannot be made.
    """
    unique = {Path(f).resolve(): Path(f).resolve() for f in folders}  # one lock per folder
    with ExitStack() as stack:
        for folder in unique.values():
            lock = folder.absolute().parent / f".{folder.name}.probe-lock"
            try:
                stack.enter_context(_locked(lock, folder, brief=True))
            except _UnlockableError:
                if not reading:
                    raise
        yield


def slug(name: str) -> str:
    """A folder name for a model id or path (``google-bert/bert-base-uncased`` -> its last part)."""
    last = Path(name.rstrip("/")).name or name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", last).strip("-.") or "model"


def default_out(
    model: str,
    treebank: Sequence[str] | None = None,
    corpus: str | None = None,
    analyses: Sequence[str] | None = None,
) -> Path:
    """``reports/<model>`` for the default inputs and analyses; each input or choice that is not
    the default adds its name, so that runs that differ in them do not collide:
    ``minilm-sample`` (a treebank), ``minilm-notes.jsonl`` (a corpus), ``minilm-taxonomy``
    (analyses named with ``--analyses``, joined by ``+``)."""
    names = [slug(model)]
    names += [slug(str(t).removeprefix("ud:").removesuffix(".gz").removesuffix(".conllu"))
              for t in treebank or ()]  # fmt: skip
    if corpus:
        names.append(slug(corpus.removeprefix("hf:").replace(":", "-").replace("@", "-")))
    if analyses:
        names.append("+".join(slug(a) for a in analyses))
    return Path("reports") / "-".join(names)


def is_report(folder: Path, kind: str | None = None) -> bool:
    """Whether ``folder`` is a folder probe wrote (it holds the marker), and of ``kind`` if
    given."""
    if not (folder.is_dir() and not folder.is_symlink() and (folder / MARKER).is_file()):
        return False
    return kind is None or kind_of(folder) == kind


def kind_of(folder: Path) -> str | None:
    """What probe wrote into ``folder``: its marker's ``kind``; for a folder written before the
    kind was recorded, told by the files that only that command writes; None if unknown."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    kind = marker.get("kind") if isinstance(marker, dict) else None
    if kind is not None:
        return kind if kind in KINDS else None
    if (folder / "compare.json").is_file():
        return "comparison"
    if (folder / "run.json").is_file():
        try:
            card = json.loads((folder / "run.json").read_text())
        except (OSError, ValueError, UnicodeDecodeError):
            return None
        return "experiment" if isinstance(card, dict) and "experiment" in card else "report"
    files = [p for p in folder.iterdir() if p.name != MARKER]
    if files and all(p.is_file() and p.suffix in FIGURE_FILES for p in files):
        return "figures"
    return None


def check_free(out: Path, overwrite: bool, kind: str = "report") -> None:
    """Fail now, before any compute, if the folder of ``kind`` (``KINDS``) could not be
    written to ``out``.

    Raises
    ------
    ProbeError
        If ``out`` is a link or a file, exists without ``--overwrite``, is not a folder of
        ``kind`` that probe wrote, holds the current folder, or cannot be created.
    """
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is none of {', '.join(KINDS)}")
    if out.name == "..":
        raise ProbeError(f"--out {out} ends in '..', which names no new folder; give the folder's "
                         "own name, e.g. reports/mine")  # fmt: skip
    if len(os.fsencode(out.name)) + PREFIX_LENGTH > NAME_MAX:
        raise ProbeError(
            f"--out name {out.name[:40]}… is too long ({len(os.fsencode(out.name))} bytes; probe "
            f"needs {PREFIX_LENGTH} more for its lock beside it, and a name holds {NAME_MAX}): "
            "choose a shorter name"
        )
    if out.is_symlink():
        raise ProbeError(f"output folder {out} is a symbolic link; give the folder itself")
    if out.exists():
        if not out.is_dir():
            raise ProbeError(f"--out {out} is a file; give a folder")
        if not overwrite:
            raise ProbeError(
                f"output folder {out} already exists; use --overwrite or another --out"
            )
        if not is_report(out):
            raise ProbeError(
                f"{out} is not a probe report (no {MARKER} in it): --overwrite replaces only "
                "reports probe wrote; choose another --out"
            )
        found = kind_of(out)
        if found != kind:
            what = KINDS[found] if found else "a folder of unknown kind"
            raise ProbeError(
                f"{out} holds {what}, not {KINDS[kind]}: --overwrite replaces only what the "
                "same command wrote; choose another --out"
            )
        here = Path.cwd().resolve()
        if out.resolve() == here or out.resolve() in here.parents:
            raise ProbeError(f"--out {out} holds the current folder; run from elsewhere")
    ancestor = out.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ProbeError(f"cannot create {out}: {ancestor} is a file")
    try:  # try it: permissions alone do not tell (root, read-only mounts, /proc)
        fd, probe_file = tempfile.mkstemp(prefix=".probe-check-", dir=ancestor)
        os.close(fd)
        os.unlink(probe_file)
    except OSError as e:
        raise ProbeError(
            f"cannot create {out}: {ancestor} is not writable ({e.strerror})"
        ) from None


@contextmanager
def reserved(out: Path, overwrite: bool, kind: str = "report") -> Iterator[Path]:
    """Reserve ``out`` for the body, which writes the report into the folder yielded; when the
    body completes the report takes ``out``'s place at once, and otherwise nothing changes.

    Raises
    ------
    ProbeError
        As ``check_free``; or when another run is writing to ``out``; or when ``out`` was taken
        by something else while the body ran.
    """
    check_free(out, overwrite, kind)
    parent = out.absolute().parent
    created = _make_parents(parent)
    staging, published = None, False
    try:
        with _locked(parent / f".{out.name}.probe-lock", out, brief=kind in BRIEF):
            _clean_up_after_killed_runs(parent, out)
            staging = parent / f".{out.name}.probe-{os.getpid()}-{time.monotonic_ns()}"
            staging.mkdir()  # the user's umask applies, as to any folder they make
            try:
                yield staging
                _remove_temporaries(staging)
                marker = {"probe": _version(), "kind": kind,
                          "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")}  # fmt: skip
                write_file(staging / MARKER, json.dumps(marker))
            except WriteError as e:  # name the report, not the staging folder
                raise ProbeError(f"cannot write {out / e.path.name} ({e.reason}); nothing was "
                                 "replaced") from None  # fmt: skip
            _publish(staging, out, overwrite, kind)
            published = True
    finally:
        if not published:  # the helper may be writing a table into the staging folder: a file
            helper.abandon()  # it made while rmtree ran would leave the folder behind
        if staging is not None and staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
        if not published:
            for folder in reversed(created):  # only what this run made, and only if empty
                with suppress(OSError):
                    folder.rmdir()


def _remove_temporaries(staging: Path) -> None:
    """Remove what a writer killed mid-write left in the finished folder (a helper process's
    ``write_file``, whose file the run then wrote itself): every write the body asked for is
    done, so a temporary file left is no one's."""
    for left in staging.rglob(".probe-tmp-*"):
        if left.is_file() or left.is_symlink():
            left.unlink()


def _publish(staging: Path, out: Path, overwrite: bool, kind: str) -> None:
    """Move the finished folder into place: never over something that is not probe's folder of
    the same kind."""
    if out.is_symlink() or (out.exists() and not (overwrite and is_report(out, kind))):
        raise ProbeError(f"{out} was created by something else while probe ran; nothing replaced")
    if out.exists():
        if _renameat2(staging, out, RENAME_EXCHANGE):
            return  # the old report is now at `staging`, which the caller removes
        old = out.with_name(f".{out.name}.probe-old-{os.getpid()}")
        out.rename(old)  # no atomic exchange here: a crash now would leave only `old`
        staging.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    elif not _renameat2(staging, out, RENAME_NOREPLACE):
        staging.rename(out)


STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextmanager
def _locked(path: Path, out: Path, brief: bool = False) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` for the block, then remove it. The file says who
    holds it (this command, and whether ``brief``), so that a command that finds it held waits
    for a brief holder (``LOCK_WAIT_S``) and refuses a run's at once. A signal that arrives
    between the file's making and the block is held until the block starts (and ends it there),
    so that no lock file is left behind by an interrupted run."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
    try:
        fd = _acquire(path, out, brief, mask)
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        raise
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a signal held meanwhile arrives now
        yield
    finally:
        with suppress(OSError):
            path.unlink()
        os.close(fd)


def _acquire(path: Path, out: Path, brief: bool, mask) -> int:
    """The open lock file, locked and naming its holder; signals held but while waiting for a
    brief holder (``mask``: the ones to wait under)."""
    deadline = None
    while True:
        try:  # never through a link someone left in the lock's place
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        except OSError as e:
            reason = f"cannot lock {out}: {path} cannot be made ({e.strerror})"
            raise _UnlockableError(reason) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            who = f"{holder.get('command', 'another probe command')} (process {holder.get('pid')})"
            if not holder.get("brief"):
                raise ProbeError(
                    f"another probe run is writing {out}; wait for it or choose another --out"
                ) from None
            if deadline is None:
                deadline = time.monotonic() + LOCK_WAIT_S
                _say(f"{out} is held by {who}; waiting for it, up to {LOCK_WAIT_S:g} s")
            elif time.monotonic() > deadline:
                raise ProbeError(f"{out} is still held by {who} after {LOCK_WAIT_S:g} s; "
                                 "run this again once it is done") from None  # fmt: skip
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a wait the user may interrupt
            time.sleep(LOCK_POLL_S)
            signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
            continue
        try:  # the holder before us may have removed the file we opened: lock the live one
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    with suppress(OSError):  # who holds it, for whoever finds it held
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"command": _command(), "pid": os.getpid(),
                                  "brief": brief}).encode(), 0)  # fmt: skip
    return fd


def _holder(fd: int) -> dict:
    """What the holder of the lock open at ``fd`` wrote into it: {} for a run of an older
    probe, or one that has only just taken it (asked again, briefly)."""
    for _ in range(5):
        with suppress(OSError, ValueError):
            holder = json.loads(os.pread(fd, 4096, 0))
            if isinstance(holder, dict):
                return holder
        time.sleep(0.02)
    return {}


def _command() -> str:
    """This command, as a user would name it (``probe figures``), for whoever finds its lock."""
    program = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    if program in ("probe", "cli.py", "__main__.py") and len(sys.argv) > 1:
        return f"probe {sys.argv[1]}"
    return "a probe command in a Python process"


def _say(message: str) -> None:
    """A line on the console (stderr) while the command goes on."""
    with suppress(Exception):
        print(f"probe: {message}", file=sys.stderr, flush=True)


class _UnlockableError(ProbeError):
    """The lock file cannot be made (a read-only folder)."""


def _clean_up_after_killed_runs(parent: Path, out: Path) -> None:
    """Remove what runs to ``out`` that were killed left beside it (we hold the lock, so no
    live run is writing there); an old report caught between two renames goes back."""
    prefix = f".{out.name}.probe-"
    for stale in parent.iterdir():
        if not stale.name.startswith(prefix) or stale.is_symlink() or not stale.is_dir():
            continue
        if stale.name.startswith(prefix + "old-") and is_report(stale) and not out.exists():
            stale.rename(out)
        else:
            shutil.rmtree(stale, ignore_errors=True)


def _make_parents(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; returns those created, outermost first."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for f in reversed(missing):
        f.mkdir()
    return list(reversed(missing))


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """Linux ``renameat2``: True if done, False where the system or file system lacks it."""
    libc = _libc()
    function = getattr(libc, "renameat2", None) if libc else None
    if function is None:
        return False
    if function(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    if error == errno.EEXIST:
        raise ProbeError(f"{dst} was created by something else while probe ran; nothing replaced")
    raise OSError(error, os.strerror(error), str(dst))


def _libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name, use_errno=True) if name else None
    except OSError:
        return None


def _version() -> str:
    from probe import __version__

    return __version__
