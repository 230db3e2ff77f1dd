"""Streaming a plain-text corpus (``--corpus``): peak memory does not grow with the corpus.

    python benchmarks/corpus.py [--lines 500000] [--texts 2000] [--analyses roles]

MiniLM reads the first ``--texts`` texts of a corpus of ``--texts`` lines and of one of
``--lines`` lines (EWT dev's sentences, as plain text, over and over); the goal is a peak at most
1.1x. Each figure is the peak resident memory of a fresh `probe analyze` process (ru_maxrss).
Also timed: a hub name that cannot be reached, which must fail in one line, quickly.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from itertools import cycle, islice
from pathlib import Path

from _common import ewt_dev

PROBE = str(Path(sys.executable).with_name("probe"))


def peak_mib(args: list[str]) -> tuple[float, float]:
    """Peak resident memory (MiB) and seconds of one `probe analyze` process."""
    start = time.perf_counter()
    child = subprocess.Popen([PROBE, "analyze", "-q", *args], stderr=subprocess.PIPE, text=True)
    err = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    if status:
        sys.exit(f"probe analyze {' '.join(args)} failed:\n{err[-2000:]}")
    return usage.ru_maxrss / 1024, time.perf_counter() - start


def write_corpus(path: Path, lines: int) -> None:
    """``lines`` lines of EWT dev's sentence texts, in order, repeated as needed."""
    texts = [
        line.removeprefix("# text = ")
        for line in ewt_dev().read_text(encoding="utf-8").splitlines()
        if line.startswith("# text = ")
    ]
    with path.open("w", encoding="utf-8") as f:
        f.writelines(t + "\n" for t in islice(cycle(texts), lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=500_000)
    parser.add_argument("--texts", type=int, default=2000)
    parser.add_argument("--analyses", default="roles")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        small, large = folder / "small.txt", folder / "large.txt"
        write_corpus(small, args.texts)
        write_corpus(large, args.lines)
        size = large.stat().st_size / 2**20
        print(f"corpus: {args.texts:,} lines and {args.lines:,} lines ({size:.0f} MiB); "
              f"MiniLM, -a {args.analyses}, --max-texts {args.texts}")  # fmt: skip
        peaks = {}
        for name, path in (("small", small), ("large", large)):
            peaks[name], seconds = peak_mib(["-m", "minilm", "-a", args.analyses, "--corpus",
                                             str(path), "--max-texts", str(args.texts),
                                             "-o", str(folder / name)])  # fmt: skip
            print(f"  {name:5s}: peak {peaks[name]:7.1f} MiB, {seconds:6.1f} s")
        print(f"  ratio large / small: {peaks['large'] / peaks['small']:.3f} (goal ≤ 1.1)")
        start = time.perf_counter()
        failed = subprocess.run(
            [PROBE, "analyze", "-m", "minilm", "-a", "roles", "--corpus", "hf:no-such/corpus",
             "-o", str(folder / "hub")],
            capture_output=True, text=True, env=os.environ | {"HF_HUB_OFFLINE": "1"},
        )  # fmt: skip
        lines = failed.stderr.strip().splitlines()
        print(f"offline hub name: exit {failed.returncode}, {len(lines)} line(s) in "
              f"{time.perf_counter() - start:.1f} s: {lines[0] if lines else ''}")  # fmt: skip


if __name__ == "__main__":
    main()
