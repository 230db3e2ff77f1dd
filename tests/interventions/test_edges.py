"""Edges and circuits on the induction model: exact edge patching reproduces both runs at its
ends, the previous-token head feeds the induction heads' keys, and a quarter of the edges keep
80% of the behaviour."""

import pytest
import torch
from induction import MODEL
from models import small_model
from test_patching import pairs, repeats_metric

import probe
from probe.interventions.edge_patching import patch_edges
from probe.interventions.graph import graph

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
        torch.testing.assert_close(ends[0], metric(model(**clean).logits), atol=1e-4, rtol=0)
        torch.testing.assert_close(ends[1], metric(model(**corrupted).logits), atol=1e-4, rtol=0)


@pytest.mark.slow
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
        probe.edges(model, clean, corrupted, lambda logits: logits[:, -1].argmax(-1).float())


def _lm(kind):
    import transformers as tf
    from models import SMALL

    torch.manual_seed(0)
    if kind == "gpt2":  # LayerNorm
        config = tf.GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=99, n_positions=64)
        model = tf.GPT2LMHeadModel(config).eval()
    else:  # RMSNorm, a head per key and value
        config = tf.LlamaConfig(**SMALL, intermediate_size=64, attention_bias=True)
        model = tf.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # biases and norms' weights that count (they start at 0 and 1)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif "ln" in name or "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _gradients(model, inputs, metric, names, start=None):
    """∂Σmetric/∂point for the ``names`` by autograd through probe's own points (a
    ``hook_q_input`` head by head through the norm and its projection), on ``inputs`` with the
    first block's input replaced by ``start`` where given."""
    start = None if start is None else start.clone().requires_grad_(True)  # a gradient per head
    fns = {} if start is None else {"blocks.0.hook_resid_pre": lambda x, hook: start}
    with probe.hooks(model, fns), probe.trace(model, names, incl_bwd=True) as cache:
        metric(model(**inputs).logits).sum().backward()
    model.zero_grad(set_to_none=True)
    return {name: cache[f"{name}_grad"] for name in names}


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("method", ["eap", "eap-ig"])
def test_scores_against_autograd_edge_by_edge(kind, method):
    """Every edge's score, δ_sender · ∂metric/∂receiver's input averaged over the steps, with the
    gradients taken here by autograd at each interpolated run and the senders traced here."""
    model = _lm(kind)
    g = torch.Generator().manual_seed(1)
    clean = {"input_ids": torch.randint(3, 99, (3, 7), generator=g)}
    corrupted = {"input_ids": clean["input_ids"].clone()}
    corrupted["input_ids"][:, 2:4] = torch.randint(3, 99, (3, 2), generator=g)
    answer = clean["input_ids"][:, -1]

    def metric(logits, pairs=slice(None)):  # one position's logits: most rows of the gradient 0
        logp = torch.log_softmax(logits[:, -2].float(), dim=-1)
        return logp[torch.arange(len(logp)), answer[pairs]]

    steps = 3
    scores = probe.edges(model, clean, corrupted, metric, method=method, steps=steps)
    graph_ = graph(model)
    senders = sorted({p for _, p, _ in graph_.senders})
    receivers = sorted({p for *_, p, _ in graph_.receivers})
    with torch.no_grad(), probe.trace(model, senders) as c:
        model(**clean)
    with torch.no_grad(), probe.trace(model, senders) as r:
        model(**corrupted)
    alphas = [k / steps for k in range(1, steps + 1)] if method == "eap-ig" else [0.0]
    start = "blocks.0.hook_resid_pre"
    runs = [
        _gradients(model, corrupted, metric, receivers, torch.lerp(r[start], c[start], a))
        for a in alphas
    ]
    expected = []
    for s, rec in graph_.edges:
        _, s_point, s_head = graph_.senders[s]
        *_, r_point, r_head = graph_.receivers[rec]
        delta = c[s_point] - r[s_point]
        delta = delta if s_head is None else delta[:, :, s_head]
        total = 0
        for grads in runs:
            grad = grads[r_point] if r_head is None else grads[r_point][:, :, r_head]
            total = total + (delta.double() * grad.double()).sum((1, 2))
        expected.append(float(total.mean()) / len(alphas))
    torch.testing.assert_close(
        torch.tensor(scores.score.values).double(),
        torch.tensor(expected, dtype=torch.float64),
        atol=1e-6,
        rtol=1e-4,
    )


