"""A block of attention scores' softmax and its per-query statistics in one pass (``fused.c``).

The row path (``probe.capture.rows``) turns each block of a long input's scores into its pattern,
and the analyses read statistics of every query's row: entropy, the largest weight and the key
that holds it, what each key receives. Made with torch's operations, each is one more pass over a
block too large for the processor's cache (the softmax, the shift and product behind entropy,
two maxima, a product for what the keys receive): at 32,768 tokens those passes took longer than
the scores' product itself. ``fused.c`` reads each query's row once and finds it in the cache for
every later sweep.

It is compiled once per machine with the C compiler (``$CC``, else ``cc``), into probe's cache
folder (``probe.files.cache_dir``), checked in a child process before this one loads it
(``_library``), and run on torch's number of threads, each taking whole
(batch, head) pairs, so that its numbers do not depend on how many there are. Where no compiler
works, ``softmax_stats`` answers None, ``described`` says why, and the row path computes the same
statistics with torch: the same numbers to float32 rounding (its exponential is within 1e-7 of
torch's, relative).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import torch

from probe.files import WriteError, cache_dir, write_file

SOURCE = Path(__file__).with_name("fused.c")
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math",
         "-shared", "-fPIC")  # fmt: skip
# Below this many numbers a block is done by the calling thread alone: handing a share to
# another thread costs about as much as the work.
SMALL = 2**16
# Seconds the compiler may take to say its version, to build, and a built library to pass its
# check (``_check``): a compiler or library that hangs is stopped and torch computes instead.
VERSION_S, BUILD_S, CHECK_S = 30.0, 120.0, 30.0
ABANDONED_S = 3600.0  # a temporary file of a build this old was left by a build that was killed


class Fused(NamedTuple):
    """A block's statistics, each ``[batch, head, rows]`` but ``received``."""

    entropy: torch.Tensor  # -Σ p log p, nats
    top: torch.Tensor  # the largest weight
    first: torch.Tensor  # long: where the first largest weight lies, counted in the block's keys
    received: torch.Tensor | None  # [batch, head, keys]: Σ over queries of weight · p


