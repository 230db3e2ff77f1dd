"""Each member's share of a group's joint effect: the Shapley value over the group, exact for a
small group, else over a few keyed orderings drawn afresh for each input.

A group of heads ablated together changes the output by v(G); each head's share is its Shapley
value, the mean over orderings of the group of v(before ∪ {head}) − v(before), ``before`` the
heads ahead of it in the ordering and v(∅) = 0. The shares sum to v(G) (on each ordering the
marginal changes telescope to it), so a head that does nothing, with or without the others
(a decoy whose W_O is zero), gets exactly 0, and heads that stand in for each other share the
effect that none of them shows alone. Exact over every subset for at most ``EXACT`` members
(2^n − n − 1 joint ablations an input: 11 for four). Above, over ``ORDERINGS`` orderings an
input (n − 2 joint ablations each, and the whole group: 17 for six members, against 57 for the
exact value), half of them drawn by a key of the seed, the group and the input, the other half
their reverses (antithetic: a member early in one is late in the other, which cancels much of a
drawn ordering's luck). Each input's shares still sum to its v(G), and are an unbiased estimate
of its exact shares; as every input draws its own orderings, the mean over inputs averages
over many orderings, and the interval over inputs carries the sampling's spread with the
inputs'.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from itertools import combinations

import numpy as np

from probe.keys import uniform

EXACT = 4  # members up to which the Shapley value is computed over every subset
ORDERINGS = 4  # orderings an input for a larger group: half drawn, half their reverses


def method(n: int) -> str:
    """How the shares of a group of ``n`` are computed, in words for a table."""
    if n <= EXACT:
        return "exact Shapley"
    return f"Shapley over {ORDERINGS} keyed orderings an input (antithetic)"


def orderings(n: int, seed: int, name: str, index: int) -> list[tuple[int, ...]] | None:
    """The orderings of ``range(n)`` a group of more than ``EXACT`` members is averaged over on
    input ``index``: ``ORDERINGS // 2`` drawn by a key of ``seed``, ``name``, the input and
    the ordering's number (the same whatever else runs), each followed by its reverse; None for
    an exact group (every subset)."""
    if n <= EXACT:
        return None
    drawn = []
    for k in range(ORDERINGS // 2):
        keys = uniform(seed, f"shapley-{name}", np.full(n, index), np.full(n, k), np.arange(n))
        ordering = tuple(int(i) for i in np.argsort(keys, kind="stable"))
        drawn += [ordering, ordering[::-1]]
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