def _pairs_for(n_pairs=3, length=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    clean = {"input_ids": torch.randint(3, 99, (n_pairs, length), generator=g)}
    corrupted = {"input_ids": clean["input_ids"].clone()}
    corrupted["input_ids"][:, 2:4] = torch.randint(3, 99, (n_pairs, 2), generator=g)
    answer = clean["input_ids"][:, -1]

    def metric(logits, pairs=slice(None)):  # the pairs it is given, where they run in chunks
        logp = torch.log_softmax(logits[:, -2].float(), dim=-1)
        return logp[torch.arange(len(logp)), answer[pairs]]

    return clean, corrupted, metric


def _smallest(call) -> int:
    """The smallest budget a ProbeError for ``max_bytes=1`` names."""
    import re

    with pytest.raises(probe.ProbeError, match=r"too small for .* at least max_bytes=") as e:
        call(1)
    assert "\n" not in str(e.value)
    return int(re.search(r"at least max_bytes=([\d,]+)", str(e.value)).group(1).replace(",", ""))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("method", ["eap", "eap-ig"])
def test_scores_do_not_depend_on_the_budget(kind, method, monkeypatch):
    """4 GiB takes every pair and position at once; the smallest budget that works (named by
    the error for a smaller one) takes positions a few at a time, and a budget between them
    whole pairs; the scores and their intervals agree to float rounding. (The runs' own share
    is left out here, as a model of Llama-3-8B's width has it: each pair's scores then need
    more than its runs; tests/interventions/test_budget.py chunks the runs.)"""
    from probe.interventions import edge_scores as module

    monkeypatch.setattr(module, "run_bytes", lambda *args, **kwargs: 0)
    # In float64: a budget that splits the pairs also runs the model on fewer of them at a time,
    # and with two threads a float32 run of fewer rows rounds otherwise, which this random
    # model's cancelling scores raise to 1e-4 of the largest; here only the products are float32.
    model = _lm(kind).double()
    clean, corrupted, metric = _pairs_for()

    def scores(max_bytes):
        return probe.edges(model, clean, corrupted, metric, method, 2, max_bytes=max_bytes)

    smallest = _smallest(scores)
    whole = scores(4 << 30)
    assert whole.attrs["chunks"] == 1
    scale = float(whole.score.abs().max())  # float32 products, summed in float64
    for budget in (smallest, 2 * smallest, smallest + 2 * 7 * (smallest // 2)):
        chunked = scores(budget)
        for column in ("score", "score_low", "score_high"):
            torch.testing.assert_close(
                torch.tensor(chunked[column].values),
                torch.tensor(whole[column].values),
                rtol=1e-5,
                atol=1e-6 * scale,
            )
    assert scores(smallest).attrs["chunks"] > 3  # pairs' positions split


def test_eap_ig_with_one_step():
    """One step runs at α = 1 only; the corrupted run is still measured, in a pass of its own."""
    model = _lm("gpt2")
    clean, corrupted, metric = _pairs_for()
    one = probe.edges(model, clean, corrupted, metric, "eap-ig", steps=1)
    with torch.no_grad():
        assert one.attrs["corrupted"] == pytest.approx(
            float(metric(model(**corrupted).logits).mean())
        )
    assert one.attrs["steps"] == 1 and one.score.abs().max() > 0


@pytest.mark.slow
def test_edge_patching_does_not_depend_on_the_budget():
    """Sets of edges patched one copy of the pairs at a time (the smallest budget, named by
    the error for a smaller one) measure what they measure all in one forward pass."""
    model = _lm("llama")
    clean, corrupted, metric = _pairs_for()
    n = len(graph(model).edges)
    kept = torch.rand(5, n, generator=torch.Generator().manual_seed(2)) < 0.5

    def patched(max_bytes):
        return patch_edges(model, clean, corrupted, metric, kept, max_bytes=max_bytes)

    smallest = _smallest(patched)
    torch.testing.assert_close(patched(smallest), patched(4 << 30), rtol=1e-5, atol=1e-5)
