"""How torch's threads wait for work, set for a run before torch starts, where the user has not.

OpenMP threads that have done their part of an operation wait for the next one by spinning (GNU
OpenMP, torch's on Linux: up to 300,000 spins) before they sleep. Alone on a machine, that saves
a wake-up; on a busy one, the spinning threads take the cores from the threads doing work, and
every operation waits for its slowest thread. Measured on 2 cores (``benchmarks/analyze.py``,
``benchmarks/long_context.py``), with two other processes spinning on them:

- the main command (MiniLM, EWT dev, every analysis) took 151 s spinning, 27 s passive (its
  floor, a plain process, 52 s); but alone, passive waiting cost its analyses stage 20-30%
  (9.1-9.2 s against 7.0-7.8 s): short sentences make small operations, and a sleeping thread's
  wake-up is a large part of each;
- one 8k-token text (d_head 64, 4 layers, roles) took 8.4 s spinning, 4.2 s passive; alone,
  passive cost it 5-8%: its blocks make fewer, larger operations.

So threads wait passively where the machine is busy as the run starts (a 1-minute load average
of at least the cores this process may use), and for long inputs (``LONG`` tokens a window or
more) always. The policy is read by the OpenMP runtime as torch loads it, so it is set before
torch is imported, and only where the user has set no policy of their own; ``run.json`` records
what was in effect and why (``in_effect``).
"""

from __future__ import annotations

import os
import sys

POLICY = "OMP_WAIT_POLICY"
PASSIVE = "PASSIVE"
LONG = 4096  # tokens a window, from which threads wait passively on any machine
_why: str | None = None  # why probe set the policy, where it did


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def settle(tokens: int | None) -> None:
    """For inputs of ``tokens`` tokens a window (None: sentences), make this process's OpenMP
    threads (and its children's) sleep while they wait, where the inputs are long or the machine
    is busy, unless the user chose a policy or torch has already started (then it is too late)."""
    global _why
    if POLICY in os.environ or "torch" in sys.modules:
        return
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if tokens is not None and tokens >= LONG:
        _why = f"windows of {tokens} tokens"
    elif load >= _cores():
        _why = f"a busy machine: load {load:.1f} on {_cores()} cores"
    else:
        return
    os.environ[POLICY] = PASSIVE


def in_effect() -> dict[str, object]:
    """What the run's threads ran under, for ``run.json``: torch's thread count, the wait policy
    (None: the runtime's default, spinning), and why probe set it (None: it did not)."""
    import torch

    return {
        "torch_threads": torch.get_num_threads(),
        "wait_policy": os.environ.get(POLICY),
        "wait_policy_set_by_probe": _why,
    }
