"""Weight circuits: the spectra of every head's W_i^QK = W_i^Q W_i^Kᵀ and W_i^OV = W_i^V W_i^O.

Both are d_model x d_model but products of d_model x d_head factors, so of rank <= d_head. Their
singular values come from the factors: with A = Q_A R_A and B = Q_B R_B (thin QR), A Bᵀ =
Q_A (R_A R_Bᵀ) Q_Bᵀ has the singular values of the d_head x d_head core R_A R_Bᵀ. That costs
O(d_model·d_head²) per head instead of the O(d_model³) of an SVD of the formed product.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import pandas as pd
import torch
from torch import nn

from probe.attention import MultiHeadAttention
from probe.capture.head_weights import HeadWeights, iter_head_weights
from probe.capture.names import Attention, Stack
from probe.capture.spec import describe

COLUMNS = [
    "layer",
    "head",
    "circuit",
    "d_model",
    "d_head",
    "singular_values",
    "numerical_rank",
    "effective_rank",
    "stable_rank",
    "symmetry",
    "params_factored",
    "params_full",
]


@torch.no_grad()
def factored_spectrum(A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Singular values of A Bᵀ, and tr((A Bᵀ)²), without forming A Bᵀ.

    Parameters
    ----------
    A, B : ``[..., d_model, d_head]``
        Batched thin factors (e.g. one per head).

    Returns
    -------
    sigma : ``[..., d_head]`` float64, descending
    trace_square : ``[...]`` float64, tr(A Bᵀ A Bᵀ) = tr((Bᵀ A)²), for the symmetry
    """
    A, B = A.double(), B.double()
    R_A = torch.linalg.qr(A, mode="r").R
    R_B = torch.linalg.qr(B, mode="r").R
    sigma = torch.linalg.svdvals(R_A @ R_B.transpose(-1, -2))
    BtA = B.transpose(-1, -2) @ A
    trace_square = (BtA * BtA.transpose(-1, -2)).sum((-1, -2))
    return sigma, trace_square


def _layer_rows(layer: int, w: HeadWeights) -> list[dict]:
    d_model, d_head = w.W_Q.shape[1], w.W_Q.shape[2]
    W_K = w.W_K[w.kv_head]  # grouped-query attention: each query head's K/V head
    W_V = w.W_V[w.kv_head]
    circuits = {
        "QK": factored_spectrum(w.W_Q, W_K),
        "OV": factored_spectrum(W_V, w.W_O.transpose(1, 2)),
    }
    eps = np.finfo(np.float64).eps
    rows = []
    for circuit, (sigma, trace_square) in circuits.items():
        for head in range(w.n_heads):
            s = sigma[head].cpu().numpy()
            top = s[0] if s.size else 0.0
            frobenius_sq = float((s**2).sum())
            p = s[s > 0] / s.sum() if top > 0 else np.array([1.0])
            rows.append(
                {
                    "layer": layer,
                    "head": head,
                    "circuit": circuit,
                    "d_model": d_model,
                    "d_head": d_head,
                    "singular_values": s,
                    "numerical_rank": int((s > max(d_model, d_head) * eps * top).sum()),
                    "effective_rank": float(np.exp(-(p * np.log(p)).sum())) if top > 0 else 0.0,
                    "stable_rank": frobenius_sq / top**2 if top > 0 else 0.0,
                    "symmetry": (
                        0.5 * (1 + float(trace_square[head]) / frobenius_sq)
                        if circuit == "QK" and frobenius_sq > 0
                        else math.nan
                    ),
                    "params_factored": 2 * d_model * d_head,
                    "params_full": d_model * d_model,
                }
            )
    return rows


def spectra(model: nn.Module | Iterable[HeadWeights]) -> pd.DataFrame:
    """The QK and OV spectra of every head, computed from the factors in float64.

    QK is W_i^Q W_i^Kᵀ and OV is W_i^V W_i^O, weights only: biases and the 1/√d_head scale of
    the scores are not included.

    Parameters
    ----------
    model : probe.MultiHeadAttention, Hugging Face model, or iterable of HeadWeights
        A bare module counts as layer 0. Grouped-query models pair each query head with its
        shared K/V head.

    Returns
    -------
    pandas.DataFrame
        One row per (layer, head, circuit), 0-based, with ``singular_values`` (descending, at
        most d_head values), ``numerical_rank`` (σ > max(d_model, d_head)·eps·σ_max, as
        ``numpy.linalg.matrix_rank``), ``effective_rank`` (Roy & Vetterli 2007: exp of the
        entropy of σ/Σσ), ``stable_rank`` (‖W‖_F² / σ_max²), ``symmetry`` (QK only:
        ‖(W + Wᵀ)/2‖_F² / ‖W‖_F², 1 symmetric, 0.5 unrelated, 0 antisymmetric), and the
        parameter counts of the factored form (2·d_model·d_head) and of a full matrix.
        For an encoder-decoder model, every attention, named in two more columns first:
        ``attention`` (``encoder.attn``, ``decoder.attn``, ``decoder.cross_attn``) and
        ``keys_from``, the stream its W_K and W_V read (``encoder`` for cross-attention, whose
        QK circuit pairs the decoder's queries with the encoder's keys).
    """
    if getattr(model, "config", None) is not None and describe(model).encoder_decoder:
        tables = [
            spectra(iter_head_weights(model, name)).assign(
                attention=name,
                keys_from=(Stack.ENCODER if name == Attention.CROSS else name.stack).value,
            )
            for name in (Attention(a.name) for a in describe(model).attentions)
        ]
        return pd.concat(tables, ignore_index=True)[["attention", "keys_from", *COLUMNS]]
    if isinstance(model, MultiHeadAttention):
        n = model.n_heads
        layers: Iterable[HeadWeights] = [
            HeadWeights(
                model.W_Q, model.W_K, model.W_V, model.W_O,
                model.b_Q, model.b_K, model.b_V, model.b_O, torch.arange(n),
            )
        ]  # fmt: skip
    elif isinstance(model, nn.Module):
        layers = iter_head_weights(model)
    else:
        layers = model
    rows = [row for layer, w in enumerate(layers) for row in _layer_rows(layer, w)]
    return pd.DataFrame(rows, columns=COLUMNS)
