"""``benchmarks/gpu.py`` runs every path it measures on the CPU too, small: the main command,
capture, long inputs and edges of a bfloat16 model, each beside its plain forward (its numbers
are not checked here: timing thresholds never go in tests)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu.py"


def run(*args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, cwd=SCRIPT.parent, timeout=600)  # fmt: skip


@pytest.mark.slow
def test_every_section_runs_on_the_cpu_in_bfloat16():
    done = run("--device", "cpu", "--rounds", "1", "--sentences", "16", "--context", "128",
               "--windows", "2", "--pairs", "4", "--steps", "2")  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("cpu (CPU), bfloat16")
    measured = {}
    for line in lines[1:]:
        found = re.match(r"(\w+) +(.+?) +([\d.]+) s +[\d,]+ (tok|pairs)/s +([\d.]+x|–)", line)
        if found:
            measured[(found[1], found[2])] = found[5]
    sections = {section for section, _ in measured}
    assert sections == {"main", "capture", "long", "edges"}, done.stdout
    ratios = [r for r in measured.values() if r != "–"]
    assert len(ratios) == 6 and all(float(r[:-1]) > 0 for r in ratios), done.stdout
    assert any(what.startswith("probe.edges") for _, what in measured)
    assert "probe analyze -a roles, 2 x 128 tokens" in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_without_a_gpu_it_says_to_run_on_the_cpu():
    done = run("--only", "edges")
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        "this torch sees no CUDA GPU; run with --device cpu (small sizes)"
    )
