"""TransformerLens's metric contract: token tensors for inputs, ``metric(logits)``, and a scalar
(the batch mean) accepted wherever a per-pair metric is, with the same numbers and no intervals.
"""

import math

import pytest
import torch
from induction import BOS, MODEL, fresh, repeated

import probe

N = 12  # the copy length
PAIRS = 6


@pytest.fixture(scope="module")
def model():
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(MODEL, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokens():
    """TransformerLens-style prompts: token ids ``[pairs, pos]``, clean BOS A A, corrupted
    BOS A' A."""
    clean = repeated(PAIRS, N, seed=3)
    other = fresh(PAIRS, N, seed=103)
    corrupted = torch.cat([other[:, :1], other[:, 1 + N :], clean[:, 1 + N :]], dim=1)
    assert (corrupted[:, 0] == BOS).all()
    return clean, corrupted


def per_pair_metric(clean_tokens):
    """[pairs]: the mean log-probability of the second copy's predictable tokens."""

    def metric(logits):
        logp = logits.log_softmax(-1)[:, N + 1 : -1]
        rows = clean_tokens[: len(logp), N + 2 :]
        return logp.gather(-1, rows[..., None])[..., 0].mean(-1)

    return metric


@pytest.mark.slow
def test_a_transformer_lens_script_runs_unchanged(model, tokens):
    """Written as for TransformerLens: token tensors, and ``metric(logits)`` returning the batch
    mean. attribute, patch, edges and circuit all run, and give the per-pair form's numbers."""
    clean_tokens, corrupted_tokens = tokens

    def metric(logits):  # TransformerLens's habit: one scalar, the mean over the batch
        logp = logits.log_softmax(-1)[:, N + 1 : -1]
        answers = clean_tokens[: len(logp), N + 2 :]
        return logp.gather(-1, answers[..., None])[..., 0].mean()

    attributed = probe.attribute(model, clean_tokens, corrupted_tokens, metric)
    patched = probe.patch(model, clean_tokens, corrupted_tokens, metric)
    scores = probe.edges(model, clean_tokens, corrupted_tokens, metric, method="eap")
    kept, curve = probe.circuit(model, clean_tokens, corrupted_tokens, metric, scores=scores)

    # The per-pair form, with dicts of keyword arguments: the same estimates, with intervals.
    clean, corrupted = {"input_ids": clean_tokens}, {"input_ids": corrupted_tokens}
    each = per_pair_metric(clean_tokens)
    attributed_each = probe.attribute(model, clean, corrupted, each)
    patched_each = probe.patch(model, clean, corrupted, each)
    scores_each = probe.edges(model, clean, corrupted, each, method="eap")
    kept_each, curve_each = probe.circuit(model, clean, corrupted, each, scores=scores_each)

    for table, column in ((attributed, "attribution"), (patched, "effect"), (scores, "score")):
        assert table.attrs["metric"] == "scalar" and table.attrs["pairs"] == PAIRS
        assert table[f"{column}_low"].isna().all() and table[f"{column}_high"].isna().all()
    for table, column in (
        (attributed_each, "attribution"),
        (patched_each, "effect"),
        (scores_each, "score"),
    ):
        assert table.attrs["metric"] == "per pair"
        assert table[f"{column}_low"].notna().all()
    largest = attributed_each.attribution.abs().max()
    assert largest > 0.1  # a real signal, not zeros compared with zeros
    assert (attributed.attribution - attributed_each.attribution).abs().max() < 1e-5 * largest
    assert (patched.effect - patched_each.effect).abs().max() < 1e-5
    assert (patched.metric - patched_each.metric).abs().max() < 1e-5
    for key in ("clean", "corrupted"):
        assert patched.attrs[key] == pytest.approx(patched_each.attrs[key], abs=1e-5)
        assert attributed.attrs[key] == pytest.approx(attributed_each.attrs[key], abs=1e-5)
    assert (scores.score - scores_each.score).abs().max() < 1e-5 * scores_each.score.abs().max()
    assert curve.attrs["chosen"] == curve_each.attrs["chosen"]
    assert curve.attrs["metric"] == "scalar" and curve_each.attrs["metric"] == "per pair"
    assert (curve.faithfulness - curve_each.faithfulness).abs().max() < 1e-4
    assert list(kept.index) == list(kept_each.index)


@pytest.mark.slow
def test_token_tensors_equal_keyword_arguments(model, tokens):
    clean_tokens, corrupted_tokens = tokens
    metric = per_pair_metric(clean_tokens)
    as_tensors = probe.patch(model, clean_tokens, corrupted_tokens, metric, heads=[(1, 1)])
    as_dicts = probe.patch(
        model, {"input_ids": clean_tokens}, {"input_ids": corrupted_tokens}, metric, heads=[(1, 1)]
    )
    assert as_tensors.equals(as_dicts)
    # Mixed: token ids on one side, keyword arguments on the other.
    mixed = probe.attribute(model, clean_tokens, {"input_ids": corrupted_tokens}, metric)
    plain = probe.attribute(model, {"input_ids": clean_tokens}, corrupted_tokens, metric)
    assert mixed.equals(plain)


def test_scalar_metric_of_a_linear_module_equals_the_per_pair_mean():
    """probe's own attention module, whose output is a tensor: a scalar metric (the mean of the
    per-pair one) gives the same effects and attributions, exactly linear here."""
    torch.manual_seed(0)
    d, h = 16, 4
    mha = probe.MultiHeadAttention(d, h).eval()
    clean, corrupted = {"query": torch.randn(5, 6, d)}, {"query": torch.randn(5, 6, d)}
    w = torch.randn(d)

    def each(out):
        return out[:, -1] @ w

    def scalar(out):
        return (out[:, -1] @ w).mean()

    for call in (probe.patch, probe.attribute):
        a, b = call(mha, clean, corrupted, each), call(mha, clean, corrupted, scalar)
        column = "effect" if call is probe.patch else "attribution"
        torch.testing.assert_close(
            torch.tensor(b[column].to_numpy()), torch.tensor(a[column].to_numpy()), atol=1e-5,
            rtol=1e-5,
        )  # fmt: skip
        assert b[f"{column}_low"].isna().all() and not a[f"{column}_low"].isna().any()
        assert (a.attrs["metric"], b.attrs["metric"]) == ("per pair", "scalar")


def test_a_metric_that_changes_form_is_refused():
    torch.manual_seed(0)
    mha = probe.MultiHeadAttention(8, 2).eval()
    clean, corrupted = {"query": torch.randn(3, 4, 8)}, {"query": torch.randn(3, 4, 8)}
    calls = []

    def fickle(out):
        calls.append(1)
        return out[:, -1].sum(-1) if len(calls) == 1 else out[:, -1].sum()

    with pytest.raises(probe.ProbeError, match="one value per pair on some runs and a scalar"):
        probe.patch(mha, clean, corrupted, fickle)


def test_a_metric_of_the_output_object_is_told_what_changed(model, tokens):
    clean_tokens, corrupted_tokens = tokens
    with pytest.raises(probe.ProbeError, match=r"given the logits.*write metric\(logits\)") as e:
        probe.patch(model, clean_tokens, corrupted_tokens, lambda out: out.logits[:, -1, 0])
    assert "\n" not in str(e.value) and e.value.__suppress_context__


def test_a_logits_metric_on_a_model_without_an_lm_head_is_told_to_load_it(tokens):
    """A metric that reads ``.log_softmax``, given the output object of a model loaded without
    its LM head (no logits), is told to load the head, not shown the metric's AttributeError."""
    from transformers import GPT2Model

    clean_tokens, corrupted_tokens = tokens
    base = GPT2Model.from_pretrained(MODEL, dtype=torch.float32).eval()  # probe.load's default
    with pytest.raises(probe.ProbeError, match=r"reads \.log_softmax of the model's output, a "
                       r"BaseModelOutput\w*, which has no logits: load the model with its LM "
                       r"head \(probe\.load\(name, lm_head=True\)") as e:  # fmt: skip
        probe.patch(base, clean_tokens, corrupted_tokens, per_pair_metric(clean_tokens))
    assert "\n" not in str(e.value) and e.value.__suppress_context__


@pytest.mark.parametrize(
    ("bad", "said"),
    [
        (torch.randn(2, 5), "must hold token ids, \\[batch, pos\\] integers; got float32"),
        (torch.tensor([1, 2, 3]), "of shape \\(3,\\)"),
        ([[1, 2, 3]], "not a list"),
    ],
)
def test_bad_inputs_are_one_line(model, bad, said):
    ids = torch.tensor([[0, 1, 2]])
    with pytest.raises(probe.ProbeError, match=said) as e:
        probe.patch(model, bad, ids, lambda logits: logits[:, -1, 0])
    assert "\n" not in str(e.value)


def test_a_wrong_shape_names_both_forms(model, tokens):
    clean_tokens, corrupted_tokens = tokens
    with pytest.raises(probe.ProbeError, match=r"shape \(6,\), or a scalar"):
        probe.patch(model, clean_tokens, corrupted_tokens, lambda logits: logits[:, -1, :2])


def test_one_pair_is_per_pair_either_way(model, tokens):
    clean_tokens, corrupted_tokens = (t[:1] for t in tokens)
    table = probe.patch(
        model, clean_tokens, corrupted_tokens, lambda logits: logits[0, -1, 3], heads=[(0, 0)]
    )
    assert table.attrs["metric"] == "per pair" and table.attrs["pairs"] == 1
    assert math.isnan(table.effect_low[0])


def _state(model) -> list:
    """What a call must leave as it was: every parameter, flag and gradient, and the hooks."""
    return [(p.detach().clone(), p.requires_grad, p.grad) for p in model.parameters()] + [
        (len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()
    ]


def _same(before: list, after: list) -> bool:
    return len(before) == len(after) and all(
        torch.equal(a[0], b[0]) and a[1:] == b[1:] if isinstance(a[0], torch.Tensor) else a == b
        for a, b in zip(before, after, strict=True)
    )


@pytest.mark.parametrize(
    ("inputs", "said"),
    [
        ({"input_ids": torch.tensor([0, 1, 2])}, r"clean\['input_ids'\] has shape \(3,\); it must "
         r"be \[batch, pos\] \(one sequence: add the batch dimension, input_ids\[None\]\)"),
        (torch.tensor([[0, 1, 10**6]]), r"clean\['input_ids'\] holds token id 1000000, outside "
         r"the model's vocabulary \(0 … 63\)"),
        (torch.tensor([[0, -5, 2]]), r"clean\['input_ids'\] holds token id -5"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("call", ["patch", "attribute", "edges"])
def test_inputs_the_model_cannot_read_name_the_argument(model, inputs, said, call):
    corrupted = {k: v.clamp(0, 63) for k, v in inputs.items()} if isinstance(inputs, dict) else (
        inputs.clamp(0, 63))  # fmt: skip
    before = _state(model)
    with pytest.raises(probe.ProbeError, match=said) as e:
        getattr(probe, call)(model, inputs, corrupted, lambda logits: logits[:, -1, 0])
    assert "\n" not in str(e.value) and _same(before, _state(model))


def test_a_metric_module_taking_pairs_is_given_them(model, tokens):
    """An ``nn.Module`` metric is called as its ``forward`` says: with ``pairs`` where it takes
    them, and the same numbers as the function it wraps."""
    clean_tokens, corrupted_tokens = tokens
    plain = per_pair_metric(clean_tokens)
    seen = []

    class WithPairs(torch.nn.Module):
        def forward(self, logits, pairs):
            seen.append(pairs)
            return plain(logits)

    class Without(torch.nn.Module):
        def forward(self, logits):
            return plain(logits)

    expected = probe.patch(model, clean_tokens, corrupted_tokens, plain, heads=[(1, 0)])
    for metric in (WithPairs(), Without()):
        got = probe.patch(model, clean_tokens, corrupted_tokens, metric, heads=[(1, 0)])
        torch.testing.assert_close(torch.tensor(got.effect.values),
                                   torch.tensor(expected.effect.values))  # fmt: skip
    assert seen and all(p == slice(0, PAIRS) for p in seen)


@pytest.mark.parametrize("value", ["0.5", b"0.5"])
def test_a_metric_returning_text_is_refused(model, tokens, value):
    clean_tokens, corrupted_tokens = tokens
    with pytest.raises(probe.ProbeError, match=r"the metric returned a (str|bytes); return a"):
        probe.patch(model, clean_tokens, corrupted_tokens, lambda logits: value)


@pytest.mark.parametrize("budget", [math.nan, math.inf, "lots", 0, -1, True])
@pytest.mark.parametrize("call", ["patch", "attribute", "edges", "circuit"])
def test_a_budget_that_is_no_number_of_bytes_names_max_bytes(model, tokens, budget, call):
    clean_tokens, corrupted_tokens = tokens
    with pytest.raises(probe.ProbeError, match=r"^max_bytes must be a .*number of bytes"):
        getattr(probe, call)(model, clean_tokens, corrupted_tokens,
                             per_pair_metric(clean_tokens), max_bytes=budget)  # fmt: skip


@pytest.mark.parametrize("call", ["attribute", "edges"])
def test_a_gradient_call_under_inference_mode_says_so(model, tokens, call):
    """Not the metric's fault: inference mode turns gradients off for good; no_grad does not."""
    clean_tokens, corrupted_tokens = tokens
    metric = per_pair_metric(clean_tokens)
    before = _state(model)
    with torch.inference_mode(), pytest.raises(probe.ProbeError, match=r"torch\.inference_mode"):
        getattr(probe, call)(model, clean_tokens, corrupted_tokens, metric)
    assert _same(before, _state(model))
    with torch.no_grad():
        getattr(probe, call)(model, clean_tokens, corrupted_tokens, metric)


@pytest.mark.parametrize("samples", [-3, 0, 1, 2.5, "100"])
def test_composition_samples_are_checked(model, samples):
    with pytest.raises(probe.ProbeError, match=r"^samples must be a whole number of at least 2"):
        probe.composition_scores(model, samples=samples)
