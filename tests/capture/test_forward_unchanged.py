"""A trace that edits nothing leaves the model's output bit for bit as it was: the mirror runs
the model's own attention kernel (sdpa or its eager function) and computes what it captures
beside it."""

import pytest
import torch
import transformers as tf
from models import CONFIGS, SEQ2SEQ, small_model
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import probe
from probe.pipeline.runner import decoder_inputs


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", sorted([*CONFIGS, *SEQ2SEQ]))
def test_full_trace_is_bit_identical(kind, implementation):
    if kind == "gemma2" and implementation == "sdpa":
        pytest.skip("transformers runs Gemma 2 eagerly only")
    model = small_model(kind, attn_implementation=implementation)
    ids = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # padding: the mask must be the one the model builds for itself
    inputs = {"input_ids": ids, "attention_mask": mask}
    if kind in SEQ2SEQ:
        inputs = decoder_inputs(model, inputs)
    with torch.no_grad():
        plain = model(**inputs)[0]
        with probe.trace(model) as cache:
            traced = model(**inputs)[0]
        again = model(**inputs)[0]
    assert any(name.endswith("hook_result") for name in cache)  # every point, per-head results too
    assert torch.equal(plain, traced)
    assert torch.equal(plain, again)
    assert model.config._attn_implementation == implementation


