"""Options declared once, where they are used: by an analysis (``Analysis.options``) or an input
unit (``Unit.options``). From the one declaration come the command line's option, its
validation and its line in ``run.json``. Also the sizes in bytes that options take, as people
write them (``512MiB``, ``4GiB``, ``2GB``): ``parse_size``. And sizes whose work cannot finish
in a day, or whose inputs cannot fit the machine, refused before they start: ``check_time``,
``check_memory``.

Imports nothing heavy: the command line builds ``probe analyze`` from these before torch.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from probe.errors import ProbeError


@dataclass(frozen=True)
class Option:
    """One setting of an analysis or unit.

    ``name`` is a Python identifier (``importance_sentences``); the command line spells it
    ``--importance-sentences``. Its type is its default's: ``int``, ``float``, ``str`` (then
    ``choices`` may list the values allowed) or ``bool`` (a flag).
    """

    name: str
    default: int | float | str | bool
    help: str
    min: float | None = None
    max: float | None = None
    choices: tuple[str, ...] | None = None
    # What the value must be beyond its type and range, checked when the run is planned: a
    # function of the typed value that raises ``ProbeError`` naming the flag (``None``: nothing).
    validate: Callable[[Any], Any] | None = None

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or self.name != self.name.lower():
            raise ValueError(f"option name {self.name!r} is not a lower-case identifier")
        if self.choices is not None and self.default not in self.choices:
            raise ValueError(f"option {self.name}: default {self.default!r} not in its choices")
        if self.default is not None:
            self.check(self.default)

    @property
    def type(self) -> type:
        return type(self.default)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def check(self, value: Any) -> Any:
        """``value`` as this option's type, or a ``ProbeError`` naming the flag and the range."""
        kind = self.type
        if kind is bool:
            if not isinstance(value, bool):
                raise ProbeError(f"{self.flag} is a flag: give it or leave it out")
            return value
        try:
            typed = kind(value)
        except (TypeError, ValueError):
            raise ProbeError(
                f"{self.flag} takes {'a whole number' if kind is int else kind.__name__}, "
                f"not {value!r}"
            ) from None
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ProbeError(f"{self.flag} takes a whole number, not {value!r}")
        if kind is float and not math.isfinite(typed):
            raise ProbeError(f"{self.flag} must be a finite number, not {value!r}")
        if self.choices is not None and typed not in self.choices:
            raise ProbeError(f"unknown {self.flag} {value!r}; use {self.range}")
        if (self.min is not None and typed < self.min) or (
            self.max is not None and typed > self.max
        ):
            raise ProbeError(f"{self.flag} must be {self.range}, not {value!r}")
        if self.validate is not None:
            self.validate(typed)
        return typed

    @property
    def range(self) -> str:
        """The values allowed, in words (``≥ 1``, ``between 0 and 1``, ``mean or zero``)."""
        if self.choices:
            *rest, last = self.choices
            return f"{', '.join(rest)} or {last}" if rest else last
        low, high = (_plain(x) for x in (self.min, self.max))
        if self.min is not None and self.max is not None:
            return f"between {low} and {high}"
        if self.min is not None:
            return f"≥ {low}"
        return f"≤ {high}" if self.max is not None else "any value"


def _plain(x: float | None) -> str:
    return str(int(x)) if x is not None and float(x).is_integer() else str(x)


def resolve(declared: Sequence[Option], given: Mapping[str, Any]) -> dict[str, Any]:
    """Every declared option's value: the one given (checked) or its default.

    Raises
    ------
    ProbeError
        For a value out of its option's range, or an option nothing declares.
    """
    known = {o.name: o for o in declared}
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ProbeError(f"unknown option {', '.join(unknown)}")
    return {
        name: option.check(given[name]) if given.get(name) is not None else option.default
        for name, option in known.items()
    }


# Bytes a block of attention rows may take, by default (``probe analyze --attention-budget``).
ATTENTION_BUDGET = "1GiB"
# Bytes the circuit tools may hold at once where the memory free on the model's device cannot be
# read (``probe.interventions.gradients.memory_budget``: a laptop's share), and the default of
# ``--circuit-max-bytes``.
MAX_BYTES = 1 << 30
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


