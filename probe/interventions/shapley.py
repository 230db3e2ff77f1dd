"""Each member's share of a group's joint effect: the Shapley value over the group, exact for a
small group, else over a bounded keyed sample of orderings.

A group of heads ablated together changes the output by v(G); each head's share is its Shapley
value, the mean over orderings of the group of v(before ∪ {head}) − v(before), ``before`` the
heads ahead of it in the ordering and v(∅) = 0. The shares sum to v(G) (on each ordering the
marginal changes telescope to it), so a head that does nothing, with or without the others
(a decoy whose W_O is zero), gets exactly 0, and heads that stand in for each other share the
effect that none of them shows alone. Exact over every subset for at most ``EXACT`` members
(2^n − 1 ablations); above, over ``ORDERINGS`` orderings drawn by a key of the seed (n ·
``ORDERINGS`` ablations at most): still summing to v(G), their spread an estimate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from itertools import combinations

import numpy as np

from probe.keys import uniform

EXACT = 6  # members up to which the Shapley value is computed over every subset
ORDERINGS = 32  # orderings drawn for a larger group


def method(n: int) -> str:
    """How the shares of a group of ``n`` are computed, in words for a table."""
    return "exact Shapley" if n <= EXACT else f"Shapley over {ORDERINGS} keyed orderings"


def orderings(n: int, seed: int, name: str) -> list[tuple[int, ...]] | None:
    """The orderings of ``range(n)`` a group of more than ``EXACT`` members is averaged over
    (``ORDERINGS`` of them, each drawn by a key of ``seed``, ``name`` and its number: the same
    whatever else runs); None for an exact group (every subset)."""
    if n <= EXACT:
        return None
    drawn = []
    for k in range(ORDERINGS):
        keys = uniform(seed, f"shapley-{name}", np.full(n, k), np.arange(n))
        drawn.append(tuple(int(i) for i in np.argsort(keys, kind="stable")))
    return drawn


def subsets(n: int, ordering: list[tuple[int, ...]] | None) -> list[frozenset[int]]:
    """The subsets of ``range(n)`` (member numbers) whose joint effect the shares need, of two
    members or more (v(∅) = 0; single members are ablated alone anyway), the whole group
    last: every one for an exact group, else each drawn ordering's prefixes."""
    if ordering is None:
        found = [frozenset(c) for size in range(2, n + 1) for c in combinations(range(n), size)]
    else:
        found = list(dict.fromkeys(frozenset(o[:k]) for o in ordering for k in range(2, n + 1)))
    whole = frozenset(range(n))
    return [s for s in found if s != whole] + [whole]


def shares(
    n: int, value: Callable[[frozenset[int]], float], ordering: list[tuple[int, ...]] | None
) -> list[float]:
    """Each member's Shapley share of v(whole group), from ``value(subset)`` (v of any subset
    ``subsets`` names or of a single member; v(∅) = 0): exact over every subset, or the mean
    over ``ordering``'s orderings of each member's marginal change.

    Returns
    -------
    list of float
        ``[n]``, summing to v(range(n)) up to float rounding.
    """

    def v(s: frozenset[int]) -> float:
        return 0.0 if not s else value(s)

    out = [0.0] * n
    if ordering is None:
        weight = {k: math.factorial(k) * math.factorial(n - k - 1) / math.factorial(n)
                  for k in range(n)}  # fmt: skip
        for i in range(n):
            rest = [j for j in range(n) if j != i]
            for size in range(n):
                for before in combinations(rest, size):
                    s = frozenset(before)
                    out[i] += weight[size] * (v(s | {i}) - v(s))
        return out
    for o in ordering:
        for k, i in enumerate(o):
            out[i] += (v(frozenset(o[: k + 1])) - v(frozenset(o[:k]))) / len(ordering)
    return out


def table_value(values: Mapping[Hashable, float], members: Sequence[Hashable]):
    """``value(subset)`` over a mapping from items to values: a single member's under its own
    key, a larger subset's under the tuple of its members (in ``members``' order)."""

    def value(s: frozenset[int]) -> float:
        chosen = [members[i] for i in sorted(s)]
        return values[chosen[0]] if len(chosen) == 1 else values[tuple(chosen)]

    return value
