"""Entropy and Jensen-Shannon divergence (``probe.numerics``) against scipy, zeros included."""

import math

import numpy as np
import pytest
import torch
from scipy.spatial.distance import jensenshannon
from scipy.stats import entropy as scipy_entropy

from probe.numerics import entropy, pairwise_js


def distributions(*shape: int, seed: int = 0, dtype=torch.float64) -> torch.Tensor:
    """Random distributions along the last axis, about a third of the weights exactly 0 (and
    every row keeps at least one weight)."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(*shape, generator=g, dtype=torch.float64)
    weights[torch.rand(*shape, generator=g) < 0.35] = 0
    weights[..., 0] += 1e-3
    return (weights / weights.sum(-1, keepdim=True)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_entropy_matches_scipy_with_zeros(dtype):
    p = distributions(3, 5, 7, dtype=dtype)
    assert (p == 0).any()
    expected = scipy_entropy(p.double().numpy(), axis=-1)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-6
    np.testing.assert_allclose(entropy(p).double().numpy(), expected, atol=tolerance)
    assert entropy(p).shape == (3, 5) and entropy(p).dtype == dtype


def test_entropy_by_hand():
    p = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    np.testing.assert_allclose(entropy(p).numpy(), [0.0, math.log(2), 0.0], atol=1e-15)
    assert torch.isfinite(entropy(torch.zeros(4, dtype=torch.float32))).all()


def test_pairwise_js_matches_scipy_squared():
    """Every distribution of p against every one of q, summed over the queries."""
    p, q = distributions(3, 4, 6, seed=1), distributions(5, 4, 6, seed=2)
    q[1, 2] = p[0, 2]  # one query where they agree
    expected = np.zeros((3, 5))
    for a in range(3):
        for b in range(5):
            for i in range(4):
                expected[a, b] += jensenshannon(p[a, i], q[b, i]) ** 2
    got = pairwise_js(p, q)
    assert got.shape == (3, 5) and got.dtype == torch.float64
    np.testing.assert_allclose(got.numpy(), expected, atol=1e-12)
    disjoint = torch.tensor([[[1.0, 0.0]]], dtype=torch.float64), torch.tensor([[[0.0, 1.0]]])
    assert pairwise_js(*(t.double() for t in disjoint)).item() == pytest.approx(math.log(2))


def test_pairwise_js_of_a_set_with_itself_is_symmetric_with_a_zero_diagonal():
    p = distributions(6, 3, 5, seed=3)
    own = pairwise_js(p)
    np.testing.assert_array_equal(own.numpy(), own.T.numpy())
    assert (own.diagonal() == 0).all()
    np.testing.assert_allclose(own.numpy(), pairwise_js(p, p).numpy(), atol=1e-12)
    for a, b in ((0, 1), (2, 5)):
        expected = sum(jensenshannon(p[a, i], p[b, i]) ** 2 for i in range(3))
        assert own[a, b].item() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_blocks_change_nothing(dtype):
    """However many pairs a block holds (one, some, all), every pair's value is the same."""
    p, q = distributions(7, 4, 9, seed=4, dtype=dtype), distributions(3, 4, 9, seed=5, dtype=dtype)
    for other in (None, q):
        whole = pairwise_js(p, other, block=10**9)
        for block in (1, 36, 100, 4 * 9 * 5):
            torch.testing.assert_close(pairwise_js(p, other, block=block), whole, rtol=0, atol=0)
