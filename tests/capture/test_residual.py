"""The residual stream's hook points on every supported architecture: hook_embed, and per block
hook_resid_pre, hook_attn_out, hook_mlp_out and hook_resid_post; and TransformerLens-style
hook functions ``fn(activation, hook)``."""

import pytest
import torch
from models import CONFIGS, ENCODERS, padded_batch, small_model
from torch import nn

import probe
from probe.capture.architectures import architecture, blocks
from probe.capture.names import hook_name

RESIDUAL = ("hook_resid_pre", "hook_attn_out", "hook_mlp_out", "hook_resid_post")
# x + attn(ln(x)) + mlp(ln(…)): the decoders, and ModernBERT.
PRE_LAYERNORM = sorted(set(CONFIGS) - ENCODERS | {"modernbert"})
# Gemma normalises each output before adding it: attn_out = ln(Σ_i result_i + b^O).
SANDWICH = {"gemma2", "gemma3_text"}


def run(kind, names=None, fns=None):
    model = small_model(kind)
    batch = padded_batch(kind)
    with torch.no_grad(), probe.trace(model, names) as cache, probe.hooks(model, fns or {}):
        out = model(**batch).last_hidden_state
    return model, batch, cache, out


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_residual_points_chain_from_the_embeddings_to_the_output(kind):
    """Every point is [batch, pos, d_model]; hook_embed is the token embedding (TransformerLens's:
    positions apart, [batch, pos, d_embed]); each block's output is the next block's input,
    exactly: resid_post itself in pre-LayerNorm blocks, LN₂(resid_post) in post-LayerNorm ones."""
    model, batch, cache, _ = run(kind, [*RESIDUAL, "hook_embed"])
    n = len(blocks(model))
    assert set(cache) == {"hook_embed"} | {f"blocks.{i}.{s}" for i in range(n) for s in RESIDUAL}
    for name, x in cache.items():
        if name != "hook_embed":
            assert x.shape == (*batch["input_ids"].shape, model.config.hidden_size), name
    with torch.no_grad():
        assert torch.equal(cache["hook_embed"], model.get_input_embeddings()(batch["input_ids"]))
    arch = architecture(model)
    for i in range(n - 1):
        post = cache[f"blocks.{i}.hook_resid_post"]
        if arch.post_ln:
            with torch.no_grad():
                post = blocks(model)[i].get_submodule(arch.ln2)(post)
        assert torch.equal(post, cache[f"blocks.{i + 1}.hook_resid_pre"])


@pytest.mark.parametrize("kind", PRE_LAYERNORM)
def test_pre_layernorm_blocks_add_attention_and_mlp_to_the_stream(kind):
    """resid_pre + attn_out + mlp_out = resid_post (GPT-NeoX's parallel residual included)."""
    model, _, cache, _ = run(kind, RESIDUAL)
    for i in range(len(blocks(model))):
        pre, attn, mlp, post = (cache[f"blocks.{i}.{s}"] for s in RESIDUAL)
        torch.testing.assert_close(pre + attn + mlp, post, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["bert", "roberta", "electra"])
def test_post_layernorm_encoders_normalise_after_each_sum(kind):
    """BERT-style blocks, as TransformerLens's HookedEncoder has them: resid_mid = resid_pre +
    attn_out, resid_post = LN₁(resid_mid) + mlp_out, and the next block reads LN₂(resid_post);
    attn_out and mlp_out are taken before any LayerNorm."""
    model, _, cache, out = run(kind, [*RESIDUAL, "hook_resid_mid", "hook_mlp_in"])
    for i, block in enumerate(blocks(model)):
        pre, attn, mlp, post = (cache[f"blocks.{i}.{s}"] for s in RESIDUAL)
        mid = cache[f"blocks.{i}.hook_resid_mid"]
        torch.testing.assert_close(pre + attn, mid, atol=1e-5, rtol=0)
        assert torch.equal(cache[f"blocks.{i}.hook_mlp_in"], mid)
        torch.testing.assert_close(block.attention.output.LayerNorm(mid) + mlp, post)
    last = blocks(model)[-1].output.LayerNorm
    torch.testing.assert_close(last(cache[f"blocks.{len(blocks(model)) - 1}.hook_resid_post"]), out)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_attn_out_is_the_sum_of_the_head_results(kind):
    """hook_attn_out = Σ_i hook_result_i + b^O, and it sees an edit of one head's result."""
    model, _, cache, _ = run(kind, ["hook_attn_out", "hook_result"])
    norms = [
        b.post_attention_layernorm if kind in SANDWICH else nn.Identity() for b in blocks(model)
    ]
    for i, weights in enumerate(probe.head_weights(model)):
        result = cache[f"blocks.{i}.attn.hook_result"].sum(2)
        bias = weights.b_O
        torch.testing.assert_close(
            norms[i](result + bias), cache[f"blocks.{i}.hook_attn_out"], atol=1e-5, rtol=0
        )

    def drop_head_0(result, hook):
        result = result.clone()
        result[:, :, 0] = 0
        return result

    _, _, edited, _ = run(
        kind, ["hook_attn_out", "hook_result"], {"blocks.0.attn.hook_result": drop_head_0}
    )
    others = cache["blocks.0.attn.hook_result"][:, :, 1:].sum(2)
    expected = norms[0](others + probe.head_weights(model)[0].b_O)
    torch.testing.assert_close(edited["blocks.0.hook_attn_out"], expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["bert", "albert", "gpt2", "llama"])
