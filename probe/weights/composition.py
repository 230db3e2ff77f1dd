"""Composition scores from the weights (Elhage et al. 2021): how much of what head A writes head B
reads, through its query (Q), key (K) or value (V).

With the paper's row-vector circuits OV_A = W_V^A W_O^A and QK_B = W_Q^B W_K^Bᵀ (each d_model x
d_model), the scores are ‖W_A W_B‖_F / (‖W_A‖_F ‖W_B‖_F) with W_A = OV_A and W_B = QK_B (Q),
QK_Bᵀ (K) or OV_B (V), as TransformerLens's ``all_composition_scores``. Every product is a
d_model x d_model matrix of rank ≤ d_head, and its norm comes from d_head x d_head cores:
‖X C Y‖_F² = tr(Cᵀ (XᵀX) C (Y Yᵀ)) for X ``[d_model, d_head]`` and Y ``[d_head, d_model]``, so no
d_model x d_model matrix is formed.

A score means little alone: two random matrices of these shapes already score about
sqrt(d_head / d_model)-ish. Each score comes with its baseline, the mean score of random Gaussian
matrices of the same shapes.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable

import pandas as pd
import torch
from torch import nn

from probe.capture.architectures import architecture, blocks, norm_gain
from probe.capture.head_weights import HeadWeights, head_weights
from probe.errors import ProbeError

KINDS = ("Q", "K", "V")
COLUMNS = ["kind", "layer_from", "head_from", "layer_to", "head_to", "score", "baseline"]


@torch.no_grad()
def composition_scores(
    model: nn.Module | Iterable[HeadWeights],
    *,
    fold_ln: bool = True,
    samples: int = 100,
    seed: int = 0,
) -> pd.DataFrame:
    """Q-, K- and V-composition of every pair of heads in different layers.

    Parameters
    ----------
    model : transformers.PreTrainedModel, or an iterable of HeadWeights
        A supported decoder or encoder (one residual stream), or one ``HeadWeights`` per layer
        in order (``probe.head_weights``).
    fold_ln : bool
        In a pre-LayerNorm model, read the weights as the stream sees them (TransformerLens's
        ``fold_ln`` and ``center_writing_weights``): the norm before the attention scales each
        d_model coordinate of W_Q, W_K and W_V by its weight, and a LayerNorm (not an RMSNorm)
        centres what it reads, so these and W_O are centred over d_model. Post-LayerNorm models
        (BERT) and bare weights are scored as they are; ``attrs["folded"]`` says which.
    samples : int
        Random draws for each baseline.
    seed : int
        Seeds the baseline's draws.

    Returns
    -------
    pandas.DataFrame
        One row per kind (``Q``, ``K``, ``V``) and pair of heads with ``layer_from <
        layer_to``, 0-based: ``kind``, ``layer_from``, ``head_from``, ``layer_to``,
        ``head_to``, ``score`` and ``baseline``.
    """
    if isinstance(samples, bool) or not isinstance(samples, numbers.Integral) or samples < 2:
        raise ProbeError(f"samples must be a whole number of at least 2, not {samples!r}")
    weights, folded = _weights(model, fold_ln)
    if len(weights) < 2:
        raise ProbeError("composition needs at least two layers of heads")
    sides = [_sides(w) for w in weights]
    baselines: dict[tuple, float] = {}
    rows = []
    for kind in KINDS:
        for a, (X_A, Y_A, _, _) in enumerate(sides):
            G_A = X_A.mT @ X_A  # [head, d_head, d_head]
            norm_A = _trace_product(G_A, Y_A @ Y_A.mT).sqrt()  # ‖OV_A‖_F
            for b in range(a + 1, len(sides)):
                X_B, Y_B, Q_B, K_B = sides[b]
                core, outer = _right(kind, X_B, Y_B, Q_B, K_B)
                C = torch.einsum("ikm,jmn->ijkn", Y_A, core)  # [head_A, head_B, d_head, d_head]
                inner = C.mT @ G_A[:, None] @ C  # Cᵀ (XᵀX) C
                score = _trace_product(inner, outer[None]).sqrt()
                norm_B = _right_norm(kind, X_B, Y_B, Q_B, K_B)
                score = score / (norm_A[:, None] * norm_B[None, :])
                shapes = (kind, *X_A.shape[1:], *Y_A.shape[1:], *core.shape[1:], *outer.shape[1:])
                if shapes not in baselines:
                    baselines[shapes] = _baseline(kind, X_A, Y_A, sides[b], samples, seed)
                for i in range(score.shape[0]):
                    for j in range(score.shape[1]):
                        rows.append((kind, a, i, b, j, float(score[i, j]), baselines[shapes]))
    table = pd.DataFrame(rows, columns=COLUMNS)
    table.attrs = {"folded": folded}
    return table


def _weights(model, fold_ln: bool) -> tuple[list[HeadWeights], bool]:
    if not isinstance(model, nn.Module):
        return list(model), False
    weights = head_weights(model)
    arch = architecture(model)
    if not fold_ln or arch.post_ln or not arch.ln1:
        return weights, False
    folded = []
    for w, block in zip(weights, blocks(model), strict=True):
        norm = block.get_submodule(arch.ln1)
        gain = norm_gain(model, norm.weight.detach())
        W_Q, W_K, W_V = (W * gain[:, None] for W in (w.W_Q, w.W_K, w.W_V))
        W_O = w.W_O
        if isinstance(norm, nn.LayerNorm):  # it reads x - mean(x): only centred parts count
            W_Q, W_K, W_V = (W - W.mean(-2, keepdim=True) for W in (W_Q, W_K, W_V))
            W_O = W_O - W_O.mean(-1, keepdim=True)
        folded.append(
            HeadWeights(
                W_Q=W_Q,
                W_K=W_K,
                W_V=W_V,
                W_O=W_O,
                b_Q=w.b_Q,
                b_K=w.b_K,
                b_V=w.b_V,
                b_O=w.b_O,
                kv_head=w.kv_head,
            )
        )
    return folded, True


def _sides(w: HeadWeights) -> tuple[torch.Tensor, ...]:
    """Per query head, float64: W_V ``[head, d_model, d_head]``, W_O ``[head, d_head, d_model]``,
    W_Q and W_K ``[head, d_model, d_head]`` (keys and values repeated for grouped queries)."""
    kv = w.kv_head
    return tuple(t.double() for t in (w.W_V[kv], w.W_O, w.W_Q, w.W_K[kv]))


def _right(kind: str, X_B, Y_B, Q_B, K_B) -> tuple[torch.Tensor, torch.Tensor]:
    """Head B's matrix as (left factor, Y Yᵀ of its right factor): QK = W_Q W_Kᵀ (Q), QKᵀ (K),
    OV = W_V W_O (V)."""
    if kind == "Q":
        return Q_B, K_B.mT @ K_B
    if kind == "K":
        return K_B, Q_B.mT @ Q_B
    return X_B, Y_B @ Y_B.mT


def _right_norm(kind: str, X_B, Y_B, Q_B, K_B) -> torch.Tensor:
    left, outer = _right(kind, X_B, Y_B, Q_B, K_B)
    return _trace_product(left.mT @ left, outer).sqrt()


def _trace_product(P: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """tr(P H) over the last two dimensions."""
    return (P * H.mT).sum((-1, -2)).clamp_min(0)


def _baseline(kind: str, X_A, Y_A, side_B, samples: int, seed: int) -> float:
    """The mean score of Gaussian matrices of the shapes of one head A and one head B."""
    g = torch.Generator().manual_seed(seed)

    def draw(t: torch.Tensor) -> torch.Tensor:
        return torch.randn(samples, *t.shape[1:], generator=g, dtype=torch.float64)

    X, Y = draw(X_A), draw(Y_A)
    Bs = [draw(t) for t in side_B]
    core, outer = _right(kind, *Bs)
    C = Y @ core
    score = _trace_product(C.mT @ (X.mT @ X) @ C, outer).sqrt()
    norm_A = _trace_product(X.mT @ X, Y @ Y.mT).sqrt()
    norm_B = _right_norm(kind, *Bs)
    return float((score / (norm_A * norm_B)).mean())
