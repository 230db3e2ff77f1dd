"""Hook points mirrored onto Hugging Face models: outputs unchanged, captures exact, edits real."""

import pytest
import torch
import transformers as tf
from models import CONFIGS, ENCODERS, ROTARY, padded_batch, small_model

import probe
from probe.architectures import architecture, blocks

KINDS = sorted(CONFIGS)


def projection_io(model, batch):
    """Each layer's attention input and output-projection output, from plain forward hooks."""
    arch = architecture(model)
    inputs, outputs, handles = [], [], []
    unique = list(dict.fromkeys(blocks(model)))  # ALBERT's one shared block runs every layer
    for block in unique:
        attn, o = block.get_submodule(arch.attention), block.get_submodule(arch.o)
        handles.append(
            attn.register_forward_pre_hook(
                lambda m, a, k: inputs.append(_hidden(a, k)), with_kwargs=True
            )
        )
        handles.append(o.register_forward_hook(lambda m, a, out: outputs.append(out)))
    with torch.no_grad():
        model(**batch)
    for h in handles:
        h.remove()
    return inputs, outputs


def _hidden(args, kwargs):
    return args[0] if args else kwargs.get("hidden_states", kwargs.get("query"))


@pytest.mark.parametrize("kind", KINDS)
def test_outputs_unchanged_and_restored(kind):
    model = small_model(kind)
    batch = padded_batch(kind)
    real = batch["attention_mask"].bool()
    before = model.config._attn_implementation
    with torch.no_grad():
        expected = model(**batch).last_hidden_state
        with probe.trace(model):
            got = model(**batch).last_hidden_state
        after = model(**batch).last_hidden_state
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)
    assert model.config._attn_implementation == before
    assert torch.equal(after, expected)


