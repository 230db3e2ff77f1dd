"""Copying scores against all eigenvalues of the formed vocab x vocab circuit, and known heads."""

import numpy as np
import pytest
import torch
import transformers as tf
from models import CONFIGS, SEQ2SEQ, small_model
from threadpoolctl import threadpool_limits

import probe
from probe.weights.copying import COLUMNS, copying, copying_scores


def dense(W_E, W_V, W_O, W_U) -> float:
    """Σ Re λ / Σ |λ| over every eigenvalue of W_E W_V W_O W_U, formed [vocab, vocab] in float64."""
    circuit = W_E.double() @ W_V.double() @ W_O.double() @ W_U.double()
    with threadpool_limits(1):  # small eigenproblems: threads only wait on a busy machine
        eigenvalues = np.linalg.eigvals(circuit.detach().numpy())
    return eigenvalues.real.sum() / np.abs(eigenvalues).sum()


def dense_table(model, W_E, W_U, attention=None) -> np.ndarray:
    """[layer, head] from the formed circuits, W_V and W_O from ``probe.head_weights``."""
    return np.array(
        [
            [dense(W_E, w.W_V[w.kv_head[h]], w.W_O[h], W_U) for h in range(w.n_heads)]
            for w in probe.head_weights(model, attention)
        ]
    )


def scores(table, attention="blocks.attn") -> np.ndarray:
    rows = table[table.attention == attention]
    return rows.pivot(index="layer", columns="head", values="copying").to_numpy()


def lm(kind, auto, **changes):
    """A small random model of ``kind`` with a head (``auto``), config ``changes``, in float64."""
    torch.manual_seed(0)
    config = (CONFIGS | SEQ2SEQ)[kind]()
    for name, value in changes.items():
        setattr(config, name, value)
    return auto.from_config(config).double().eval()


def test_gpt2_tied_lm_head():
    model = lm("gpt2", tf.AutoModelForCausalLM)
    table = copying_scores(model)
    assert list(table.columns) == COLUMNS
    assert len(table) == 2 * 4
    assert set(table.unembedding) == {"tied"}
    W_E = model.transformer.wte.weight
    expected = dense_table(model, W_E, model.lm_head.weight.T)
    np.testing.assert_allclose(scores(table), expected, rtol=1e-9, atol=1e-12)