def test_residual_points_are_editable(kind):
    """An edit flows on: zeroing the last MLP's output changes the model's output, and adding
    to resid_post of layer 0 is the same as adding to resid_pre of layer 1."""
    _, _, _, plain = run(kind)
    last = len(blocks(small_model(kind))) - 1
    _, _, _, no_mlp = run(
        kind, fns={f"blocks.{last}.hook_mlp_out": lambda x, hook: torch.zeros_like(x)}
    )
    assert not torch.allclose(no_mlp, plain, atol=1e-4)
    # Not a constant: LayerNorm would remove that.
    shift = lambda x, hook: x + torch.linspace(-1, 1, x.shape[-1])  # noqa: E731
    model, _, cache, after = run(kind, "hook_resid_post", fns={"blocks.0.hook_resid_post": shift})
    assert not torch.allclose(after, plain, atol=1e-4)
    if architecture(model).post_ln:  # the next block reads LN₂(resid_post + shift)
        _, _, edited, _ = run(kind, "hook_resid_pre", fns={"blocks.0.hook_resid_post": shift})
        ln2 = blocks(model)[0].get_submodule(architecture(model).ln2)
        expected = ln2(shift(cache["blocks.0.hook_resid_post"], None))
        torch.testing.assert_close(edited["blocks.1.hook_resid_pre"], expected)
        return
    _, _, _, before = run(kind, fns={"blocks.1.hook_resid_pre": shift})
    torch.testing.assert_close(after, before)


def test_hook_functions_receive_a_transformerlens_hook():
    """fn(activation, hook) with hook.name and hook.layer(), the hook also being the name;
    ALBERT's one shared block reports each layer it runs as."""
    seen = []

    def record(activation, hook):
        seen.append((hook.name, hook.layer(), hook == hook.name, type(activation)))

    run("albert", fns={"hook_resid_post": record, "hook_z": record})
    layers = len(blocks(small_model("albert")))
    assert [(n, layer) for n, layer, *_ in seen] == [
        pair for i in range(layers)
        for pair in ((f"blocks.{i}.attn.hook_z", i), (f"blocks.{i}.hook_resid_post", i))
    ]  # fmt: skip
    assert all(same and kind is torch.Tensor for *_, same, kind in seen)
    with pytest.raises(ValueError, match="no layer"):
        probe.Hook("hook_embed").layer()
    assert probe.Hook("hook_z").layer() == 0  # a bare MultiHeadAttention's point
    with pytest.raises(ValueError, match="not a probe hook name"):
        probe.Hook("layers.2.self_attn.hook_z").layer()


def test_one_stack_stacks_without_naming_it():
    """On a model with one stack, Cache.stack needs no attention: the layers in order."""
    *_, cache, _ = run("llama", ["hook_resid_pre", "hook_rot_q"])
    for point in ("hook_resid_pre", "hook_rot_q"):
        stacked = cache.stack(point)
        assert torch.equal(stacked, torch.stack([cache[hook_name(point, i)] for i in range(2)]))
        assert torch.equal(cache.stack(point, attention="blocks.attn"), stacked)


def test_a_trace_never_overwrites_a_capture():
    """Two forward passes in one trace: the second reaching a captured point raises."""
    model = small_model("gpt2")
    batch = padded_batch("gpt2")
    with torch.no_grad(), probe.trace(model, "hook_pattern"):
        model(**batch)
        with pytest.raises(RuntimeError, match="reached twice in one trace"):
            model(**batch)
