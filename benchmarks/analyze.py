"""`probe analyze --model minilm` over the whole EWT dev split, end to end, against the floor.

    python benchmarks/analyze.py [--rounds 2] [--model minilm] [--device cpu]

Floor: a fresh Python process that imports torch and transformers, loads MiniLM and its
tokenizer, reads and tokenizes the same sentences, and runs the plain forward pass (the model's
default attention, no attention output) over the very batches that probe analyze runs.
Ours: a fresh `probe analyze` process, every analysis, loading and rendering included, with its
helper process (``probe.pipeline.helper``, which imports scikit-learn while torch imports and does
its
fits): its CPU seconds are counted with the run's, and the peak is the larger of the two
processes'. Both are timed as whole processes; peak memory is each process's maximum resident size.
The analyses stage (reading, tokenizing, the mirrored forward pass and every analysis, streamed
together) is compared with the floor's forward pass alone.

Also: a weights-only run (`--analyses spectra`) on EWT dev against the same on the bundled
sample, which must cost the same, since it reads no treebank.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ewt_dev

FLOOR = """
import sys, time, torch
from transformers import AutoModel, AutoTokenizer
from probe.inputs.corpus import Corpus, max_tokens
from probe.pipeline.loading import resolve_name
from probe.inputs.treebank import iter_conllu
treebank, name, device = sys.argv[1:4]
source = resolve_name(name)
tokenizer = AutoTokenizer.from_pretrained(source)
model = AutoModel.from_pretrained(source, dtype=torch.float32).eval().to(device)
corpus = Corpus(iter_conllu(treebank), tokenizer, max_tokens(model.config, tokenizer))
sync = torch.cuda.synchronize if device.startswith("cuda") else lambda: None
forward = 0.0
with torch.inference_mode():
    for batch in corpus.batches(32):  # the very batches probe analyze runs
        inputs = {k: v.to(device) for k, v in batch.inputs.items()}
        sync()
        start = time.perf_counter()
        model(**inputs)
        sync()
        forward += time.perf_counter() - start
print(f"{forward:.3f}")
"""


def peak_rss(command: list[str]) -> tuple[float, int, str, float]:
    """Wall seconds, peak resident bytes, stdout and CPU seconds (user and system) of a child
    process: CPU time says less about waiting on a shared machine than wall time does."""
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = child.stdout.read()
    err = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    elapsed = time.perf_counter() - start
    if status:
        sys.exit(f"{' '.join(command[:3])} failed:\n{err[-2000:]}")
    return elapsed, usage.ru_maxrss * 1024, out, usage.ru_utime + usage.ru_stime


def ratio_interval(floor: list[float], ours: list[float], replicates: int = 10_000) -> tuple:
    """A 95% bootstrap interval of the ratio of the medians, median(ours) / median(floor): the
    rounds are resampled whole (a round's two processes ran back to back, under the same load),
    so that the interval says how far the machine's noise leaves the headline ratio uncertain."""
    import numpy as np

    rng = np.random.default_rng(0)
    pairs = np.array([floor, ours])  # [2, rounds]
    drawn = pairs[:, rng.integers(0, pairs.shape[1], (replicates, pairs.shape[1]))]
    ratios = np.median(drawn[1], axis=1) / np.median(drawn[0], axis=1)
    low, high = np.percentile(ratios, [2.5, 97.5])
    return float(low), float(high)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default="minilm", help="a name or folder probe can load")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--busy",
        type=int,
        default=0,
        help="processes spinning on the cores meanwhile, as other users' jobs",
    )
    parser.add_argument("--skip-spectra", action="store_true", help="skip the weights-only runs")
    args = parser.parse_args()
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(args.busy)]  # fmt: skip
    try:
        measure(args)
    finally:
        for spinner in spinners:
            spinner.kill()