def softmax_stats(
    scores: torch.Tensor, pattern: torch.Tensor, queries: torch.Tensor | None = None
) -> Fused | None:
    """Write ``softmax(scores, -1)`` into ``pattern`` and return its rows' statistics, or None
    where the kernel cannot run (no compiler, not a CPU tensor): then nothing is written.

    Parameters
    ----------
    scores : ``[batch, head, rows, keys]`` float32, contiguous
        Masked keys at the lowest float (never -inf).
    pattern : like ``scores``
        Where the softmax goes: ``scores`` itself, to overwrite them (which spares the memory
        traffic of a second block: 13% of the kernel's time at 32k tokens).
    queries : ``[batch, rows]``, optional
        Each query's weight in ``Fused.received``; without it, ``received`` is None.
    """
    library = _library()[0]
    usable = all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
                 for t in (scores, pattern))  # fmt: skip
    if library is None or not usable or scores.shape != pattern.shape:
        return None
    B, H, b, K = scores.shape
    if queries is not None and (queries.shape != (B, b) or queries.device.type != "cpu"):
        raise ValueError(f"queries must be [batch, rows] = [{B}, {b}] on the CPU, not "
                         f"{list(queries.shape)} on {queries.device}")  # fmt: skip
    entropy, top = scores.new_empty(B, H, b), scores.new_empty(B, H, b)
    first = torch.empty(B, H, b, dtype=torch.long)
    weight = None if queries is None else queries.to(torch.float32).contiguous()
    received = None if queries is None else scores.new_zeros(B, H, K)
    pointers = [t.data_ptr() if t is not None else None
                for t in (weight, received, entropy, top, first)]  # fmt: skip
    pairs = B * H
    threads = min(torch.get_num_threads(), pairs) if scores.numel() >= SMALL else 1
    bounds = [pairs * t // threads for t in range(threads + 1)]

    def share(t: int) -> None:
        library.block_stats(scores.data_ptr(), pattern.data_ptr(), bounds[t], bounds[t + 1],
                            H, b, K, *pointers)  # fmt: skip

    others = [_pool(threads, os.getpid()).submit(share, t) for t in range(1, threads)]
    share(0)  # this thread takes the first share while the others take theirs
    for other in others:
        other.result()
    return Fused(entropy, top, first, received)


def available(device: torch.device) -> bool:
    """Whether ``softmax_stats`` runs for blocks on ``device`` (it builds the kernel once)."""
    return device.type == "cpu" and _library()[0] is not None


def described() -> str:
    """How the row path computes its statistics, for ``run.json``: the compiler the kernel was
    built with (and what happened to a cached one that failed its check), or why torch
    computes them."""
    library, how = _library()
    return f"fused C kernel, {how}" if library is not None else f"torch ({how})"


def used() -> str | None:
    """``described``, where this process's row path has asked for the kernel; else None."""
    return described() if _library.cache_info().currsize else None


class _BuildError(Exception):
    """The compiler failed, or what it built failed its check: the reason, in words."""


@lru_cache(maxsize=1)
def _library() -> tuple[ctypes.CDLL | None, str]:
    """The compiled kernel and how it was built; or None and why not.

    A library is loaded here only once a child process has run it on a small block and its
    numbers were right (``_check``): one built for another processor (``-march=native``) dies
    there of an illegal instruction, not here. The cached library is keyed by the processor's
    model and flags, so a cache carried to another machine builds that machine's own; a cached
    library that fails its check (cut, garbage, another processor's) is rebuilt; a build goes
    through a temporary name, is checked, then renamed into place, so that no process ever
    finds a library that was not checked. Where the cache folder cannot be written, the kernel
    is built in a temporary folder for this process alone.
    """
    command, why = _compiler()
    if command is None:
        return None, why
    name = Path(command[0]).name
    try:
        said = _execute([*command, "--version"], VERSION_S, check=False)
    except _BuildError as e:
        return None, f"the C compiler {name} does not run ({e})"
    version = said.partition("\n")[0].strip()  # none, from a compiler without --version
    source = SOURCE.read_bytes()
    identity = [source, " ".join(FLAGS), command, version, platform.machine(), _processor()]
    key = hashlib.sha256(repr(identity).encode()).hexdigest()[:16]
    path = cache_dir() / "kernels" / f"fused-{key}.so"
    how, notes = f"{name}: {version}" if version else name, []
    if path.is_file():
        failed = _check(path)
        if failed is None:
            return _load(path, how)
        notes.append(f"the cached kernel failed its check ({failed}), rebuilt")
        with suppress(OSError):  # a read-only cache keeps it: the build below goes elsewhere
            path.unlink()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(path.parent)
        write_file(path, lambda tmp: _build(command, name, tmp))
    except _BuildError as e:
        return None, "; ".join([*notes, str(e)])
    except (OSError, WriteError) as e:  # the cache folder cannot be written: build elsewhere
        reason = e.reason if isinstance(e, WriteError) else (e.strerror or type(e).__name__)
        notes.append(f"built for this run alone: the cache folder {path.parent} cannot be "
                     f"written ({reason})")  # fmt: skip
        try:
            with tempfile.TemporaryDirectory(prefix="probe-kernel-") as folder:
                built = Path(folder) / "fused.so"
                _build(command, name, built)
                return _load(built, "; ".join([how, *notes]))  # loaded: the file may go
        except (_BuildError, OSError) as e:
            return None, "; ".join([*notes[:-1], f"the cache folder {path.parent} cannot be "
                                    f"written ({reason}), nor a temporary one ({e})"])  # fmt: skip
    return _load(path, "; ".join([how, *notes]))


def _remove_abandoned(folder: Path) -> None:
    """Remove the temporary files of builds killed midway (never loaded: only a checked build
    is renamed to a kernel's name), once they are older than any build still running."""
    for left in folder.glob(".probe-tmp-*"):
        with suppress(OSError):
            if time.time() - left.lstat().st_mtime > ABANDONED_S:
                left.unlink()


def _compiler() -> tuple[list[str] | None, str]:
    """The compiler's command (``$CC``, split as a shell would, else ``cc`` or ``gcc`` on the
    ``PATH``), or None and why there is none."""
    given = os.environ.get("CC", "").strip()
    if given:
        try:
            command = shlex.split(given)
        except ValueError as e:
            return None, f"CC={given!r} is not a command ({e})"
        found = shutil.which(command[0])
        if found is None:
            return None, f"no C compiler: CC={given!r} names no program on PATH"
        return [found, *command[1:]], ""
    found = shutil.which("cc") or shutil.which("gcc")
    if found is None:
        return None, "no C compiler: neither cc nor gcc is on PATH; set CC to one"
    return [found], ""


def _build(command: list[str], name: str, target: Path) -> None:
    """Compile ``fused.c`` into ``target`` and check it (``_check``); raises ``_BuildError``."""
    try:
        _execute([*command, *FLAGS, "-o", str(target), str(SOURCE), "-lm"], BUILD_S)
    except _BuildError as e:
        raise _BuildError(f"{name} failed on fused.c ({e})") from None
    failed = _check(target)
    if failed is not None:
        raise _BuildError(f"{name} built a kernel that failed its check ({failed})")


def _load(path: Path, how: str) -> tuple[ctypes.CDLL | None, str]:
    """The checked library at ``path``, ready to call; or None and why not."""
    try:
        library = ctypes.CDLL(str(path))
        library.block_stats.restype = None
    except (OSError, AttributeError) as e:  # changed since it was checked
        return None, f"the kernel at {path} does not load ({e})"
    library.block_stats.argtypes = (
        [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 5 + [ctypes.c_void_p] * 5
    )
    return library, how


# A block small enough to compute by hand, large enough that every loop of the kernel runs its
# vector body and its remainder (keys past a multiple of any vector width, and past CHUNK).
CHECK_SHAPE = (2, 3, 67)  # heads, rows, keys (one batch)
CHECK_CHILD = """
import ctypes, json, math, sys
H, R, K = {shape}
n = H * R * K
s = [math.sin(0.7 * i) * 6.0 for i in range(n)]
for i in range(0, n, 5 * K + 3):
    s[i] = -3.4028234663852886e38  # masked keys, as the row path writes them
lib = ctypes.CDLL(sys.argv[1])
f = ctypes.c_float
scores, pattern = (f * n)(*s), (f * n)()
weight, received = (f * R)(*[1.0, 0.0, 0.5][:R]), (f * (H * K))()
entropy, top, first = (f * (H * R))(), (f * (H * R))(), (ctypes.c_int64 * (H * R))()
i64 = ctypes.c_int64
lib.block_stats.restype = None
lib.block_stats(scores, pattern, i64(0), i64(H), i64(H), i64(R), i64(K), weight, received,
                entropy, top, first)
print(json.dumps([list(pattern), list(received), list(entropy), list(top), list(first)]))
"""


def _check(path: Path) -> str | None:
    """Run the library at ``path`` on a small block in a child process, and compare its numbers
    with the same computed here in double precision: None when they agree, else what went
    wrong (it does not load, dies of a signal, hangs, or answers wrong numbers)."""
    H, R, K = CHECK_SHAPE
    child = CHECK_CHILD.format(shape=CHECK_SHAPE)
    try:
        answer = _execute([sys.executable, "-I", "-S", "-c", child, str(path)], CHECK_S)
        pattern, received, entropy, top, first = json.loads(answer)
    except _BuildError as e:
        return str(e)
    except ValueError:
        return "it answered no numbers"
    n = H * R * K
    s = [math.sin(0.7 * i) * 6.0 for i in range(n)]
    for i in range(0, n, 5 * K + 3):
        s[i] = -math.inf
    weight = [1.0, 0.0, 0.5][:R]
    if [len(x) for x in (pattern, received, entropy, top, first)] != [n, H * K, *[H * R] * 3]:
        return "it answered the wrong number of numbers"
    for row in range(H * R):
        row_s = s[row * K : (row + 1) * K]
        m = max(row_s)
        e = [math.exp(x - m) for x in row_s]
        z = sum(e)
        p = [x / z for x in e]
        got = pattern[row * K : (row + 1) * K]
        h = -sum(x * math.log(x) for x in p if x > 0)
        wrong = (any(abs(a - b) > 1e-6 + 1e-5 * b for a, b in zip(got, p, strict=True))
                 or abs(entropy[row] - h) > 1e-5 * max(1.0, h) or abs(top[row] - max(p)) > 1e-6
                 or first[row] != got.index(max(got)))  # fmt: skip
        if wrong:
            return f"wrong numbers in row {row} of its test block"
        for k in range(K):
            received_by = sum(weight[r] * pattern[((row // R) * R + r) * K + k] for r in range(R))
            if row % R == 0 and abs(received[(row // R) * K + k] - received_by) > 1e-5:
                return f"wrong received weights in head {row // R} of its test block"
    return None


def _execute(command: list[str], timeout: float, check: bool = True) -> str:
    """Run ``command`` with nothing to read, in a session of its own, for at most ``timeout``
    seconds (then it and whatever it started are killed); its output, or ``_BuildError`` saying
    why not: it does not start, is killed, or hangs, or (with ``check``) fails."""
    try:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
    except OSError as e:
        raise _BuildError(e.strerror or type(e).__name__) from None
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with suppress(OSError):
            os.killpg(process.pid, signal.SIGKILL)  # its children too, which hold the pipes
        process.communicate()
        raise _BuildError(f"no answer in {timeout:g} s; stopped") from None
    except BaseException:
        with suppress(OSError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise
    if process.returncode < 0:
        raise _BuildError(f"killed by {signal.Signals(-process.returncode).name}")
    if process.returncode != 0 and check:
        lines = err.decode(errors="replace").strip().splitlines()
        raise _BuildError(lines[-1][:200] if lines else f"exit status {process.returncode}")
    return out.decode(errors="replace")


def _processor() -> str:
    """What -march=native compiles for: the processor's model and flags, where the system
    lists them."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = [line for line in f if line.startswith(("flags", "model name", "Features",
                                                              "CPU part"))]  # fmt: skip
    except OSError:
        lines = []
    return "".join(dict.fromkeys(lines)) or platform.processor()


@lru_cache(maxsize=4)
def _pool(threads: int, process: int) -> ThreadPoolExecutor:
    """Threads for the shares after the first (which the caller takes), of this ``process``: a
    forked child has none of its parent's threads, so it makes its own."""
    return ThreadPoolExecutor(max_workers=max(threads - 1, 1), thread_name_prefix="probe-fused")
