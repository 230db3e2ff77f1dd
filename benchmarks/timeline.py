"""`probe timeline` over the induction GPT-2's ten shipped checkpoints against ten separate
`probe analyze` runs of the same analyses, one per checkpoint.

    python benchmarks/timeline.py [--rounds 1] [--analyses taxonomy,roles] [--treebank sample]

Both are timed as whole processes, started as a user starts them (`probe ...`), one after the
other; the goal is a timeline at most half the ten runs' time (one start, one tokenization of
the inputs, one helper process). Peak memory is the largest resident size of any process of the
run (``RUSAGE_CHILDREN`` of a wrapper that runs only it: the command and its helper); the goal is
the timeline's peak at most one `probe analyze` run's (the largest of the ten) plus 50 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
STEPS = Path(__file__).resolve().parents[1] / "tests" / "data" / "induction-gpt2-steps"
# Runs one command and prints the largest resident size (kB) of its processes.
WRAPPER = (
    "import resource, subprocess, sys; "
    "done = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(done.returncode)"
)


def measured(command: list[str]) -> tuple[float, float]:
    """Wall seconds and peak resident MB of ``command``, run alone."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", WRAPPER, *command], capture_output=True,
                          text=True, check=True)  # fmt: skip
    return time.perf_counter() - start, int(done.stdout.split()[-1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--analyses", default="taxonomy,roles")
    parser.add_argument("--treebank", default="sample")
    args = parser.parse_args()
    options = ["-a", args.analyses, "-t", args.treebank, "--lm-head", "--repeat-length", "20",
               "-q"]  # fmt: skip
    checkpoints = sorted((p for p in STEPS.iterdir() if p.is_dir()),
                         key=lambda p: int(p.name.split("-")[1]))  # fmt: skip
    timeline, separate = [], []
    peaks_timeline, peaks_analyze = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            seconds, peak = measured(["probe", "timeline", str(STEPS), *options, "--out",
                                      f"{tmp}/timeline-{r}"])  # fmt: skip
            timeline.append(seconds)
            peaks_timeline.append(peak)
            total = 0.0
            for c in checkpoints:
                seconds, peak = measured(["probe", "analyze", "-m", str(c), *options, "--out",
                                          f"{tmp}/analyze-{r}-{c.name}"])  # fmt: skip
                total += seconds
                peaks_analyze.append(peak)
            separate.append(total)
    ours, theirs = statistics.median(timeline), statistics.median(separate)
    result = {
        "checkpoints": len(checkpoints),
        "analyses": args.analyses,
        "treebank": args.treebank,
        "timeline_s": round(ours, 2),
        "ten_analyze_runs_s": round(theirs, 2),
        "ratio": round(ours / theirs, 3),
        "ratio_goal": 0.5,
        "timeline_peak_mb": round(max(peaks_timeline), 1),
        "analyze_peak_mb": round(max(peaks_analyze), 1),
        "peak_over_one_run_mb": round(max(peaks_timeline) - max(peaks_analyze), 1),
        "peak_goal_mb": 50,
        "cpus": os.cpu_count(),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