def measure(args: argparse.Namespace) -> None:
    dev = ewt_dev()
    console = Path(sys.executable).with_name("probe")  # the installed command, as users run it
    probe_exe = [str(console)] if console.exists() else [sys.executable, "-m", "probe.app.cli"]
    work = Path(tempfile.mkdtemp(prefix="probe-bench-"))

    def analyze(out: str, *extra: str) -> tuple[float, int, float]:
        seconds, rss, _, cpu = peak_rss([*probe_exe, "analyze", "--model", args.model, "--device",
                                    args.device, "--dtype", "float32", "--out", str(work / out),
                                    "-q", *extra])  # fmt: skip
        return seconds, rss, cpu

    floor, ours, forward, stage, spectra_dev, spectra_sample = [], [], [], [], [], []
    floor_cpu, ours_cpu = [], []
    try:
        for i in range(args.rounds):
            command = [sys.executable, "-c", FLOOR, str(dev), args.model, args.device]
            seconds, floor_rss, out, cpu = peak_rss(command)
            floor.append(seconds)
            floor_cpu.append(cpu)
            forward.append(float(out.strip().splitlines()[-1]))
            seconds, ours_rss, cpu = analyze(f"run{i}", "--treebank", str(dev))
            ours.append(seconds)
            ours_cpu.append(cpu)
            timings = json.loads((work / f"run{i}" / "run.json").read_text())["timings_s"]
            stage.append(timings["analyses"])
            if not args.skip_spectra:
                spectra_dev.append(analyze(f"sd{i}", "-a", "spectra", "-t", str(dev))[0])
                spectra_sample.append(analyze(f"ss{i}", "-a", "spectra", "-t", "sample")[0])
        out_dir = work / f"run{args.rounds - 1}"
        html = (out_dir / "index.html").stat().st_size
        folder = sum(p.stat().st_size for p in out_dir.iterdir())
        threads = json.loads((out_dir / "run.json").read_text()).get("threads", "not recorded")
    finally:
        shutil.rmtree(work)
    median = statistics.median
    f, o, fw, st = median(floor), median(ours), median(forward), median(stage)
    print(
        f"{args.model} on {args.device} over EWT dev ({dev.name}), medians of {args.rounds} "
        f"fresh processes; {args.busy} busy processes, load {os.getloadavg()[0]:.1f}, "
        f"probe's threads {threads}"
    )
    print(f"floor process (import, load, tokenize, plain forward) {f:6.1f} s   "
          f"peak {floor_rss / 2**20:6.0f} MiB")  # fmt: skip
    print(f"  of which the plain forward pass                      {fw:6.1f} s")
    print(f"probe analyze (every analysis, report)                 {o:6.1f} s   "
          f"peak {ours_rss / 2**20:6.0f} MiB")  # fmt: skip
    print("  stages: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
    low, high = ratio_interval(floor, ours)
    print(f"ratio, process to process:                            {o / f:6.2f}x  (goal ≤ 1.5x, #57)"
          f"  95% interval {low:.2f}-{high:.2f}")  # fmt: skip
    # On a shared machine the same process varies by a third from run to run: each round's
    # ratio (its two processes ran back to back) shows the spread, and the ratio of the fastest
    # runs is the one least disturbed by other work.
    rounds = " ".join(f"{b / a:.2f}" for a, b in zip(floor, ours, strict=True))
    print(f"  each round: {rounds}; fastest to fastest {min(ours) / min(floor):.2f}x "
          f"({min(ours):.1f} s / {min(floor):.1f} s)")  # fmt: skip
    fc, oc = median(floor_cpu), median(ours_cpu)
    print(f"  in CPU seconds: floor {fc:.1f} s, probe analyze {oc:.1f} s  {oc / fc:6.2f}x")
    print(f"ratio, analyses stage to the plain forward pass:      {st / fw:6.2f}x  (goal ≤ 1.3x)")
    print(f"ratio, whole process to the plain forward pass:       {o / fw:6.2f}x")
    if spectra_dev:
        sd, ss = median(spectra_dev), median(spectra_sample)
        print(f"--analyses spectra: EWT dev {sd:.1f} s, sample {ss:.1f} s, "
              f"ratio {sd / ss:.2f}x  (goal ≤ 1.3x)")  # fmt: skip
    print(f"report: index.html {html / 2**20:.2f} MiB, folder {folder / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