# -- work that cannot finish ----------------------------------------------------------------
# A size refused before it starts: a lower bound on a run's time from its arithmetic alone, and on
# its memory from the inputs it holds at once. The time is a bound, not a forecast: the
# floating-point operations a size asks for (two per weight per token per forward pass,
# ``forward_flops``; a backward pass counts as two forwards), divided by a rate no machine of the
# kind reaches (``PEAK_CPU_CORE`` per core, ``PEAK_GPU`` per accelerator). A size refused as
# taking more than ``LIMIT_S`` so takes longer on any such machine; one allowed may still take
# hours (a small model's runs are not at their peak).

LIMIT_S = 86_400.0  # a day
# Rates above any machine's of the kind, so that the bound holds: a core's fp32 fused
# multiply-adds at 4 GHz on two AVX-512 units is 2.6e11 operations a second; an H200's dense
# bf16 tensor cores about 1e15.
PEAK_CPU_CORE = 3e11
PEAK_GPU = 2e15


def forward_flops(config: Any) -> float:
    """A lower bound on the operations of one token's forward pass: two per weight of the
    attention's query and output projections and of the MLP (the key and value projections,
    fewer under grouped queries, and the attention's own products left out)."""
    d = _field(config, "hidden_size", "n_embd", "d_model", "dim")
    layers = _field(config, "num_hidden_layers", "n_layer", "num_layers", "n_layers")
    mlp = _field(config, "intermediate_size", "n_inner", "ffn_dim", "d_ff", "hidden_dim") or 4 * d
    return 2.0 * layers * (2 * d * d + 2 * d * mlp)


def _field(config: Any, *names: str) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def peak_rate(device: Any = None) -> float:
    """Operations a second no machine of this kind exceeds: on ``device`` (a ``torch.device``
    or its name) where given; else its accelerators' where it has them, else its cores'."""
    kind = getattr(device, "type", str(device).split(":")[0]) if device is not None else None
    gpus = 0
    if kind in (None, "cuda"):
        try:
            import torch

            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        except (ImportError, RuntimeError):
            gpus = 0
    if kind == "cuda" or (kind is None and gpus):
        return max(1, gpus) * PEAK_GPU
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (cores or 1) * PEAK_CPU_CORE


def check_time(flag: str, value: int, flops: float, unit: float) -> None:
    """Refuse ``flag value`` where its ``flops`` take more than ``LIMIT_S`` at the machine's
    peak, naming the estimate and the most that fits (``unit``: the operations of one more).

    Raises
    ------
    ProbeError
        ``--circuit-pairs 1,000,000,000 needs at least 4.5e+17 floating-point operations: over
        13 days on this machine at its peak (6e+11 a second); use at most 76,000``.
    """
    rate = peak_rate()
    seconds = flops / rate
    if seconds <= LIMIT_S:
        return
    most = max(1, int(LIMIT_S * rate // max(unit, 1.0)))
    raise ProbeError(
        f"{flag} {value:,} needs at least {flops:.1e} floating-point operations: over "
        f"{_duration(seconds)} on this machine at its peak ({rate:.0e} a second); use at most "
        f"{_round_down(most):,}"
    )


def check_memory(flag: str, value: int, needed: float) -> None:
    """Refuse ``flag value`` where the inputs it holds at once (``needed`` bytes, a lower bound)
    exceed the machine's memory.

    Raises
    ------
    ProbeError
        Naming the flag, the bytes and the machine's.
    """
    total = physical_memory()
    if total is None or needed <= total:
        return
    most = max(1, int(value * total // needed))
    raise ProbeError(
        f"{flag} {value:,} holds at least {needed / 2**30:,.0f} GiB of inputs at once, more than "
        f"this machine's {total / 2**30:,.0f} GiB; use at most {_round_down(most):,}"
    )


def physical_memory() -> int | None:
    """The machine's memory in bytes, where the system says."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _duration(seconds: float) -> str:
    days = seconds / 86_400
    return f"{days:,.0f} days" if days < 3650 else f"{days / 365:,.0e} years"


def _round_down(n: int) -> int:
    """``n`` to two significant digits, down: a limit to type, not to the unit."""
    if n < 100:
        return n
    scale = 10 ** (int(math.log10(n)) - 1)
    return n // scale * scale
