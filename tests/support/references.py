"""Reference computations written here without probe's machinery, to compare probe's with:
whole attention patterns and their per-head statistics, dense spectra of formed products."""

import numpy as np
import torch

import probe


def whole(model, inputs):
    with torch.inference_mode(), probe.trace(model, ["hook_pattern"]) as cache:
        model(**inputs)
    return cache.stack("hook_pattern").float()  # [layer, batch, head, q, k]


def expected_statistics(p: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """``[layer, head, statistic]`` from whole patterns ``[layer, batch, head, q, k]``."""
    L, B, H, T, _ = p.shape
    i = torch.arange(T)
    logs = torch.where(p > 0, p.log(), torch.zeros(()))
    per_query = torch.stack([
        -(p * logs).sum(-1),
        p.max(-1).values,
        p[..., 0],
        p.diagonal(0, -2, -1),
        torch.cat([torch.zeros(L, B, H, 1), p.diagonal(-1, -2, -1)], -1),
        (p * (i[:, None] - i[None]).abs()).sum(-1),
    ], -1)  # fmt: skip
    weights = real[None, :, None, :, None].float()
    return (per_query * weights).sum((1, 3)) / real.sum()


def dense(A: torch.Tensor, B: torch.Tensor) -> tuple[np.ndarray, float]:
    W = (A.double() @ B.double().T).numpy()
    s = np.linalg.svd(W, compute_uv=False)
    symmetric = (W + W.T) / 2
    return s, float((symmetric**2).sum() / (W**2).sum())


def assert_spectrum(sigma: torch.Tensor, expected: np.ndarray) -> None:
    k = sigma.shape[-1]
    relative = np.abs(sigma.numpy() - expected[:k]).max() / expected[0]
    assert relative < 1e-10
    assert expected[k:].max(initial=0) / expected[0] < 1e-12  # the rest of the spectrum is 0
