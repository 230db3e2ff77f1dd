"""probe.MultiHeadAttention against torch.nn.MultiheadAttention and against the equations."""

import numpy as np
import pytest
import torch
from torch import nn

import probe
from probe import MultiHeadAttention

D, H = 24, 4


def pair(seed: int, bias: bool = True, batch_first: bool = True):
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(D, H, bias=bias, batch_first=batch_first).eval()
    if bias:  # torch initialises biases to zero; make them count
        nn.init.normal_(ref.in_proj_bias)
        nn.init.normal_(ref.out_proj.bias)
    return ref, probe.MultiHeadAttention.from_torch(ref).eval()


def padding(batch: int, n: int, lengths: list[int]) -> torch.Tensor:
    return torch.arange(n)[None, :] >= torch.tensor(lengths)[:, None]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("cross", [False, True])
def test_equals_torch(seed, bias, cross):
    ref, mha = pair(seed, bias)
    x = torch.randn(3, 7, D)
    kv = torch.randn(3, 5, D) if cross else x
    n_k = kv.shape[1]
    pad = padding(3, n_k, [n_k, n_k - 2, 1])
    expected, _ = ref(x, kv, kv, key_padding_mask=pad, need_weights=False)
    got = mha(x, kv, kv, key_padding_mask=pad)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("seed", range(3))
