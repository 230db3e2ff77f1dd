"""A block of attention scores' softmax and its per-query statistics in one pass (``fused.c``).

The row path (``probe.capture.rows``) turns each block of a long input's scores into its pattern,
and the analyses read statistics of every query's row: entropy, the largest weight and the key
that holds it, what each key receives. Made with torch's operations, each is one more pass over a
block too large for the processor's cache (the softmax, the shift and product behind entropy,
two maxima, a product for what the keys receive): at 32,768 tokens those passes took longer than
the scores' product itself. ``fused.c`` reads each query's row once and finds it in the cache for
every later sweep.

It is compiled once per machine with the C compiler (``$CC``, else ``cc``), into probe's cache
folder (``probe.files.cache_dir``), and run on torch's number of threads, each taking whole
(batch, head) pairs, so that its numbers do not depend on how many there are. Where no compiler
works, ``softmax_stats`` answers None, ``described`` says why, and the row path computes the same
statistics with torch: the same numbers to float32 rounding (its exponential is within 1e-7 of
torch's, relative).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
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
    built with, or why torch computes them."""
    library, how = _library()
    return f"fused C kernel, {how}" if library is not None else f"torch ({how})"


def used() -> str | None:
    """``described``, where this process's row path has asked for the kernel; else None."""
    return described() if _library.cache_info().currsize else None


@lru_cache(maxsize=1)
def _library() -> tuple[ctypes.CDLL | None, str]:
    """The compiled kernel and how it was built; or None and why not."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None, "no C compiler: set CC to one"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout.partition("\n")[0]  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"the C compiler {compiler} does not run ({e})"
    source = SOURCE.read_bytes()
    identity = [source, " ".join(FLAGS), version, platform.machine(), _processor()]
    key = hashlib.sha256(repr(identity).encode()).hexdigest()[:16]
    path = cache_dir() / "kernels" / f"fused-{key}.so"
    if not path.is_file():
        why = _build(compiler, path)
        if why is not None:
            return None, why
    try:
        library = ctypes.CDLL(str(path))
    except OSError as e:
        return None, f"the kernel built at {path} does not load ({e})"
    library.block_stats.restype = None
    library.block_stats.argtypes = (
        [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 5 + [ctypes.c_void_p] * 5
    )
    return library, f"{Path(compiler).name}: {version}"


def _build(compiler: str, path: Path) -> str | None:
    """Compile ``fused.c`` into ``path`` (through a temporary file); None, or why it failed."""

    def compile_into(target: Path) -> None:
        command = [compiler, *FLAGS, "-o", str(target), str(SOURCE), "-lm"]
        subprocess.run(command, capture_output=True, text=True, timeout=300, check=True)

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, compile_into)
    except subprocess.CalledProcessError as e:
        lines = (e.stderr or "").strip().splitlines()
        return f"{compiler} failed on fused.c: {lines[-1] if lines else e.returncode}"
    except (OSError, WriteError, subprocess.SubprocessError) as e:
        return f"the kernel could not be built in {path.parent} ({e})"
    return None


def _processor() -> str:
    """What -march=native compiles for: the processor's flags, where the system lists them."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


@lru_cache(maxsize=4)
def _pool(threads: int, process: int) -> ThreadPoolExecutor:
    """Threads for the shares after the first (which the caller takes), of this ``process``: a
    forked child has none of its parent's threads, so it makes its own."""
    return ThreadPoolExecutor(max_workers=max(threads - 1, 1), thread_name_prefix="probe-fused")
