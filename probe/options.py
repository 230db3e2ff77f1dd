"""Options declared once, where they are used: by an analysis (``Analysis.options``) or an input
unit (``Unit.options``). From the one declaration come the command line's option, its
validation and its line in ``run.json``. Also the sizes in bytes that options take, as people
write them (``512MiB``, ``4GiB``, ``2GB``): ``parse_size``.

Imports nothing heavy: the command line builds ``probe analyze`` from these before torch.
"""

from __future__ import annotations

import math
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