@pytest.mark.parametrize("kind", KINDS)
def test_pattern_equals_eager_attentions(kind):
    model = small_model(kind, attn_implementation="eager")
    batch = padded_batch(kind)
    with torch.no_grad():
        eager = model(**batch, output_attentions=True)
        with probe.trace(model, "hook_pattern") as cache:
            got = model(**batch).last_hidden_state
    torch.testing.assert_close(got, eager.last_hidden_state, atol=1e-6, rtol=0)
    for layer, attentions in enumerate(eager.attentions):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"]
        assert pattern.shape == (3, 4, 7, 7)
        torch.testing.assert_close(pattern, attentions, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_shapes_results_and_queries(kind):
    model = small_model(kind)
    batch = padded_batch(kind)
    weights = probe.head_weights(model)
    real = batch["attention_mask"].bool()
    with probe.trace(model) as cache:
        inputs, outputs = projection_io(model, batch)
    n_kv = weights[0].W_K.shape[0]
    for layer, w in enumerate(weights):
        name = f"blocks.{layer}.attn."
        assert cache[name + "hook_q"].shape == (3, 7, 4, 8)
        assert cache[name + "hook_k"].shape == cache[name + "hook_v"].shape == (3, 7, n_kv, 8)
        assert cache[name + "hook_attn_scores"].shape == (3, 4, 7, 7)
        assert cache[name + "hook_z"].shape == (3, 7, 4, 8)
        result = cache[name + "hook_result"]
        assert result.shape == (3, 7, 4, 32)
        torch.testing.assert_close(
            (result.sum(2) + w.b_O)[real], outputs[layer][real], atol=1e-5, rtol=0
        )
        x = inputs[layer]
        for head in range(n_kv):  # values are never rotated or normalised: every layout
            expected_v = x @ w.W_V[head] + w.b_V[head]
            torch.testing.assert_close(
                cache[name + "hook_v"][:, :, head], expected_v, atol=1e-5, rtol=0
            )
        if kind in ROTARY:  # hook_q there is after the rotary embedding (and Qwen3's q_norm)
            continue
        scale = model.config.hidden_size // 4 if kind == "opt" else 1  # OPT pre-scales queries
        for head in range(4):
            expected = (x @ w.W_Q[head] + w.b_Q[head]) / scale**0.5
            torch.testing.assert_close(
                cache[name + "hook_q"][:, :, head], expected, atol=1e-5, rtol=0
            )


@pytest.mark.parametrize("kind", KINDS)
def test_zeroing_a_head_removes_exactly_its_term(kind):
    model = small_model(kind)
    batch = padded_batch(kind)
    layer, head = 1, 2
    with probe.trace(model, f"blocks.{layer}.attn.hook_result") as cache:
        _, full = projection_io(model, batch)

    def zero(z, name):
        z = z.clone()
        z[:, :, head] = 0
        return z

    with probe.hooks(model, {f"blocks.{layer}.attn.hook_z": zero}):
        _, ablated = projection_io(model, batch)
        with probe.ablate(model, [(layer, head)]):
            _, helper = projection_io(model, batch)
    term = cache[f"blocks.{layer}.attn.hook_result"][:, :, head]
    torch.testing.assert_close(ablated[layer], full[layer] - term, atol=1e-5, rtol=0)
    torch.testing.assert_close(helper[layer], full[layer] - term, atol=1e-5, rtol=0)
    torch.testing.assert_close(ablated[0], full[0])


@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama"])
def test_edits_of_pattern_and_result_change_the_output(kind):
    model = small_model(kind)
    batch = padded_batch(kind)
    with torch.no_grad():
        plain = model(**batch).last_hidden_state

        def to_first_key(p, name):
            out = torch.zeros_like(p)
            out[..., 0] = 1
            return out

        with probe.hooks(model, {"blocks.0.attn.hook_pattern": to_first_key}):
            edited = model(**batch).last_hidden_state
        with probe.hooks(model, {"blocks.1.attn.hook_result": lambda r, n: r * 0}):
            no_attention = model(**batch).last_hidden_state
    assert (edited - plain).abs().max() > 1e-3
    assert (no_attention - plain).abs().max() > 1e-3


def test_head_weights_layouts():
    albert = small_model("albert")
    w = probe.head_weights(albert)
    assert len(w) == 3 and w[0].W_Q.data_ptr() == w[2].W_Q.data_ptr()  # one shared layer
    llama = probe.head_weights(small_model("llama"))
    assert llama[0].W_K.shape == (2, 32, 8)
    assert llama[0].kv_head.tolist() == [0, 0, 1, 1]


def test_nested_traces_share_one_mirror_and_restore():
    model = small_model("gpt2")
    batch = padded_batch("gpt2")
    with torch.no_grad(), probe.trace(model, "hook_z") as outer:
        with probe.trace(model, "hook_pattern") as inner:
            model(**batch)
        assert model.config._attn_implementation == "probe"
    assert model.config._attn_implementation == "sdpa"
    assert len(outer) == 2 and len(inner) == 2


def test_hooks_are_removed_after_an_exception():
    model = small_model("bert")
    with pytest.raises(RuntimeError, match="boom"), probe.trace(model):
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    assert not model._forward_pre_hooks and not model.base_model._forward_pre_hooks


def test_unsupported_architectures_are_clear_errors():
    config = tf.DebertaV2Config(hidden_size=32, num_attention_heads=4, num_hidden_layers=1)
    deberta = tf.AutoModel.from_config(config)
    with pytest.raises(probe.ProbeError, match=r"deberta-v2.*supported: albert, bart, bert"):
        probe.trace(deberta).__enter__()


def test_minilm_outputs_and_patterns(minilm):
    model, tokenizer = minilm
    batch = tokenizer(
        ["The quick brown fox jumps over the lazy dog.", "A short one."],
        return_tensors="pt",
        padding=True,
    )
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        expected = model(**batch).last_hidden_state
        eager = model.__class__.from_pretrained(model.name_or_path, attn_implementation="eager")
        attentions = eager.eval()(**batch, output_attentions=True).attentions
        with probe.trace(model, ["hook_pattern", "hook_result"]) as cache:
            got = model(**batch).last_hidden_state
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)
    assert len(cache) == 12
    for layer in range(6):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"]
        torch.testing.assert_close(pattern, attentions[layer], atol=1e-5, rtol=0)
        assert (pattern[1, :, :, real[1].sum() :] == 0).all()


def test_encoders_and_decoders_are_both_listed():
    assert set(KINDS) > ENCODERS


def test_gradients_flow_through_soft_capping():
    """Gemma 2's capped scores backpropagate (importance takes gradients through hook_z)."""
    model = small_model("gemma2")
    batch = padded_batch("gemma2")
    gate = torch.ones(4, requires_grad=True)
    with probe.hooks(model, {"blocks.0.attn.hook_z": lambda z, hook: z * gate[:, None]}):
        model(**batch).last_hidden_state.sum().backward()
    assert gate.grad is not None and gate.grad.abs().sum() > 0
