"""Factored spectra against dense SVDs of the formed products, and known cases."""

import numpy as np
import pytest
import torch
from models import small_model
from references import assert_spectrum, dense

import probe
from probe.weights.spectra import factored_spectrum, spectra


@pytest.mark.parametrize(("d_model", "d_head"), [(8, 2), (48, 16), (96, 8), (64, 64)])
def test_factored_equals_dense_svd(d_model, d_head):
    torch.manual_seed(d_model + d_head)
    A, B = torch.randn(3, d_model, d_head), torch.randn(3, d_model, d_head)
    sigma, trace_square = factored_spectrum(A, B)
    for i in range(3):
        s, symmetry = dense(A[i], B[i])
        assert_spectrum(sigma[i], s)
        frob = (s**2).sum()
        assert abs(0.5 * (1 + trace_square[i].item() / frob) - symmetry) < 1e-12


@pytest.mark.slow
def test_every_minilm_head_equals_dense_svd(minilm):
    model, _ = minilm
    table = spectra(model)
    assert len(table) == 6 * 12 * 2
    weights = probe.head_weights(model)
    for row in table.itertuples():
        w = weights[row.layer]
        if row.circuit == "QK":
            A, B = w.W_Q[row.head], w.W_K[row.head]
        else:
            A, B = w.W_V[row.head], w.W_O[row.head].T
        s, symmetry = dense(A, B)
        assert_spectrum(torch.from_numpy(row.singular_values), s)
        assert row.numerical_rank == np.linalg.matrix_rank(A.double() @ B.double().T)
        if row.circuit == "QK":
            assert abs(row.symmetry - symmetry) < 1e-10


def with_weights(W_Q, W_K, W_V=None, W_O=None) -> probe.MultiHeadAttention:
    n, d_model, _ = W_Q.shape
    mha = probe.MultiHeadAttention(d_model, n)
    with torch.no_grad():
        mha.W_Q.copy_(W_Q)
        mha.W_K.copy_(W_K)
        if W_V is not None:
            mha.W_V.copy_(W_V)
            mha.W_O.copy_(W_O)
    return mha


def test_rank_one_factors():
    # Powers of two keep u cᵀ exactly rank one in float32; W_Q W_Kᵀ = (c·c) u vᵀ, c·c > 0.
    c = 2.0 ** torch.randint(-3, 4, (4, 1, 8)) * torch.sign(torch.randn(4, 1, 8))
    u, v = torch.randn(4, 32, 1), torch.randn(4, 32, 1)
    mha = with_weights(u * c, v * c)
    for qk in spectra(mha).query("circuit == 'QK'").itertuples():
        assert qk.numerical_rank == 1
        assert qk.effective_rank == pytest.approx(1, abs=1e-9)
        assert qk.stable_rank == pytest.approx(1, abs=1e-9)


def test_orthonormal_factors_use_every_dimension():
    Q1 = torch.linalg.qr(torch.randn(32, 32)).Q
    Q2 = torch.linalg.qr(torch.randn(32, 32)).Q
    heads = Q1.reshape(32, 4, 8).transpose(0, 1), Q2.reshape(32, 4, 8).transpose(0, 1)
    table = spectra(with_weights(heads[0], heads[1], heads[1], heads[0].transpose(1, 2)))
    for r in table.itertuples():
        assert r.effective_rank == pytest.approx(8, abs=1e-9)
        assert r.numerical_rank == 8 and r.stable_rank == pytest.approx(8)
        assert np.allclose(r.singular_values, 1)
    assert (table.params_factored == 2 * 32 * 8).all() and (table.params_full == 32 * 32).all()


def test_symmetry_known_cases():
    W = torch.randn(4, 32, 8)
    symmetric = spectra(with_weights(W, W)).query("circuit == 'QK'")
    assert symmetric.symmetry.tolist() == pytest.approx([1] * 4, abs=1e-12)
    # A Bᵀ antisymmetric: A = [u, v, 0…], B = [v, -u, 0…] gives u vᵀ - v uᵀ.
    u, v = torch.randn(4, 32), torch.randn(4, 32)
    A, B = torch.zeros(4, 32, 8), torch.zeros(4, 32, 8)
    A[:, :, 0], A[:, :, 1], B[:, :, 0], B[:, :, 1] = u, v, v, -u
    anti = spectra(with_weights(A, B)).query("circuit == 'QK'")
    assert anti.symmetry.tolist() == pytest.approx([0] * 4, abs=1e-12)
    assert (anti.numerical_rank == 2).all()
    assert np.isnan(spectra(with_weights(W, W)).query("circuit == 'OV'").symmetry).all()


def test_same_numbers_through_the_module_and_a_hugging_face_model():
    model = small_model("bert")
    w = probe.head_weights(model)[1]
    mha = with_weights(w.W_Q, w.W_K, w.W_V, w.W_O)
    from_hf = spectra(model).query("layer == 1").reset_index(drop=True)
    from_module = spectra(mha)
    for a, b in zip(from_hf.singular_values, from_module.singular_values, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12)
    np.testing.assert_allclose(from_hf.effective_rank, from_module.effective_rank, rtol=1e-12)


@pytest.mark.parametrize(
    "kind", ["gpt2", "llama", "albert", "qwen3", "gemma2", "gemma3_text", "phi3", "modernbert"]
)
def test_other_layouts_equal_dense(kind):
    model = small_model(kind)
    table = spectra(model)
    weights = probe.head_weights(model)
    for row in table.itertuples():
        w = weights[row.layer]
        kv = w.kv_head[row.head]
        A, B = (
            (w.W_Q[row.head], w.W_K[kv]) if row.circuit == "QK" else (w.W_V[kv], w.W_O[row.head].T)
        )
        s, _ = dense(A, B)
        assert_spectrum(torch.from_numpy(row.singular_values), s)
