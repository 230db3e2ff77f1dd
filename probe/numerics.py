"""Entropy and Jensen-Shannon divergence of attention distributions, the one implementation
every analysis, ``probe compare`` and ``probe experiment`` use.

Both work on the last axis, in nats, with 0 log 0 = 0, and in the dtype they are given (float32
attention stays float32; callers that want float64 sums convert first or after).
"""

from __future__ import annotations

import math

from probe.lazy import lazy

torch = lazy("torch")  # imported when first used: analyses import this before torch is needed

# Numbers in one block of the pairwise divergence's work space: 512 KiB of float32, which stays in
# a core's cache and below the allocator's mmap threshold (``probe.pipeline.runner``); blocks of a
# few MiB run three times slower, mostly in page faults.
JS_BLOCK = 2**17


def entropy(p: torch.Tensor) -> torch.Tensor:
    """Shannon entropy -Σ p log p (nats) of the distributions along the last axis.

    Zero weights add nothing (0 log 0 = 0). Weights are clamped to the dtype's smallest normal
    number before the logarithm, which is faster than ``torch.xlogy`` and changes only
    subnormal weights, whose terms are far below the dtype's resolution. Rows need not sum to
    1: the result is -Σ p log p whatever their mass.

    Parameters
    ----------
    p : torch.Tensor
        ``[..., k]``, non-negative.

    Returns
    -------
    torch.Tensor
        ``[...]``, in ``p``'s dtype and on its device.
    """
    terms = p.clamp(min=torch.finfo(p.dtype).tiny).log_().mul_(p)  # one work space, in place
    return -terms.sum(-1)


def pairwise_js(
    p: torch.Tensor, q: torch.Tensor | None = None, *, block: int = JS_BLOCK
) -> torch.Tensor:
    """Jensen-Shannon divergence between every distribution of ``p`` and every one of ``q`` on
    the same queries, summed over the queries.

    JS(a, b) = H(m) - (H(a) + H(b)) / 2 with m = (a + b) / 2 (nats; 0 for equal
    distributions, ln 2 for disjoint ones), the square of
    ``scipy.spatial.distance.jensenshannon``. With s = a + b,
    H(m) = (-Σ s log s + ln 2 · Σ s) / 2, which spares a pass over each pair; rows that do not
    sum to 1 (float32 rounding) are thus measured exactly as written. Pairs are taken a block
    at a time, so the work space stays at two blocks of ``block`` numbers (s, and its
    logarithm) whatever the number of distributions, queries and outcomes.

    Parameters
    ----------
    p : torch.Tensor
        ``[A, n, k]``: A distributions (e.g. heads) on each of n queries, over k outcomes.
    q : torch.Tensor, optional
        ``[B, n, k]``, in ``p``'s dtype and on its device. Without it, ``p`` against itself:
        JS is symmetric, so only the pairs a < b are computed, and the diagonal is 0.
    block : int
        Numbers in one block of the work space (at least one pair is taken at a time).

    Returns
    -------
    torch.Tensor
        ``[A, B]`` (``[A, A]`` without ``q``): Σ over the n queries of JS(p[a, i], q[b, i]),
        in ``p``'s dtype and on its device. Divide by n for the mean.
    """
    A, n, k = p.shape
    if q is None:
        first, second = torch.triu_indices(A, A, offset=1, device=p.device)
        other, B = p, A
    else:
        B = q.shape[0]
        first = torch.arange(A, device=p.device).repeat_interleave(B)
        second = torch.arange(B, device=p.device).repeat(A)
        other = q
    out = p.new_zeros(A, B)
    step = max(1, block // max(n * k, 1))
    if step == 1:  # long rows: one distribution or pair at a time, in two work spaces made once
        s, work = p.new_empty(n, k), p.new_empty(n, k)
        own_p, mass_p = torch.stack([_entropy(d, work) for d in p]), p.sum(-1)
        own_q, mass_q = (own_p, mass_p) if q is None else (
            torch.stack([_entropy(d, work) for d in q]), q.sum(-1))  # fmt: skip
        first, second = first.tolist(), second.tolist()
        parts = [_entropy(torch.add(p[a], other[b], out=s), work)
                 for a, b in zip(first, second, strict=True)]  # fmt: skip
        return _add_pairs(out, first, second, torch.stack(parts), own_p, mass_p, own_q, mass_q,
                          q is None)  # fmt: skip
    own_p, mass_p = entropy(p), p.sum(-1)  # [A, n]
    own_q, mass_q = (own_p, mass_p) if q is None else (entropy(q), q.sum(-1))
    for start in range(0, len(first), step):
        a, b = first[start : start + step], second[start : start + step]
        s = p.index_select(0, a)  # [pairs, n, k]
        s += other.index_select(0, b)
        _add_pairs(out, a, b, entropy(s), own_p, mass_p, own_q, mass_q, q is None)
    return out


def _entropy(p: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
    """``entropy(p)``, number for number, with ``work`` (p's shape) as its work space."""
    torch.clamp(p, min=torch.finfo(p.dtype).tiny, out=work)
    return -work.log_().mul_(p).sum(-1)


def _add_pairs(
    out: torch.Tensor,
    a: torch.Tensor | list[int],
    b: torch.Tensor | list[int],
    mixed_entropy: torch.Tensor,
    own_p: torch.Tensor,
    mass_p: torch.Tensor,
    own_q: torch.Tensor,
    mass_q: torch.Tensor,
    symmetric: bool,
) -> torch.Tensor:
    """Write into ``out`` the Σ over queries of JS for the pairs (a[i], b[i]), from the entropy
    of each pair's sum on each query, ``[pairs, n]``."""
    mixed = (mixed_entropy + math.log(2) * (mass_p[a] + mass_q[b])) / 2
    pairs = (mixed - (own_p[a] + own_q[b]) / 2).sum(-1)
    flat = out.view(-1)
    a, b = torch.as_tensor(a, device=out.device), torch.as_tensor(b, device=out.device)
    flat.index_copy_(0, a * out.shape[1] + b, pairs)
    if symmetric:
        flat.index_copy_(0, b * out.shape[1] + a, pairs)
    return out
