"""How long the test suite takes: the quick subset (``-m "not slow"``) or everything.

    python benchmarks/suite.py [--all] [--rounds 1] [--serial]

Each round is a fresh ``python -m pytest -q`` process (the README's command: a worker per core,
as ``pyproject.toml``'s ``-n auto`` sets), or with ``--serial`` one process (``-n 0``), timed
whole. The machine's load is part of
the result: the figures in the README are for an idle machine, and a test run sharing its cores
with other processes takes longer (two or three times, on 2 cores), so each round prints the
1-minute load average before and after it, and the cores there are. A run whose load before it
exceeded half the cores is marked busy: it is no idle figure.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="every test, the slow ones too")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--serial", action="store_true", help="one process, no pytest-xdist")
    args = parser.parse_args()
    selection = [] if args.all else ["-m", "not slow"]
    selection += ["-n", "0"] if args.serial else []
    cores = os.cpu_count()
    environment = os.environ | {"HF_HUB_OFFLINE": "1"}
    for round_ in range(args.rounds):
        before = os.getloadavg()[0]
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection],
            cwd=ROOT, env=environment, capture_output=True, text=True,
        )  # fmt: skip
        wall = time.perf_counter() - start
        after = os.getloadavg()[0]
        summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr
        state = "busy" if before > cores / 2 else "idle"
        print(
            f"round {round_ + 1}: {'everything' if args.all else 'the quick subset'}"
            f"{' in one process' if args.serial else ', a worker per core'} "
            f"{wall:.0f} s on {cores} cores, load {before:.1f} before and {after:.1f} after "
            f"({state}); pytest: {summary}"
        )


if __name__ == "__main__":
    main()
