"""Shared set-up for the benchmarks: the EWT dev split, MiniLM, timing."""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

EWT_DEV = Path(__file__).resolve().parents[2] / "shared/data/ud-english-ewt/en_ewt-ud-dev.conllu"


def ewt_dev() -> Path:
    if not EWT_DEV.exists():
        sys.exit(f"needs {EWT_DEV} (../shared beside the checkout)")
    return EWT_DEV


def timed(fn, rounds: int = 3) -> float:
    """Median wall time of ``fn()`` over ``rounds`` runs, after one warm-up."""
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
