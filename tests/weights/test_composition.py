"""Composition scores: equal TransformerLens's formula on the same matrices, equal a dense
computation with the LayerNorm folded in by hand, and find the induction circuit's K-composition."""

import pytest
import torch
from induction import INDUCTION, MODEL, PREVIOUS_TOKEN
from models import small_model

import probe


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_equals_transformer_lens_on_the_same_weights(kind):
    """TransformerLens's ``utilities.composition_scores`` on FactoredMatrix(W_V, W_O) and
    FactoredMatrix(W_Q, W_Kᵀ), as its ``all_composition_scores`` builds them."""
    pytest.importorskip(
        "transformer_lens", reason="TransformerLens is not installed (pip install -e '.[parity]')"
    )
    from transformer_lens.FactoredMatrix import FactoredMatrix
    from transformer_lens.utilities.matrix import composition_scores

    weights = probe.head_weights(small_model(kind))
    table = probe.composition_scores(weights)
    assert not table.attrs["folded"]
    stack = lambda name: torch.stack([getattr(w, name) for w in weights]).double()  # noqa: E731
    kv = weights[0].kv_head
    W_Q, W_K, W_V, W_O = stack("W_Q"), stack("W_K")[:, kv], stack("W_V")[:, kv], stack("W_O")
    left = FactoredMatrix(W_V, W_O)
    rights = {
        "Q": FactoredMatrix(W_Q, W_K.mT),
        "K": FactoredMatrix(W_Q, W_K.mT).T,
        "V": left,
    }
    for kind_, right in rights.items():
        theirs = composition_scores(left, right, broadcast_dims=True)  # [L, H, L, H]
        ours = table[table.kind == kind_]
        expected = [
            float(theirs[r.layer_from, r.head_from, r.layer_to, r.head_to])
            for r in ours.itertuples()
        ]
        torch.testing.assert_close(
            torch.tensor(ours.score.values), torch.tensor(expected).double(), atol=1e-6, rtol=1e-6
        )
    n_layers, n_heads = len(weights), weights[0].n_heads
    assert len(table) == 3 * n_heads**2 * n_layers * (n_layers - 1) // 2


def test_layer_norm_folded_as_the_stream_reads_it():
    """Dense d_model x d_model circuits with ln_1 written as matrices: centring C = I - 11ᵀ/d and
    diag(γ); OV_A = C diag(γ_A) W_V W_O C and QK_B = C diag(γ_B) W_Q W_Kᵀ diag(γ_B) C."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(MODEL, dtype=torch.float32).eval()
    table = probe.composition_scores(model)
    assert table.attrs["folded"]
    raw = probe.head_weights(model)
    d = model.config.n_embd
    C = torch.eye(d, dtype=torch.float64) - 1 / d
    gains = [torch.diag(b.ln_1.weight.detach().double()) for b in model.transformer.h]

    def circuit(kind, layer, head):
        w, G = raw[layer], gains[layer]
        W_Q, W_K, W_V, W_O = (t[head].double() for t in (w.W_Q, w.W_K, w.W_V, w.W_O))
        if kind == "OV":
            return C @ G @ W_V @ W_O @ C
        return C @ G @ W_Q @ W_K.T @ G @ C

    fro = torch.linalg.matrix_norm
    for row in table.sample(20, random_state=0).itertuples():
        A = circuit("OV", row.layer_from, row.head_from)
        B = {"Q": circuit("QK", row.layer_to, row.head_to)}
        B["K"], B["V"] = B["Q"].T, circuit("OV", row.layer_to, row.head_to)
        B = B[row.kind]
        dense = fro(A @ B) / (fro(A) * fro(B))
        assert row.score == pytest.approx(float(dense), rel=1e-6)


def test_induction_circuit_k_composition():
    """Into each induction head, the previous-token head's K-composition is the largest of the
    layer-0 heads', and well above the random baseline."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(MODEL, dtype=torch.float32).eval()
    table = probe.composition_scores(model)
    k = table[(table.kind == "K") & (table.layer_to == INDUCTION[0])]
    for head, into in k.groupby("head_to"):
        best = into.loc[into.score.idxmax()]
        print(f"K into (1, {head}):", into.score.round(3).tolist(), "baseline", best.baseline)
        assert (best.layer_from, best.head_from) == PREVIOUS_TOKEN
        assert best.score > 1.5 * best.baseline
    # The baseline is the mean score of random matrices of these shapes: the same for all.
    assert table.groupby("kind").baseline.nunique().eq(1).all()
    assert table.baseline.min() > 0 and table.baseline.max() < 1
