"""How torch's threads wait for work, set for a run before torch starts, where the user has not.

OpenMP threads that have done their part of an operation wait for the next one by spinning (GNU
OpenMP, torch's on Linux: up to 300,000 spins) before they sleep. Alone on a machine, that saves
a wake-up; on a busy one, the spinning threads take the cores from the threads doing work, and
every operation waits for its slowest thread. A long input's analysis runs thousands of
operations per layer on its blocks of rows where the plain forward pass has one attention call,
so it pays that many times over: one 8k-token text (``benchmarks/long_context.py``, d_head 64,
4 layers, roles), with two other processes spinning on the two cores, took 8.4 s spinning and
4.2 s passive (the floor 3.0 s and 2.1 s). Alone, passive waiting cost it 5-8%. But on short
sentences, where each operation is small and a sleeping thread's wake-up is a large part of it,
passive waiting cost the main command (MiniLM, EWT dev, every analysis) a third of its analyses
stage (10.1 s against 7.6 s, quiet machine), and spinning costs it little on a busy machine.
So threads wait passively for long inputs (``LONG`` tokens or more a window) only.

The policy is read by the OpenMP runtime as torch loads it, so it is set before torch is
imported, and only where the user has set no policy of their own; ``run.json`` records what was
in effect (``in_effect``).
"""

from __future__ import annotations

import os
import sys

POLICY = "OMP_WAIT_POLICY"
PASSIVE = "PASSIVE"
LONG = 4096  # tokens a window, from which threads wait passively
_set_here = False


def settle(tokens: int | None) -> None:
    """For inputs of ``tokens`` tokens a window (None: sentences), make this process's OpenMP
    threads (and its children's) sleep while they wait where the inputs are long, unless the
    user chose a policy or torch has already started (then it is too late to change)."""
    global _set_here
    long = tokens is not None and tokens >= LONG
    if long and POLICY not in os.environ and "torch" not in sys.modules:
        os.environ[POLICY] = PASSIVE
        _set_here = True


def in_effect() -> dict[str, object]:
    """What the run's threads ran under, for ``run.json``: torch's thread count, the wait policy
    (None: the runtime's default, spinning) and whether probe set it."""
    import torch

    return {
        "torch_threads": torch.get_num_threads(),
        "wait_policy": os.environ.get(POLICY),
        "wait_policy_set_by_probe": _set_here,
    }
