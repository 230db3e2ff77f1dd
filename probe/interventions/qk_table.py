"""The rows of ``qk_attribution``'s table: one head's terms formed a chunk of (query, key) pairs
at a time, each score's largest terms and the rest, the per-score summary (``attrs["scores"]``),
and ``qk_means``, the terms averaged over a task's positions with intervals over inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pandas as pd
import torch

TOP_SHARE = 10  # the share of the score the ten largest terms sum to
SAMPLE = 20  # sources of each side whose terms bound the largest from below (pruned_largest;
# of 16, 20, 24 and 28, 20 took the least time on MiniLM, measured)
# Scores of at least this many terms have their largest found by pruned_largest (on MiniLM's
# layers, measured: half the time of forming every term from 2,809 terms, twice it at 1,369)
PRUNE_FROM = 2_000
BOUND_SLACK = 1e-4  # relative: |q_a| |k_b| computed in float may fall a rounding below |q_a · k_b|


@dataclass
class Layer:
    """What one layer's terms are formed from and into."""

    layer: int
    q_ref: torch.Tensor  # the captured queries and keys (rotated), for the score itself
    k_ref: torch.Tensor
    captured: torch.Tensor  # hook_attn_scores
    scaling: float
    kv_head: torch.Tensor
    q_names: list[str]
    k_names: list[str]
    q_codes: torch.Tensor
    k_codes: torch.Tensor
    names: dict[str, int]
    top: int | None
    position_bias: torch.Tensor | None
    rows: list = field(default_factory=list)
    scores: list = field(default_factory=list)


def head_terms(at: Layer, head, Q, K, pairs, q_at, k_at, chunk) -> None:
    """One head's terms, ``chunk`` pairs at a time, from its queries' and keys' parts ``Q``
    ``[rows, Sq, d_head]`` (times the attention's scaling) and ``K`` (``q_at``, ``k_at``: each
    pair's rows in them)."""
    device = Q.device
    Sq, Sk = Q.shape[1], K.shape[1]
    n_terms = Sq * Sk + (at.position_bias is not None)
    n = max(at.top or 0, TOP_SHARE)
    for first in range(0, len(pairs[0]), chunk):
        part = slice(first, first + chunk)
        cb, ci, cj = (t[part] for t in pairs)
        db, di, dj = (t.to(device) for t in (cb, ci, cj))
        q = Q.index_select(0, q_at[part].to(device))  # [pairs, Sq, d_head], contiguous
        k = K.index_select(0, k_at[part].to(device))
        # The query and key the model computed (the query times the scaling, as its parts)
        q_whole = at.q_ref[db, di, head] * at.scaling  # [pairs, d_head]
        k_whole = at.k_ref[db, dj, at.kv_head[head]]
        # A side's sources with the other side whole: [pairs, Sq] and [pairs, Sk]
        # (vecdot: a third of bmm's time for these [d_head] x [d_head, 1] products, measured)
        sides = (torch.linalg.vecdot(q, k_whole[:, None]), torch.linalg.vecdot(k, q_whole[:, None]))
        score = (q_whole * k_whole).sum(-1)
        bias = None
        if at.position_bias is not None:
            bias = at.position_bias[di, dj, head]
            score = score + bias
        total = sides[0].sum(1) + (0 if bias is None else bias)  # every term, summed (to rounding)
        pruned = at.top and at.top < n_terms and Sq * Sk >= PRUNE_FROM
        if pruned:  # the largest terms, found without forming the others
            values, index = pruned_largest(q, k, n, bias)
        else:  # every term: [pairs, Sq * Sk (+1)]
            flat = torch.bmm(q, k.transpose(1, 2)).flatten(1)
            if bias is not None:
                flat = torch.cat([flat, bias[:, None]], dim=1)
            index = largest_terms(flat.abs(), Sq, Sk, n).indices
            values = flat.gather(1, index)
        if at.top and at.top < n_terms:  # the largest terms and the rest, in one row
            rows = torch.cat(
                [values[:, : at.top], (total - values[:, : at.top].sum(1))[:, None]], 1
            )
            at_rows = torch.cat([index[:, : at.top], torch.full_like(index[:, :1], -1)], 1)
        else:
            rows, at_rows = flat, torch.arange(n_terms, device=device).expand_as(flat)
        at.rows.append(table_rows(rows, at_rows, at.q_codes, at.k_codes, at.names, Sk, at.layer,
                                  head, cb, ci, cj))  # fmt: skip
        share = values[:, :TOP_SHARE].sum(1) / total
        captured = at.captured[db, head, di, dj]
        at.scores.append(score_rows(sides, share, score, captured, at.q_names, at.k_names,
                                    at.layer, head, cb, ci, cj))  # fmt: skip


