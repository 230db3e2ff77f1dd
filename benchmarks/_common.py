"""Shared set-up for the benchmarks: the EWT dev split, MiniLM, timing."""

from __future__ import annotations

import gzip
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

EWT_DEV = Path(__file__).resolve().parents[2] / "shared/data/ud-english-ewt/en_ewt-ud-dev.conllu"


def ewt_dev() -> Path:
    """``../shared``'s EWT dev, else the same file bundled with probe, unpacked once into the
    temporary folder (a machine without ``../shared``, say a GPU one)."""
    if EWT_DEV.exists():
        return EWT_DEV
    from probe.inputs.treebank import BUNDLED

    unpacked = Path(tempfile.gettempdir()) / "probe-bench-en_ewt-ud-dev.conllu"
    if not unpacked.exists():
        with gzip.open(BUNDLED["ewt-dev"], "rt", encoding="utf-8") as f:
            unpacked.write_text(f.read(), encoding="utf-8")
    return unpacked


def timed(fn, rounds: int = 3) -> float:
    """Median wall time of ``fn()`` over ``rounds`` runs, after one warm-up."""
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
