"""After every call of patch, attribute, edges, patch_edges and circuit, failed or not, the model is
exactly as it was: the same outputs bit for bit, no hook on any module, no gradient in any
``.grad``, the same ``requires_grad`` flags, modes and attention implementation. A mistake in the
inputs or the metric is one line."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import GPT2Config, GPT2LMHeadModel

import probe
from probe.interventions.edge_patching import patch_edges
from probe.interventions.graph import graph
from probe.interventions.guard import HOOK_DICTS

PAIRS, LENGTH, VOCAB = 3, 6, 50


def lm(seed=0):
    torch.manual_seed(seed)
    config = GPT2Config(n_embd=16, n_head=2, n_layer=2, vocab_size=VOCAB, n_positions=32)
    return GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module")
def model():
    return lm()


def tokens(seed, pairs=PAIRS, length=LENGTH):
    return torch.randint(1, VOCAB, (pairs, length), generator=torch.Generator().manual_seed(seed))


CLEAN, CORRUPTED = tokens(1), tokens(2)


def good(logits):
    return logits[:, -1].log_softmax(-1)[:, 7]


def state(model):
    """Everything a call could leave changed, and the output on a fixed input, bit for bit."""
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(0)  # the same dropout, where a model is in training mode
        out = model(input_ids=CLEAN).logits.clone()
    return {
        "out": out,
        "hooks": sum(len(getattr(m, d, {})) for m in model.modules() for d in HOOK_DICTS),
        "grads": [p.grad for p in model.parameters()],
        "flags": [p.requires_grad for p in model.parameters()],
        "training": [m.training for m in model.modules()],
        "implementation": model.config._attn_implementation,
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
    }


def assert_same(before, after):
    assert torch.equal(before["out"], after["out"])
    for key in ("hooks", "flags", "training", "implementation"):
        assert before[key] == after[key], key
    assert all(a is b for a, b in zip(before["grads"], after["grads"], strict=True))
    for name, value in before["weights"].items():
        assert torch.equal(value, after["weights"][name]), name


def calls(model, clean, corrupted, metric, **options):
    """Each guarded function, called alike."""
    g = graph(model)
    return {
        "patch": lambda: probe.patch(model, clean, corrupted, metric, **options),
        "attribute": lambda: probe.attribute(model, clean, corrupted, metric, **options),
        "edges": lambda: probe.edges(model, clean, corrupted, metric, **options),
        "patch_edges": lambda: patch_edges(
            model, clean, corrupted, metric, torch.ones(1, len(g.edges), dtype=torch.bool)
        ),
        "circuit": lambda: probe.circuit(model, clean, corrupted, metric, points=3, **options),
    }


def raises(logits):
    return logits[:, -1, VOCAB + 5]  # IndexError in the user's code


@pytest.mark.parametrize("name", ["patch", "attribute", "edges", "patch_edges", "circuit"])
def test_a_metric_that_raises_leaves_the_model_as_it_was(model, name):
    before = state(model)
    with pytest.raises(probe.ProbeError, match=r"the metric raised IndexError: .*\(at ") as e:
        calls(model, CLEAN, CORRUPTED, raises)[name]()
    assert "\n" not in str(e.value) and "logits [3, 6, 50]" in str(e.value)
    assert_same(before, state(model))


@pytest.mark.parametrize("name", ["patch", "attribute", "edges", "patch_edges", "circuit"])
def test_an_interrupt_mid_call_leaves_the_model_as_it_was(model, name):
    """Ctrl-C in the middle of a forward pass: no hook is left behind."""
    before = state(model)

    def interrupted(logits):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        calls(model, CLEAN, CORRUPTED, interrupted)[name]()
    assert_same(before, state(model))


@pytest.mark.parametrize(
    ("value", "said"),
    [(float("nan"), "returned nan for pair 1"), (float("inf"), "returned inf for pair 1")],
)
def test_nan_and_inf_metrics_are_one_line(model, value, said):
    def broken(logits):
        out = good(logits).clone()
        out[1] = value
        return out

    before = state(model)
    for name, call in calls(model, CLEAN, CORRUPTED, broken).items():
        with pytest.raises(probe.ProbeError, match=said):
            call()
        assert_same(before, state(model)), name


def test_a_scalar_nan_names_the_batch(model):
    with pytest.raises(probe.ProbeError, match="returned nan for the batch"):
        probe.patch(model, CLEAN, CORRUPTED, lambda logits: logits.sum() * float("nan"))


def test_integer_metrics_patch_and_are_refused_by_gradients(model):
    counts = probe.patch(model, CLEAN, CORRUPTED, lambda logits: logits[:, -1].argmax(-1))
    assert counts.metric.dtype == "float64"
    before = state(model)
    with pytest.raises(probe.ProbeError, match="not differentiable"):
        probe.attribute(model, CLEAN, CORRUPTED, lambda logits: logits[:, -1].argmax(-1))
    assert_same(before, state(model))


def test_training_mode_is_refused_in_one_line():
    model = lm().train()
    before = state(model)
    for name, call in calls(model, CLEAN, CORRUPTED, good).items():
        with pytest.raises(probe.ProbeError, match=r"training mode .*call model\.eval\(\)"):
            call()
        assert_same(before, state(model)), name


def test_frozen_parameters_and_existing_gradients_are_kept():
    """A model half frozen, with gradients of the user's own in .grad: the same numbers as the
    untouched model, and the flags and gradients as they were, the very tensors."""
    reference = probe.attribute(lm(), CLEAN, CORRUPTED, good)
    model = lm()
    for p in model.transformer.h[0].parameters():
        p.requires_grad_(False)
    model(input_ids=CLEAN).logits.sum().backward()
    before = state(model)
    assert any(g is not None for g in before["grads"]) and not all(before["flags"])
    got = probe.attribute(model, CLEAN, CORRUPTED, good)
    assert got.equals(reference)
    probe.edges(model, CLEAN, CORRUPTED, good)
    assert_same(before, state(model))


@pytest.mark.parametrize(
    ("clean", "corrupted", "said"),
    [
        (tokens(1, pairs=0), tokens(2, pairs=0), "no pairs"),
        (tokens(1, pairs=2), tokens(2), r"batch sizes differ|differ in shape"),
        (tokens(1, length=5), tokens(2), "differ in shape"),
        (
            {"input_ids": CLEAN, "attention_mask": torch.ones(PAIRS, LENGTH, dtype=torch.long)},
            {
                "input_ids": CORRUPTED,
                "attention_mask": torch.tril(torch.ones(PAIRS, LENGTH)).long(),
            },
            "attention_mask differ",
        ),
        ({"input_ids": CLEAN}, {"x": CORRUPTED}, "the same arguments"),
        (CLEAN.float(), CORRUPTED, "token ids"),
    ],
)
def test_mismatched_pairs_are_one_line(model, clean, corrupted, said):
    before = state(model)
    for name, call in calls(model, clean, corrupted, good).items():
        with pytest.raises(probe.ProbeError, match=said) as e:
            call()
        assert "\n" not in str(e.value), name
    assert_same(before, state(model))


@pytest.mark.parametrize(
    ("call", "said"),
    [
        (lambda m: probe.attribute(m, CLEAN, CORRUPTED, good, "nosuch"), "method must be one of"),
        (lambda m: probe.edges(m, CLEAN, CORRUPTED, good, "eap-nosuch"), "method must be one of"),
        (lambda m: probe.attribute(m, CLEAN, CORRUPTED, good, "ig", steps=0), "steps must be"),
        (lambda m: probe.edges(m, CLEAN, CORRUPTED, good, steps=-1), "steps must be"),
        (lambda m: probe.circuit(m, CLEAN, CORRUPTED, good, 1.5), r"faithfulness must be in"),
        (lambda m: probe.circuit(m, CLEAN, CORRUPTED, good, float("nan")), "faithfulness must"),
        (lambda m: probe.circuit(m, CLEAN, CORRUPTED, good, points=1), "points must be"),
        (lambda m: probe.patch(m, CLEAN, CORRUPTED, good, max_rows=0), "max_rows must be"),
        (lambda m: probe.patch(m, CLEAN, CORRUPTED, good, hook="hook_nosuch"), "cannot patch"),
        (lambda m: probe.patch("gpt2", CLEAN, CORRUPTED, good), "must be a torch.nn.Module"),
    ],
)
def test_options_out_of_range_are_one_line(model, call, said):
    before = state(model)
    with pytest.raises(probe.ProbeError, match=said) as e:
        call(model)
    assert "\n" not in str(e.value)
    assert_same(before, state(model))


# -- any input at all --------------------------------------------------------------------------

METRICS = {
    "per pair": good,
    "scalar": lambda logits: good(logits).mean(),
    "python float": lambda logits: float(logits.sum()),
    "constant": lambda logits: torch.zeros(logits.shape[0]),
    "nan": lambda logits: good(logits) * float("nan"),
    "raises": raises,
    "wrong shape": lambda logits: logits[:, -1, :2],
    "integer": lambda logits: logits[:, -1].argmax(-1),
    "a string": lambda logits: "high",
    "output object": lambda out: out.logits[:, -1, 0],
}


@pytest.mark.slow
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    name=st.sampled_from(["patch", "attribute", "edges", "patch_edges", "circuit"]),
    metric=st.sampled_from(sorted(METRICS)),
    pairs=st.integers(0, 3),
    lengths=st.tuples(st.integers(1, 6), st.integers(1, 6)),
    as_dict=st.booleans(),
    options=st.sampled_from(
        [{}, {"method": "eap"}, {"method": "atp*"}, {"steps": 0}, {"method": "bogus"}]
    ),
)
def test_any_call_leaves_the_model_as_it_was(model, name, metric, pairs, lengths, as_dict, options):
    """Whatever the inputs, the call returns or raises ProbeError in one line, and the model is
    as it was."""
    clean, corrupted = tokens(3, pairs, lengths[0]), tokens(4, pairs, lengths[1])
    if as_dict:
        clean, corrupted = {"input_ids": clean}, {"input_ids": corrupted}
    takes_options = name in ("attribute", "edges", "circuit")  # method and steps
    before = state(model)
    try:
        calls(model, clean, corrupted, METRICS[metric], **(options if takes_options else {}))[
            name
        ]()
    except probe.ProbeError as e:
        assert "\n" not in str(e)
    assert_same(before, state(model))


@pytest.mark.parametrize("after", [0, 3, 8])
def test_an_interrupt_while_hooks_attach_leaves_none(model, monkeypatch, after):
    """Ctrl-C while the hook points are being attached, before any block that would remove them
    has begun: the guard removes those already attached."""
    before = state(model)
    register = torch.nn.Module.register_forward_hook
    count = [0]

    def interrupted(self, *args, **kwargs):
        count[0] += 1
        if count[0] > after:
            raise KeyboardInterrupt
        return register(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "register_forward_hook", interrupted)
    with pytest.raises(KeyboardInterrupt):
        probe.patch(model, CLEAN, CORRUPTED, good)
    monkeypatch.undo()
    assert_same(before, state(model))