def pruned_largest(q, k, n, bias=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n`` largest terms q_a · k_b (by magnitude) of each score, signed, largest first
    ``[pairs, n]``, and their indices into the score's flattened terms (``a * Sk + b``; ``Sq *
    Sk`` for ``bias``, the position bias, a term of its own), as ``torch.topk`` of every term
    would find them, from the parts ``q`` ``[pairs, Sq, d_head]`` and ``k`` ``[pairs, Sk,
    d_head]``, without forming every term.

    |q_a · k_b| ≤ |q_a| |k_b|. The terms of the ``SAMPLE`` sources with the largest norms on
    each side (the sample) give a lower bound t of the n-th largest term; only the (a, b) whose
    bound |q_a| |k_b| reaches t can be among the n largest. Most of those lie in the sample,
    whose terms are formed already; only the others are formed (on MiniLM's last layer about
    13 a score, of its 7,225 terms), and the n largest are found among them and the sample's n
    largest.
    """
    P, Sq, d = q.shape
    Sk = k.shape[1]
    nq, nk = q.norm(dim=2), k.norm(dim=2)  # [pairs, Sq], [pairs, Sk]
    R, C = min(Sq, SAMPLE), min(Sk, SAMPLE)
    q_rows, k_rows = q.reshape(P * Sq, d), k.reshape(P * Sk, d)  # index_select, not indexing
    first = torch.arange(P, device=q.device)[:, None]
    top_q, top_k = nq.topk(R, dim=1).indices, nk.topk(C, dim=1).indices  # [pairs, R], [pairs, C]
    sample = torch.bmm(q_rows.index_select(0, (top_q + first * Sq).flatten()).view(P, R, d),
                       k_rows.index_select(0, (top_k + first * Sk).flatten()).view(P, C, d)
                       .transpose(1, 2)).flatten(1)  # [pairs, R * C]  # fmt: skip
    best = sample.abs().topk(min(n, R * C), dim=1)
    at_sample = best.indices
    sample_index = top_q.gather(1, at_sample // C) * Sk + top_k.gather(1, at_sample % C)
    # t: the sample's n-th largest, lowered a little so that float rounding never leaves a
    # candidate out (0 where the sample holds fewer than n terms: every term a candidate)
    t = best.values[:, -1] * (1 - BOUND_SLACK) if n <= R * C else torch.zeros_like(nq[:, 0])
    # The candidates, found row by row among the key sides sorted by norm (row a holds the
    # first count[a] of them), less those in the sample. Nothing the size of every term is
    # formed.
    nk_sorted, order = nk.sort(dim=1, descending=True)
    need = torch.where(t[:, None] > 0, t[:, None] / nq, 0.0)  # |k_b| a candidate needs, [P, Sq]
    count = (Sk - torch.searchsorted(nk_sorted.flip(1).contiguous(), need)).flatten()
    row = torch.arange(P * Sq, device=q.device).repeat_interleave(count)  # p * Sq + a
    p = row // Sq
    rank = torch.arange(len(row), device=q.device) - (count.cumsum(0) - count).index_select(0, row)
    key = p * Sk + order.flatten().index_select(0, p * Sk + rank)  # p * Sk + b
    in_q = torch.zeros(P, Sq, dtype=torch.bool, device=q.device).scatter_(1, top_q, True)
    in_k = torch.zeros(P, Sk, dtype=torch.bool, device=q.device).scatter_(1, top_k, True)
    outside = ~(in_q.flatten().index_select(0, row) & in_k.flatten().index_select(0, key))
    row, key, p = row[outside], key[outside], p[outside]
    terms = torch.linalg.vecdot(q_rows.index_select(0, row), k_rows.index_select(0, key))
    counts = torch.bincount(p, minlength=P)
    at = torch.arange(len(p), device=q.device) - (counts.cumsum(0) - counts)[p]
    width = int(counts.max()) if len(p) else 0
    # The sample's largest, the candidates outside it (padded) and the bias: [pairs, columns]
    head = best.values.shape[1]
    value = torch.zeros(P, head + width + (bias is not None), dtype=q.dtype, device=q.device)
    magnitude = torch.full_like(value, -1.0)  # below any term: padding is never chosen
    index = torch.zeros(value.shape, dtype=torch.long, device=q.device)
    value[:, :head] = sample.gather(1, at_sample)
    magnitude[:, :head], index[:, :head] = best.values, sample_index
    at = at + head
    value[p, at], magnitude[p, at] = terms, terms.abs()
    index[p, at] = (row - p * Sq) * Sk + key - p * Sk
    if bias is not None:
        value[:, -1], magnitude[:, -1], index[:, -1] = bias, bias.abs(), Sq * Sk
    found = magnitude.topk(min(n, value.shape[1]), dim=1).indices
    return value.gather(1, found), index.gather(1, found)


class Largest(NamedTuple):
    values: torch.Tensor  # [pairs, k], largest first
    indices: torch.Tensor  # [pairs, k], into a score's flattened terms


def largest_terms(magnitude: torch.Tensor, Sq: int, Sk: int, k: int) -> Largest:
    """The ``k`` largest of each row of ``magnitude`` ``[pairs, Sq * Sk (+ extra)]``, as
    ``torch.topk`` gives them, found among the terms of the ``k`` query sources whose largest
    term is largest (and the extra columns): a term among the k largest lies in one of those
    rows, since a row whose largest term is smaller than k other rows' holds no term above them.
    One pass of ``amax`` and a ``topk`` of k · Sk in place of a ``topk`` of Sq · Sk."""
    k = min(k, magnitude.shape[1])
    rows = min(k, Sq)
    if rows * Sk + magnitude.shape[1] - Sq * Sk >= magnitude.shape[1]:  # nothing to skip
        found = magnitude.topk(k, dim=1)
        return Largest(found.values, found.indices)
    P = magnitude.shape[0]
    grid = magnitude[:, : Sq * Sk].view(P, Sq, Sk)
    top_rows = grid.amax(2).topk(rows, dim=1).indices  # [pairs, rows]
    candidates = grid.gather(1, top_rows.unsqueeze(-1).expand(P, rows, Sk)).flatten(1)
    extra = magnitude[:, Sq * Sk :]
    found = torch.cat([candidates, extra], dim=1).topk(k, dim=1)
    at = found.indices
    in_rows = at < rows * Sk
    flat = top_rows.gather(1, (at // Sk).clamp(max=rows - 1)) * Sk + at % Sk
    return Largest(found.values, torch.where(in_rows, flat, at - rows * Sk + Sq * Sk))


def table_rows(values, index, q_codes, k_codes, names, Sk, layer, head, b, i, j):
    """The table's rows of a chunk of scores: ``values`` ``[pairs, count]`` and each one's
    ``index`` into its score's flattened terms (``a * Sk + b``; ``Sq * Sk`` the position bias;
    -1 the rest)."""
    values, index = values.cpu(), index.cpu()  # the table's rows are numpy arrays
    P, count = values.shape
    pair_terms = q_codes.numel() * Sk
    index = index.reshape(-1)
    is_term = (index >= 0) & (index < pair_terms)
    q_src = torch.where(is_term, q_codes[(index.clamp(0, pair_terms - 1) // Sk)], -1)
    k_src = torch.where(is_term, k_codes[(index.clamp(0, pair_terms - 1) % Sk)], -1)
    if "pos_bias" in names:
        q_src = torch.where(index == pair_terms, names["pos_bias"], q_src)
        k_src = torch.where(index == pair_terms, names["pos_bias"], k_src)
    if "rest" in names:
        q_src = torch.where(index < 0, names["rest"], q_src)
        k_src = torch.where(index < 0, names["rest"], k_src)
    return {
        "input": b.repeat_interleave(count).numpy(),
        "layer": np.full(P * count, layer),
        "head": np.full(P * count, head),
        "query_pos": i.repeat_interleave(count).numpy(),
        "key_pos": j.repeat_interleave(count).numpy(),
        "query_source": q_src.numpy(),
        "key_source": k_src.numpy(),
        "contribution": values.reshape(-1).numpy(),
    }


def score_rows(sides, share, score, captured, q_names, k_names, layer, head, b, i, j):
    """The rows of ``attrs["scores"]`` of a chunk of scores, as columns (one DataFrame is made
    of every chunk's at the end)."""
    query_side, key_side = sides  # [pairs, Sq], [pairs, Sk]
    qv, qa = query_side.max(1)
    kv, ka = key_side.max(1)
    return {
        "input": b.numpy(), "layer": np.full(len(b), layer), "head": np.full(len(b), head),
        "query_pos": i.numpy(), "key_pos": j.numpy(), "score": score.cpu().numpy(),
        "captured": captured.float().cpu().numpy(),
        "top10_share": share.cpu().numpy(),
        "query_top": np.array(q_names, dtype=object)[qa.cpu().numpy()],
        "query_top_contribution": qv.cpu().numpy(),
        "key_top": np.array(k_names, dtype=object)[ka.cpu().numpy()],
        "key_top_contribution": kv.cpu().numpy(),
    }  # fmt: skip


def qk_means(terms: pd.DataFrame, side: str | None = None) -> pd.DataFrame:
    """The terms of ``qk_attribution`` averaged over the positions asked for, with 95%
    t-intervals over inputs: each input's mean over its scores first (so that an input with
    more positions counts once), then the mean over inputs.

    Parameters
    ----------
    terms : pandas.DataFrame
        ``qk_attribution``'s table, e.g. at the induction positions of a batch of repeated
        sequences.
    side : {None, "query", "key"}
        None: one row per (query source, key source). ``"key"``: each key source's terms summed
        over the query sources first (what it gives the score through the key, the query
        whole); ``"query"`` the other way round.

    Returns
    -------
    pandas.DataFrame
        ``layer``, ``head``, the source column(s), ``mean``, ``low``, ``high`` (the 95%
        t-interval over inputs; NaN for one input) and ``inputs``, largest means first within
        each head.
    """
    from probe.inference import t975

    if side not in (None, "query", "key"):
        raise ValueError(f"side must be None, 'query' or 'key', not {side!r}")
    score = ["input", "layer", "head", "query_pos", "key_pos"]
    sources = ["query_source", "key_source"] if side is None else [f"{side}_source"]
    per_score = terms.groupby(score + sources, observed=True).contribution.sum().reset_index()
    # A source absent from a score (top) counts 0 there: mean over every score of the input.
    counts = terms.groupby(["input", "layer", "head"]).apply(
        lambda g: len(g.drop_duplicates(["query_pos", "key_pos"])), include_groups=False
    )
    per_input = per_score.groupby(["input", "layer", "head", *sources], observed=True)
    per_input = (per_input.contribution.sum() / counts).dropna().rename("value").reset_index()
    # Inputs x sources: an input where a source has no row counts 0 for it.
    wide = per_input.pivot_table(
        index=["layer", "head", *sources], columns="input", values="value", fill_value=0.0,
        observed=True,
    )  # fmt: skip
    values = wide.to_numpy(dtype=np.float64)
    n = values.shape[1]
    out = wide.index.to_frame(index=False)
    out["mean"] = values.mean(1)
    half = t975(n - 1) * values.std(1, ddof=1) / np.sqrt(n) if n > 1 else np.nan
    out["low"], out["high"], out["inputs"] = out["mean"] - half, out["mean"] + half, n
    out = out.sort_values(["layer", "head", "mean"], ascending=[True, True, False])
    return out[["layer", "head", *sources, "mean", "low", "high", "inputs"]].reset_index(drop=True)