# Models with their heads, and the points of theirs that a base model lacks or that only some
# architectures have: the unembedding, the embeddings' and the final norms, Qwen3's and Gemma 3's
# query/key norms, per-head inputs on fused projections.
WITH_HEADS = {
    "bert": (tf.BertForMaskedLM, ["embed_ln.hook_scale", "ln_final.hook_normalized"]),
    "qwen3": (
        tf.Qwen3ForCausalLM, ["blocks.1.attn.q_norm.hook_scale", "blocks.1.attn.hook_k_normed"],
    ),
    "gemma3_text": (
        tf.Gemma3ForCausalLM,
        ["blocks.0.attn.k_norm.hook_normalized", "blocks.0.attn.hook_q_normed"],
    ),
    "gpt2": (tf.GPT2LMHeadModel, ["blocks.1.hook_attn_in", "blocks.1.hook_v_input"]),
    "phi3": (tf.Phi3ForCausalLM, ["blocks.0.hook_k_input", "ln_final.hook_scale"]),
    "bart": (tf.BartForConditionalGeneration, ["hook_pos_embed", "decoder_embed_ln.hook_scale"]),
    "mbart": (
        tf.MBartForConditionalGeneration,
        ["embed_ln.hook_normalized", "decoder_ln_final.hook_scale"],
    ),
    "marian": (tf.MarianMTModel, ["hook_pos_embed", "hook_embed"]),
    "t5": (
        tf.T5ForConditionalGeneration,
        ["encoder_ln_final.hook_scale", "decoder_ln_final.hook_normalized"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", sorted(WITH_HEADS))
def test_full_trace_with_head_is_bit_identical(kind, implementation):
    """The same with the model's head: its logits keep every bit under a trace of every point,
    the new ones included (hook_unembed is the head's output)."""
    head, points = WITH_HEADS[kind]
    torch.manual_seed(0)
    config = (CONFIGS | SEQ2SEQ)[kind]()
    model = head._from_config(config, attn_implementation=implementation).eval()
    ids = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    inputs["attention_mask"][1, 5:] = 0
    if kind in SEQ2SEQ:
        inputs |= {
            "decoder_input_ids": ids[:, :5],
            "decoder_attention_mask": torch.ones_like(ids[:, :5]),
        }
    with torch.no_grad():
        plain = model(**inputs).logits
        with probe.trace(model) as cache:
            traced = model(**inputs).logits
    assert set(points) | {"hook_unembed"} <= set(cache)
    assert torch.equal(plain, traced)
    unembed = cache["hook_unembed"] + getattr(model, "final_logits_bias", 0)  # BART's, after it
    assert torch.equal(unembed, plain)


def test_an_edit_still_changes_the_output():
    model = small_model("llama")
    ids = torch.randint(3, 99, (1, 6), generator=torch.Generator().manual_seed(1))

    def uniform(pattern, hook):
        return torch.tril(torch.ones_like(pattern)) / torch.arange(1, 7).view(6, 1)

    with torch.no_grad():
        plain = model(ids)[0]
        with probe.hooks(model, {"blocks.0.attn.hook_pattern": uniform}):
            edited = model(ids)[0]
        with probe.hooks(model, {"blocks.0.attn.hook_result": lambda r, hook: r * 0}):
            zeroed = model(ids)[0]
    assert not torch.allclose(plain, edited)
    assert not torch.allclose(plain, zeroed)


@pytest.mark.parametrize("kind", sorted([*CONFIGS, *SEQ2SEQ]))
def test_an_eager_models_own_pattern_is_captured(kind, monkeypatch):
    """Under eager attention the pattern captured is the one the model's kernel computed (no
    second computation): equal, bit for bit, to what the untouched model returns as its
    attentions, and the output unchanged."""
    from probe.capture import attention_function

    def computed_again(*args):
        raise AssertionError("the pattern was computed beside the eager kernel")

    monkeypatch.setattr(attention_function, "_pattern_beside", computed_again)
    model = small_model(kind, attn_implementation="eager")
    ids = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    if kind in SEQ2SEQ:
        inputs = decoder_inputs(model, inputs)
    with torch.no_grad():
        plain = model(**inputs, output_attentions=True)
        with probe.trace(model, ["hook_pattern", "hook_z"]) as cache:
            traced = model(**inputs)
    assert torch.equal(plain[0], traced[0])
    own = plain.encoder_attentions if kind in SEQ2SEQ else plain.attentions
    first = "encoder.attn" if kind in SEQ2SEQ else None
    for layer, pattern in enumerate(cache.stack("hook_pattern", attention=first)):
        assert torch.equal(pattern, own[layer])


@pytest.mark.parametrize("kind", ["llama", "gpt2", "bert"])
def test_an_edited_pattern_acts_alike_under_eager_and_sdpa(kind):
    """An edit of the pattern gives the same output whichever kernel the model runs: under
    eager, z comes from the edited pattern the kernel handed on."""
    ids = torch.randint(3, 99, (1, 6), generator=torch.Generator().manual_seed(1))

    def uniform(pattern, hook):
        return torch.ones_like(pattern) / pattern.shape[-1]

    outputs = []
    for implementation in ("eager", "sdpa"):
        model = small_model(kind, attn_implementation=implementation)
        with torch.no_grad(), probe.hooks(model, {"blocks.0.attn.hook_pattern": uniform}):
            outputs.append(model(ids)[0])
        with torch.no_grad():
            assert not torch.allclose(model(ids)[0], outputs[-1])
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", sorted(k for k in [*CONFIGS, *SEQ2SEQ] if k != "gemma2"))
def test_the_streams_output_mixed_from_the_pattern_is_sdpas(kind, monkeypatch):
    """The analyses' stream mixes each layer's output from the pattern it computes beside sdpa
    (p·V) instead of running sdpa too: every real position's output is sdpa's, to float32
    rounding, on every architecture (padding, grouped-query attention, T5's position bias,
    encoder-decoder models' three attentions); a trace outside the stream keeps sdpa's bits."""
    from probe.capture.modes import mixed_from_the_pattern

    model = small_model(kind, attn_implementation="sdpa")
    ids = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    if kind in SEQ2SEQ:
        inputs = decoder_inputs(model, inputs)
    sdpa, calls = ALL_ATTENTION_FUNCTIONS["sdpa"], []

    def counted(*args, **kwargs):
        calls.append(1)
        return sdpa(*args, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", counted)
    with torch.no_grad():
        plain = model(**inputs)[0]
        ran = len(calls)
        with mixed_from_the_pattern(), probe.trace(model, "hook_pattern"):
            mixed = model(**inputs)[0]
        assert ran > 0 and len(calls) == ran  # p·V ran, not sdpa
        with probe.trace(model, "hook_pattern"):
            traced = model(**inputs)[0]
    real = (inputs.get("decoder_attention_mask", mask)).bool()
    torch.testing.assert_close(mixed[real], plain[real], atol=2e-5, rtol=1e-5)
    assert torch.equal(traced, plain)
