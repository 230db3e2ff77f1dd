"""How fast the `probe` command answers when there is nothing to compute.

    python benchmarks/startup.py [--rounds 5]

Times fresh processes of `probe --help`, `probe --version` and an argument error (an unknown
--dtype), against a bare `python -c pass` (the floor). The goal is an answer within a second.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROBE = str(Path(sys.executable).with_name("probe"))
COMMANDS = {
    "python -c pass (floor)": [sys.executable, "-c", "pass"],
    "probe --help": [PROBE, "--help"],
    "probe --version": [PROBE, "--version"],
    "probe analyze -m minilm --dtype float8 (error)": [
        PROBE, "analyze", "-m", "minilm", "--dtype", "float8",
    ],
}  # fmt: skip


def seconds(command: list[str], rounds: int) -> float:
    times = []
    for _ in range(rounds + 1):  # the first run warms the file cache
        start = time.perf_counter()
        subprocess.run(command, capture_output=True, check=False)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    results = {name: seconds(command, args.rounds) for name, command in COMMANDS.items()}
    floor = results["python -c pass (floor)"]
    print(f"fresh processes, median of {args.rounds}")
    for name, s in results.items():
        verdict = "" if name.startswith("python") else ("  ok (≤ 1 s)" if s <= 1 else "  SLOW")
        print(f"{name:50s} {s:6.2f} s  {s / floor:5.1f}x python{verdict}")


if __name__ == "__main__":
    main()