def test_causal_and_attn_mask_equal_torch(seed):
    ref, mha = pair(seed)
    x = torch.randn(2, 6, D)
    causal = nn.Transformer.generate_square_subsequent_mask(6)  # float, -inf above diagonal
    expected, _ = ref(x, x, x, attn_mask=causal, need_weights=False)
    torch.testing.assert_close(mha(x, causal=True), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(mha(x, attn_mask=causal), expected, atol=1e-5, rtol=0)
    as_bool = causal.isinf()
    torch.testing.assert_close(mha(x, attn_mask=as_bool), expected, atol=1e-5, rtol=0)
    per_head = torch.randn(2 * H, 6, 6)  # a float mask per (batch, head)
    expected, _ = ref(x, x, x, attn_mask=per_head, need_weights=False)
    torch.testing.assert_close(mha(x, attn_mask=per_head), expected, atol=1e-5, rtol=0)


def test_from_torch_sequence_first():
    """A copy of a sequence-first module takes its inputs sequence-first too."""
    ref, mha = pair(0, batch_first=False)
    assert not mha.batch_first
    x = torch.randn(7, 2, D)  # [pos, batch, d_model]
    expected, _ = ref(x, x, x, need_weights=False)
    torch.testing.assert_close(mha(x), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("batch_first", [True, False])
def test_weights_and_masks_as_torch_returns_them(batch_first):
    """need_weights gives torch's (output, weights), averaged over heads or not; a float
    key_padding_mask is added to the scores, as a bool one masks them."""
    ref, mha = pair(3, batch_first=batch_first)
    x = torch.randn(2, 5, D) if batch_first else torch.randn(5, 2, D)
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    for average in (True, False):
        expected = ref(x, x, x, key_padding_mask=padding, average_attn_weights=average)
        got = mha(
            x, x, x, key_padding_mask=padding, need_weights=True, average_attn_weights=average
        )
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    as_float = torch.zeros(2, 5).masked_fill(padding, float("-inf"))
    out, none = mha(x, key_padding_mask=as_float, need_weights=False)
    assert none is None
    torch.testing.assert_close(out, mha(x, key_padding_mask=padding), atol=1e-6, rtol=0)


@pytest.mark.parametrize("batch_first", [True, False])
def test_stands_in_for_torch_inside_a_transformer_encoder(batch_first):
    """Swapped for the self-attention of torch's TransformerEncoder (padding and causal mask):
    the same output, and probe's hooks see every layer."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        D, H, dim_feedforward=32, dropout=0.0, batch_first=batch_first
    )
    encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()
    x = torch.randn(3, 6, D) if batch_first else torch.randn(6, 3, D)
    padding = torch.tensor([[False] * 6, [False] * 4 + [True] * 2, [False] * 2 + [True] * 4])
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)  # bool, as the padding mask is
    with torch.no_grad():
        expected = encoder(x, mask=causal, src_key_padding_mask=padding)
        for block in encoder.layers:
            block.self_attn = probe.MultiHeadAttention.from_torch(block.self_attn).eval()
        with probe.trace(encoder, "hook_pattern") as cache:
            got = encoder(x, mask=causal, src_key_padding_mask=padding)
    real = ~padding if batch_first else ~padding.T
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=0)
    assert len(cache) == 2 and all(p.shape == (3, H, 6, 6) for p in cache.values())
    assert all((p.triu(1) == 0).all() for p in cache.values())  # the causal mask reached them


def test_weights_in_paper_orientation():
    _, mha = pair(1)
    assert mha.W_Q.shape == (H, D, D // H) and mha.W_O.shape == (H, D // H, D)
    assert mha.b_Q.shape == (H, D // H) and mha.b_O.shape == (D,)
    x = torch.randn(2, 5, D)
    with probe.trace(mha) as cache:
        mha(x)
    for i in range(H):
        torch.testing.assert_close(cache["hook_q"][:, :, i], x @ mha.W_Q[i] + mha.b_Q[i])
        torch.testing.assert_close(cache["hook_k"][:, :, i], x @ mha.W_K[i] + mha.b_K[i])
        torch.testing.assert_close(cache["hook_v"][:, :, i], x @ mha.W_V[i] + mha.b_V[i])


def test_results_sum_to_output_and_patterns_are_distributions():
    _, mha = pair(2)
    x = torch.randn(2, 6, D)
    pad = padding(2, 6, [6, 3])
    with probe.trace(mha) as cache:
        out = mha(x, key_padding_mask=pad)
    assert cache["hook_result"].shape == (2, 6, H, D)
    assert cache["hook_z"].shape == (2, 6, H, D // H)
    assert cache["hook_attn_scores"].shape == (2, H, 6, 6)
    torch.testing.assert_close(cache["hook_result"].sum(2) + mha.b_O, out, atol=1e-5, rtol=0)
    pattern = cache["hook_pattern"]
    torch.testing.assert_close(pattern.sum(-1), torch.ones(2, H, 6))
    assert (pattern[1, :, :, 3:] == 0).all()


def test_zeroing_one_head_removes_exactly_its_term():
    _, mha = pair(3)
    x = torch.randn(2, 5, D)
    with probe.trace(mha, "hook_result") as cache:
        full = mha(x)

    def zero_head_1(z, name):
        z = z.clone()
        z[:, :, 1] = 0
        return z

    with probe.hooks(mha, {"hook_z": zero_head_1}):
        ablated = mha(x)
    torch.testing.assert_close(ablated, full - cache["hook_result"][:, :, 1], atol=1e-5, rtol=0)


def test_uniform_pattern_gives_mean_of_values():
    _, mha = pair(4)
    x = torch.randn(2, 5, D)
    with probe.hooks(mha, {"hook_pattern": lambda p, name: torch.full_like(p, 1 / p.shape[-1])}):
        out = mha(x)
    # Every query then reads the mean value vector: out = Σ_i mean_pos(x W_i^V + b_i^V) W_i^O + b^O
    v = torch.einsum("bpm,hmk->bphk", x, mha.W_V) + mha.b_V
    expected = torch.einsum("bhk,hkm->bm", v.mean(1), mha.W_O) + mha.b_O
    torch.testing.assert_close(out, expected[:, None].expand(2, 5, D), atol=1e-5, rtol=0)
    assert not torch.allclose(out, mha(x))


def test_gradients_flow_through_a_trace():
    _, mha = pair(5)
    x = torch.randn(2, 4, D, requires_grad=True)
    with probe.trace(mha, ["hook_pattern"], keep_grad=True) as cache:
        mha(x).sum().backward()
    assert x.grad is not None and mha.W_Q.grad.abs().sum() > 0
    assert cache["hook_pattern"].requires_grad
    with probe.trace(mha, ["hook_pattern"]) as cache:
        mha(x)
    assert not cache["hook_pattern"].requires_grad


def test_hooks_removed_after_an_exception():
    _, mha = pair(6)
    with pytest.raises(RuntimeError, match="boom"), probe.trace(mha):
        mha(torch.randn(1, 3, D))
        raise RuntimeError("boom")
    assert not any(m.active for m in mha.modules() if isinstance(m, probe.HookPoint))


def test_traces_nest_and_select_names():
    _, mha = pair(7)
    x = torch.randn(1, 3, D)
    with probe.trace(mha, "hook_z") as outer, probe.trace(mha, lambda n: "q" in n) as inner:
        mha(x)
    assert set(outer) == {"hook_z"} and set(inner) == {"hook_q"}
    with probe.trace(mha, to_cpu=True) as everything:
        mha(x)
    assert len(everything) == 7


def test_a_misspelt_hook_name_is_answered_with_the_nearest():
    _, mha = pair(8)
    with (
        pytest.raises(KeyError, match=r"did you mean 'hook_pattern'\?"),
        probe.trace(mha, ["hook_patern"]),
    ):
        pass


def test_indivisible_width_is_a_clear_error():
    with pytest.raises(ValueError, match="divisible"):
        probe.MultiHeadAttention(10, 3)


def test_a_model_built_from_modules_gets_prefixed_names():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = probe.MultiHeadAttention(D, H)

    blocks = nn.Module()
    blocks.blocks = nn.ModuleList([Block(), Block()])
    x = torch.randn(1, 3, D)
    with probe.trace(blocks, "hook_pattern") as cache:
        blocks.blocks[1].attn(blocks.blocks[0].attn(x))
    assert sorted(cache) == ["blocks.0.attn.hook_pattern", "blocks.1.attn.hook_pattern"]
    assert cache.stack("hook_pattern").shape == (2, 1, H, 3, 3)


VARIANTS = {  # name -> (d_head, qk)
    "narrow": (None, "factored"),
    "wide": (32, "factored"),
    "bilinear": (None, "bilinear"),
    "shared": (None, "shared"),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_parameter_counts(variant):
    d_head, qk = VARIANTS[variant]
    h, d = 4, 32
    k = d_head or d // h
    m = MultiHeadAttention(d, h, d_head=d_head, qk=qk)
    qk_params = {"factored": 2 * h * d * k, "bilinear": h * d * d, "shared": h * d * k}[qk]
    bias = (h * d if qk == "bilinear" else h * k * (1 if qk == "shared" else 2)) + h * k + d
    expected = {"QK": qk_params, "V": h * d * k, "O": h * k * d, "bias": bias}
    assert m.parameter_counts() == expected
    assert sum(expected.values()) == sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_spectra_hooks_and_ranks(variant):
    """Every variant has the same hook points; its QK spectrum equals a dense SVD of
    W_i^Q W_i^Kᵀ; a factored product has rank at most d_head, a bilinear W_i up to d_model."""
    from references import dense

    d_head, qk = VARIANTS[variant]
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 4, d_head=d_head, qk=qk)
    x = torch.randn(2, 5, 32)
    with probe.trace(m) as cache:
        out = m(x)
    assert out.shape == (2, 5, 32)
    width = {"bilinear": 32}.get(qk, m.d_head)
    assert cache["hook_q"].shape == cache["hook_k"].shape == (2, 5, 4, width)
    assert cache["hook_z"].shape == (2, 5, 4, m.d_head)
    torch.testing.assert_close(cache["hook_result"].sum(2) + m.b_O, out)
    table = probe.spectra(m)
    for row in table[table.circuit == "QK"].itertuples():
        s, _ = dense(m.W_Q[row.head].detach(), m.W_K[row.head].detach())
        np.testing.assert_allclose(row.singular_values, s[: len(row.singular_values)], rtol=1e-8)
        assert row.numerical_rank == (32 if variant in ("wide", "bilinear") else 8)


def test_shared_scores_are_symmetric_and_factored_is_the_default():
    torch.manual_seed(0)
    shared = MultiHeadAttention(16, 2, qk="shared")
    x = torch.randn(3, 6, 16)
    with probe.trace(shared, "hook_attn_scores") as cache:
        shared(x)
    scores = cache["hook_attn_scores"]
    torch.testing.assert_close(scores, scores.transpose(-1, -2))
    assert shared.W_K is shared.W_Q
    torch.manual_seed(1)
    default = MultiHeadAttention(16, 2)
    torch.manual_seed(1)
    factored = MultiHeadAttention(16, 2, qk="factored", d_head=8)
    assert torch.equal(default(x), factored(x))
    with pytest.raises(ValueError, match="qk must be one of factored, bilinear, shared"):
        MultiHeadAttention(16, 2, qk="tied")
