"""Sizes in bytes as people write them (``512MiB``, ``4GiB``, ``2GB``); imports nothing heavy,
so the run's plan checks them before torch is loaded."""

from __future__ import annotations

import re

from probe.errors import ProbeError

# Bytes a block of attention rows may take, by default (``probe analyze --attention-budget``).
ATTENTION_BUDGET = "1GiB"
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_size(text: str, flag: str = "--attention-budget") -> int:
    """Bytes in a size such as ``512MiB``, ``4GiB``, ``1.5GB`` or ``65536``.

    Raises
    ------
    ProbeError
        One line naming ``flag`` and the sizes it takes.
    """
    found = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = found and found.group(2).lower()
    if not found or unit not in _UNITS or float(found.group(1)) * _UNITS[unit] < 1:
        raise ProbeError(f"{flag} takes a size such as 512MiB, 4GiB or 2GB, not {text!r}")
    return int(float(found.group(1)) * _UNITS[unit])
