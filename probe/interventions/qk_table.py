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

TOP_SHARE = 10  # the share of |terms| the ten largest hold, per score


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
    ``[rows, Sq, d_head]`` and ``K`` (``q_at``, ``k_at``: each pair's rows in them)."""
    device = Q.device
    for first in range(0, len(pairs[0]), chunk):
        part = slice(first, first + chunk)
        cb, ci, cj = (t[part] for t in pairs)
        db, di, dj = (t.to(device) for t in (cb, ci, cj))
        # [pairs, Sq, d_head], the scaling on the query side (d_head / Sk times fewer products)
        q = Q.index_select(0, q_at[part].to(device)).mul_(at.scaling)
        k = K.index_select(0, k_at[part].to(device))
        terms = torch.bmm(q, k.transpose(1, 2))  # [pairs, Sq, Sk]
        # A side's sources with the other side whole: [pairs, Sq] and [pairs, Sk], from the
        # parts (a sum over d_head, not over the other side's terms)
        sides = (torch.bmm(q, k.sum(1).unsqueeze(-1)).squeeze(-1),
                 torch.bmm(k, q.sum(1).unsqueeze(-1)).squeeze(-1))  # fmt: skip
        flat = terms.flatten(1)  # [pairs, Sq * Sk]: the terms of each score
        score = (at.q_ref[db, di, head] * at.k_ref[db, dj, at.kv_head[head]]).sum(-1)
        score = score * at.scaling
        if at.position_bias is not None:
            bias = at.position_bias[di, dj, head]
            flat = torch.cat([flat, bias[:, None]], dim=1)
            score = score + bias
        magnitude = flat.abs()
        largest = largest_terms(
            magnitude, terms.shape[1], terms.shape[2], max(at.top or 0, TOP_SHARE)
        )
        at.rows.append(table_rows(flat, at.top, largest, at.q_codes, at.k_codes, at.names,
                             len(at.k_names), at.layer, head, cb, ci, cj))  # fmt: skip
        at.scores.append(score_rows(sides, magnitude, largest, score, at.captured[db, head, di, dj],
                                 at.q_names, at.k_names, at.layer, head, cb, ci, cj))  # fmt: skip


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


def table_rows(flat, top, largest, q_codes, k_codes, names, Sk, layer, head, b, i, j):
    flat = flat.cpu()  # the table's rows are numpy arrays
    P, n = flat.shape
    pair_terms = q_codes.numel() * Sk
    index = torch.arange(n).expand(P, n)
    values = flat
    if top and top < n:
        order = largest.indices[:, :top].cpu()
        values = flat.gather(1, order)
        rest = flat.sum(1, keepdim=True) - values.sum(1, keepdim=True)
        values = torch.cat([values, rest], dim=1)
        index = torch.cat([order, torch.full((P, 1), -1)], dim=1)
    count = values.shape[1]
    index = index.reshape(-1).cpu()
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
        "contribution": values.reshape(-1).cpu().numpy(),
    }


def score_rows(sides, magnitude, largest, score, captured, q_names, k_names, layer, head, b, i, j):
    share = largest.values[:, :TOP_SHARE].sum(1)
    share = share / magnitude.sum(1).clamp_min(torch.finfo(magnitude.dtype).tiny)
    query_side, key_side = sides  # [pairs, Sq], [pairs, Sk]
    qv, qa = query_side.max(1)
    kv, ka = key_side.max(1)
    return pd.DataFrame({
        "input": b.numpy(), "layer": layer, "head": head, "query_pos": i.numpy(),
        "key_pos": j.numpy(), "score": score.cpu().numpy(),
        "captured": captured.float().cpu().numpy(),
        "top10_share": share.cpu().numpy(),
        "query_top": np.array(q_names, dtype=object)[qa.cpu().numpy()],
        "query_top_contribution": qv.cpu().numpy(),
        "key_top": np.array(k_names, dtype=object)[ka.cpu().numpy()],
        "key_top_contribution": kv.cpu().numpy(),
    })  # fmt: skip


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
