"""What each mechanism added for speed buys: paired runs with it and without it.

    python benchmarks/mechanisms.py [--rounds 4]

- the fit helper process (``probe.pipeline.helper``): ``probe analyze --model minilm`` on EWT dev
(the
  default analyses), as a whole process, with the helper and with ``helper.start`` replaced by
  a function that starts none (the fits then run in the process, as in a notebook);
- lazy imports (``probe.lazy``, ``probe/__init__``'s names imported on first use): ``probe
  --help`` against the same command after importing what the names would pull in (torch,
  transformers, pandas, scikit-learn);
- the per-process template cache (``probe.app.report``): a report rendered twice in one
  process (``probe report``'s work), the second time with the cache, against a fresh cache.

Runs alternate (with, without, with…) so that a change in the machine's load falls on both;
medians are printed with each run's time.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import ewt_dev

NO_HELPER = "import probe.pipeline.helper as h; h.start = lambda *a, **k: False; "
CLI = "from probe.app.cli import main; import sys; sys.argv = ['probe'] + sys.argv[1:]; main()"
EAGER = "import torch, transformers, pandas, sklearn; "


def timed(command: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(done.stderr)
    return time.perf_counter() - start


def paired(name: str, with_it: list[str], without: list[str], rounds: int) -> None:
    a, b = [], []
    for _ in range(rounds):
        a.append(timed(with_it))
        b.append(timed(without))
    print(f"{name}: with {statistics.median(a):.2f} s, without {statistics.median(b):.2f} s "
          f"(runs {[round(x, 2) for x in a]} / {[round(x, 2) for x in b]})")  # fmt: skip


def templates(rounds: int) -> None:
    """Render one report's page again and again in one process, the cache warm or cleared."""
    from probe.app import report

    folder = Path(tempfile.mkdtemp()) / "r"
    subprocess.run([sys.executable, "-c", CLI, "analyze", "--model", "minilm", "-t", "sample",
                    "-q", "--out", str(folder)], check=True, capture_output=True)  # fmt: skip
    warm, cold = [], []
    report.render(folder)  # the first render also imports what rendering needs
    for _ in range(rounds):
        report._page_environment.cache_clear()
        report._compiled.cache_clear()
        for kept in (cold, warm):  # fresh caches, then the same caches again
            start = time.perf_counter()
            report.render(folder)
            kept.append(time.perf_counter() - start)
    print(f"template cache: a page rendered with it {statistics.median(warm):.3f} s, with a "
          f"fresh one {statistics.median(cold):.3f} s")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp())
    run = ["analyze", "--model", "minilm", "--treebank", str(ewt_dev()), "-q", "--overwrite"]
    paired(
        "fit helper (probe analyze, EWT dev, default analyses)",
        [sys.executable, "-c", CLI, *run, "--out", str(out / "a")],
        [sys.executable, "-c", NO_HELPER + CLI, *run, "--out", str(out / "b")],
        args.rounds,
    )
    paired(
        "lazy imports (probe --help)",
        [sys.executable, "-c", CLI, "--help"],
        [sys.executable, "-c", EAGER + CLI, "--help"],
        args.rounds + 2,
    )
    templates(args.rounds + 2)


if __name__ == "__main__":
    main()