def test_llama_untied_lm_head_and_grouped_query_heads():
    """4 query heads read 2 value heads; W_V and W_O are cut from the projections here."""
    model = lm("llama", tf.AutoModelForCausalLM, tie_word_embeddings=False)
    assert model.config.num_key_value_heads == 2
    table = copying_scores(model)
    assert set(table.unembedding) == {"output_embedding"}
    W_E, W_U = model.model.embed_tokens.weight, model.lm_head.weight.T
    d = 8
    expected, wrong = [], []
    for layer in model.model.layers:
        v, o = layer.self_attn.v_proj.weight, layer.self_attn.o_proj.weight
        W_V = [v[k * d : (k + 1) * d].T for k in range(2)]  # [d_model, d_head] per value head
        W_O = [o[:, h * d : (h + 1) * d].T for h in range(4)]  # [d_head, d_model] per query head
        expected.append([dense(W_E, W_V[h // 2], W_O[h], W_U) for h in range(4)])
        wrong.append([dense(W_E, W_V[h % 2], W_O[h], W_U) for h in range(4)])
    np.testing.assert_allclose(scores(table), expected, rtol=1e-9, atol=1e-12)
    assert np.abs(np.array(wrong) - expected)[:, [1, 2]].min() > 1e-3  # the grouping matters


def test_grouped_heads_share_W_V_but_not_W_O():
    """Heads 0 and 1 read value head 0: the same W_O gives the same score, its own W_O its own."""
    model = lm("llama", tf.AutoModelForCausalLM, tie_word_embeddings=False)
    o = model.model.layers[0].self_attn.o_proj.weight
    with torch.no_grad():
        o[:, 8:16] = o[:, 0:8]  # head 1's W_O := head 0's
        o[:, 24:32] = o[:, 0:8]  # head 3 (value head 1) gets it too
    first = scores(copying_scores(model))[0]
    assert first[0] == pytest.approx(first[1], abs=1e-12)
    assert abs(first[0] - first[3]) > 1e-3


def test_bare_bert_uses_the_embedding_transposed():
    model = small_model("bert").double()
    table = copying_scores(model)
    assert set(table.unembedding) == {"input_embedding_transposed"}
    W_E = model.embeddings.word_embeddings.weight
    np.testing.assert_allclose(scores(table), dense_table(model, W_E, W_E.T), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(("tie", "label"), [(True, "tied"), (False, "output_embedding")])
def test_bert_masked_lm_decoder(tie, label):
    model = lm("bert", tf.AutoModelForMaskedLM, tie_word_embeddings=tie)
    table = copying_scores(model)
    assert set(table.unembedding) == {label}
    W_E, W_U = model.bert.embeddings.word_embeddings.weight, model.cls.predictions.decoder.weight.T
    assert (model.cls.predictions.decoder.weight is W_E) == tie
    np.testing.assert_allclose(scores(table), dense_table(model, W_E, W_U), rtol=1e-9, atol=1e-12)


def test_opt_projections_in_and_out():
    model = lm("opt", tf.AutoModelForCausalLM, word_embed_proj_dim=16)
    table = copying_scores(model)
    assert set(table.unembedding) == {"tied"}
    decoder = model.model.decoder
    W_E = decoder.embed_tokens.weight @ decoder.project_in.weight.T  # [vocab, d_model]
    W_U = decoder.project_out.weight.T @ model.lm_head.weight.T  # [d_model, vocab]
    np.testing.assert_allclose(scores(table), dense_table(model, W_E, W_U), rtol=1e-9, atol=1e-12)


def test_albert_masked_lm_narrower_than_the_stream_uses_the_embedding_transposed():
    model = lm("albert", tf.AutoModelForMaskedLM)
    table = copying_scores(model)
    assert set(table.unembedding) == {"input_embedding_transposed"}
    albert = model.albert
    W_E = albert.embeddings.word_embeddings.weight @ (
        albert.encoder.embedding_hidden_mapping_in.weight.T
    )
    np.testing.assert_allclose(scores(table), dense_table(model, W_E, W_E.T), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kind", ["bart", "t5"])
def test_encoder_decoder_self_attentions(kind):
    model = lm(kind, tf.AutoModelForSeq2SeqLM)
    table = copying_scores(model)
    assert list(table.attention.unique()) == ["encoder.attn", "decoder.attn"]  # no cross
    encoder, decoder = table.attention == "encoder.attn", table.attention == "decoder.attn"
    assert set(table[encoder].unembedding) == {"input_embedding_transposed"}
    assert set(table[decoder].unembedding) == {"tied"}
    W_E = model.get_encoder().embed_tokens.weight
    expected = dense_table(model, W_E, W_E.T, "encoder.attn")
    np.testing.assert_allclose(scores(table, "encoder.attn"), expected, rtol=1e-9, atol=1e-12)
    W_E, W_U = model.get_decoder().embed_tokens.weight, model.lm_head.weight.T
    expected = dense_table(model, W_E, W_U, "decoder.attn")
    np.testing.assert_allclose(scores(table, "decoder.attn"), expected, rtol=1e-9, atol=1e-12)


def test_float32_and_bfloat16_weights_and_chunks():
    model = lm("llama", tf.AutoModelForCausalLM, tie_word_embeddings=False)
    exact = copying_scores(model).copying.to_numpy()
    np.testing.assert_allclose(copying_scores(model, chunk=7).copying, exact, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(copying_scores(model.float()).copying, exact, atol=1e-5)
    np.testing.assert_allclose(copying_scores(model.bfloat16()).copying, exact, atol=0.05)


def orthonormal(rows, cols, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(rows, cols, generator=g, dtype=torch.float64)).Q


def rotation(n) -> torch.Tensor:
    """90° in each pair of coordinates: eigenvalues ±i."""
    return torch.block_diag(*[torch.tensor([[0.0, -1.0], [1.0, 0.0]])] * (n // 2)).double()


def test_known_heads():
    """W_U = W_Eᵀ with orthonormal embeddings, W_V W_O the identity on a d_head subspace: the
    head copies (1); negated it suppresses (-1); rotated by 90° in pairs it does neither (0)."""
    vocab, d_model, d_head = 50, 16, 4
    W_E = orthonormal(vocab, d_model)
    W_V = orthonormal(d_model, d_model, seed=1)[:, :d_head]  # [d_model, d_head]
    W_O = torch.stack([W_V.T, -W_V.T, rotation(d_head) @ W_V.T])  # [3, d_head, d_model]
    layer = (W_V[None], W_O)  # one value head read by three query heads
    got = copying(W_E, W_E.T, [layer, layer])
    np.testing.assert_allclose(got, [[1.0, -1.0, 0.0]] * 2, atol=1e-12)
    for h, value in enumerate([1.0, -1.0, 0.0]):
        assert dense(W_E, W_V, W_O[h], W_E.T) == pytest.approx(value, abs=1e-12)


def test_known_heads_in_a_model():
    """The same heads set into a bare BERT: W_V and W_O identity blocks per head."""
    model = small_model("bert").double()
    d = 8
    with torch.no_grad():
        model.embeddings.word_embeddings.weight.copy_(orthonormal(99, 32))
        for layer in model.encoder.layer:
            layer.attention.self.value.weight.copy_(torch.eye(32))
            W = torch.eye(32, dtype=torch.float64)
            W[d : 2 * d, d : 2 * d] *= -1  # head 1 negates
            W[2 * d : 3 * d, 2 * d : 3 * d] = rotation(d).T  # head 2 rotates: W_O² = R
            W[3 * d :, 3 * d :] = torch.randn(d, d, dtype=torch.float64)  # head 3: anything
            layer.attention.output.dense.weight.copy_(W)
    got = scores(copying_scores(model))
    np.testing.assert_allclose(got[:, :3], [[1.0, -1.0, 0.0]] * 2, atol=1e-12)
    assert (np.abs(got[:, 3]) < 1).all()
