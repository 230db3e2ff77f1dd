"""Edges and circuits on the induction model: exact edge patching reproduces both runs at its
ends, the previous-token head feeds the induction heads' keys, and a quarter of the edges keep
80% of the behaviour."""

import pytest
import torch
from induction import MODEL
from models import small_model
from test_patching import pairs, repeats_metric

import probe
from probe.interventions.edges import graph, patch_edges

N = 20  # the copy length the induction model's constants were measured at


@pytest.fixture(scope="module")
def model():
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(MODEL, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def task():
    clean, corrupted = pairs(16, n=N, seed=1)
    return clean, corrupted, repeats_metric(clean["input_ids"], N)


def test_graph_of_the_induction_model(model):
    g = graph(model)
    # 1 + 4 + 1 + 4 + 1 senders; each head's q, k, v, each MLP and the logits receive.
    assert len(g.senders) == 11 and len(g.receivers) == 2 * (4 * 3 + 1) + 1
    # Heads of layer 0 read the embeddings; MLP 0 those and its heads; layer 1 six senders…
    assert len(g.edges) == 4 * 3 * 1 + 5 + 4 * 3 * 6 + 10 + 11


@pytest.mark.slow
def test_edge_patching_ends_at_both_runs(model, task):
    """Every edge kept: the clean run; none kept: every receiver sees the corrupted stream, so
    the corrupted run — each pair's metric, against the untouched model."""
    clean, corrupted, metric = task
    n = len(graph(model).edges)
    ends = patch_edges(model, clean, corrupted, metric, [[True] * n, [False] * n])
    with torch.no_grad():
        torch.testing.assert_close(ends[0], metric(model(**clean)), atol=1e-4, rtol=0)
        torch.testing.assert_close(ends[1], metric(model(**corrupted)), atol=1e-4, rtol=0)


def test_induction_circuit(model, task):
    clean, corrupted, metric = task
    scores = probe.edges(model, clean, corrupted, metric, method="eap-ig", steps=5)
    assert list(scores.columns[:4]) == ["sender", "receiver", "input", "score"]
    keys = scores[(scores.input == "k") & scores.receiver.str.startswith("1-")]
    from_heads = keys[keys.sender.str.startswith("0-")]
    for receiver, into in from_heads.groupby("receiver"):
        print(receiver, "keys from", dict(zip(into.sender, into.score.round(3), strict=True)))
        assert into.loc[into.score.idxmax()].sender == "0-0"  # the previous-token head

    chosen, curve = probe.circuit(model, clean, corrupted, metric, 0.8, scores=scores)
    print(curve.to_string())
    total = len(scores)
    assert curve.faithfulness.iloc[0] == pytest.approx(0, abs=1e-6)
    assert curve.faithfulness.iloc[-1] == pytest.approx(1, abs=1e-6)
    k = curve.attrs["chosen"]
    assert len(chosen) == k <= total / 4
    assert curve.set_index("edges").faithfulness[k] >= 0.8
    assert curve.set_index("edges").faithfulness[k - 1] < 0.8
    assert ((chosen.sender == "0-0") & (chosen.receiver == "1-1") & (chosen.input == "k")).any()


def test_refused_where_edges_do_not_add_up(task):
    clean, corrupted, metric = task
    with pytest.raises(probe.ProbeError, match="pre-LayerNorm"):
        probe.edges(small_model("bert"), clean, corrupted, metric)


def test_bad_metric(model, task):
    clean, corrupted, _ = task
    with pytest.raises(probe.ProbeError, match="not differentiable"):
        probe.edges(model, clean, corrupted, lambda out: out.logits[:, -1].argmax(-1).float())
