"""What the circuit's trust costs (issue #63): ``probe analyze -a circuit --task repeats
--lm-head`` on the induction model (tests/data/induction-gpt2) with this tree's code against
another tree's (``--before``, e.g. the main branch's checkout), and the bootstrap's share of
``probe.edges``.

    python benchmarks/circuit_trust.py --before /work/main [--rounds 3]

- analyze: the command's wall time, each round running both trees' command as subprocesses,
  alternating which goes first (goal: this tree's median ≤ 1.5x the other's);
- bootstrap: the seconds ``BootstrapSums.add`` takes inside ``probe.edges`` on the analysis's
  16 pairs, against the call's (goal ≤ 5%).

The machine is shared: the 1-minute load average is printed before each round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
MODEL = HERE / "tests" / "data" / "induction-gpt2"


def load() -> str:
    path = Path("/proc/loadavg")
    return path.read_text().split()[0] if path.exists() else "?"


def analyze(tree: Path, out: Path) -> float:
    """Seconds of ``probe analyze -a circuit`` with ``tree`` first on the path."""
    env = os.environ | {"PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-c", "from probe.app.start import command; command()",
               "analyze", "-t", "sample", "-q",
               "--model", str(MODEL), "-a", "circuit", "--task", "repeats", "--lm-head",
               "--out", str(out)]  # fmt: skip
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, capture_output=True, cwd=tree)
    return time.perf_counter() - start


def bootstrap_share() -> tuple[float, float]:
    """Seconds of ``probe.edges`` on the analysis's repeats task, and of its bootstrap sums."""
    import torch
    from transformers import AutoTokenizer, GPT2LMHeadModel

    import probe
    from analyses.circuit.task import repeats_task
    from probe.interventions import stability

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = GPT2LMHeadModel.from_pretrained(MODEL, dtype=torch.float32).eval()
    clean, corrupted, metric = repeats_task(tokenizer, 0, 16, 20, 128)
    spent = [0.0]
    add = stability.BootstrapSums.add

    def timed_add(self, *args, **kwargs):
        start = time.perf_counter()
        add(self, *args, **kwargs)
        spent[0] += time.perf_counter() - start

    stability.BootstrapSums.add = timed_add
    probe.edges(model, clean, corrupted, metric)  # warm-up
    spent[0] = 0.0
    start = time.perf_counter()
    probe.edges(model, clean, corrupted, metric)
    return time.perf_counter() - start, spent[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="the other tree")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as folder:
        for r in range(args.rounds):
            order = [("before", args.before), ("after", HERE)][:: 1 if r % 2 == 0 else -1]
            for name, tree in order:
                print(f"round {r}, {name}: load {load()}", flush=True)
                times[name].append(analyze(tree, Path(folder) / f"{name}{r}"))
                print(f"  {times[name][-1]:.1f} s", flush=True)
    before, after = (statistics.median(times[k]) for k in ("before", "after"))
    print(f"analyze: before {before:.1f} s, after {after:.1f} s: {after / before:.2f}x "
          f"(goal ≤ 1.5x); rounds {times}")  # fmt: skip
    edges, boot = bootstrap_share()
    print(f"bootstrap: {boot * 1000:.2f} ms of probe.edges' {edges:.2f} s ({boot / edges:.1%}; "
          f"goal ≤ 5%), load {load()}")  # fmt: skip


if __name__ == "__main__":
    main()
