"""Hook functions in every form TransformerLens accepts: ``fn(act, hook)``, a keyword-only
``hook``, a partial, ``hook.ctx``, and ``probe.hooks`` given TransformerLens's list of
``(name or predicate, fn)`` pairs; backward hooks on gradients. New points (norms, MLP, resid_mid,
embeddings) are editable, and an edit flows on as the model computes."""

from functools import partial

import pytest
import torch
from models import padded_batch, small_model

import probe
from probe.capture.architectures import architecture, blocks


def test_every_form_of_hook_function_is_called():
    model = small_model("gpt2")
    batch = padded_batch("gpt2")
    seen = []

    def positional(act, hook):
        seen.append(("positional", hook.name))

    def keyword_only(act, *, hook):
        seen.append(("keyword", hook.name))

    def with_extra(act, hook, head):
        seen.append(("partial", head))

    def counting(act, hook):  # hook.ctx: shared by the point's calls for the whole block
        hook.ctx["calls"] = hook.ctx.get("calls", 0) + 1
        seen.append(("ctx", hook.ctx["calls"]))

    pairs = [
        ("blocks.0.attn.hook_z", positional),
        ("blocks.0.attn.hook_z", keyword_only),
        (lambda name: name == "blocks.1.attn.hook_pattern", partial(with_extra, head=3)),
        ("blocks.0.hook_resid_mid", counting),
    ]
    with torch.no_grad(), probe.hooks(model, pairs):
        model(**batch)
        model(**batch)
    z = [("positional", "blocks.0.attn.hook_z"), ("keyword", "blocks.0.attn.hook_z")]
    assert seen == [*z, ("ctx", 1), ("partial", 3), *z, ("ctx", 2), ("partial", 3)]


def test_a_backward_hook_edits_the_gradient():
    """Zeroing the gradient at resid_post of the last layer leaves none for the embeddings;
    doubling it at resid_pre of layer 0 doubles theirs."""
    model = small_model("llama")
    ids = torch.randint(3, 99, (2, 6), generator=torch.Generator().manual_seed(0))

    def embedding_grad(backward=()):
        model.zero_grad()
        with probe.hooks(model, backward=backward):
            model(ids).last_hidden_state.pow(2).sum().backward()
        return model.get_input_embeddings().weight.grad.clone()

    plain = embedding_grad()
    assert plain.abs().sum() > 0
    last = len(blocks(model)) - 1
    none = embedding_grad([(f"blocks.{last}.hook_resid_post", lambda g, hook: g * 0)])
    assert torch.equal(none, torch.zeros_like(none))
    double = embedding_grad([("blocks.0.hook_resid_pre", lambda g, hook: 2 * g)])
    torch.testing.assert_close(double, 2 * plain)


def test_new_points_are_editable_and_edits_flow_on():
    """An edit of ln1's scale, mlp.hook_post, resid_mid or hook_pos_embed changes the output as
    the same edit made by hand does."""
    model = small_model("gpt2")
    batch = padded_batch("gpt2")
    block = blocks(model)[0]
    with torch.no_grad():
        plain = model(**batch).last_hidden_state
        with probe.trace(model, ["blocks.0.ln1.hook_scale", "blocks.0.hook_resid_pre"]) as c:
            model(**batch)
        doubled = lambda x, hook: 2 * x  # noqa: E731
        with probe.hooks(model, {"blocks.0.ln1.hook_scale": doubled}):
            halved_ln = model(**batch).last_hidden_state
        # By hand: ln1's output with twice the scale is (x - mean) / (2 s) · w + b.
        x = c["blocks.0.hook_resid_pre"]
        expected = (x - x.mean(-1, keepdim=True)) / (2 * c["blocks.0.ln1.hook_scale"])
        expected = expected * block.ln_1.weight + block.ln_1.bias
        seen = {}

        def read(t, hook):
            seen["ln1_out"] = t

        with probe.hooks(model, {"blocks.0.ln1.hook_scale": doubled}):
            # After the mirror's own hook on ln_1, so that it sees the recomputed output.
            handle = block.ln_1.register_forward_hook(lambda m, i, o: read(o, None))
            model(**batch)
        handle.remove()
        torch.testing.assert_close(seen["ln1_out"], expected, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(halved_ln, plain)
        for point in ("blocks.0.mlp.hook_post", "blocks.0.hook_resid_mid", "hook_pos_embed"):
            with probe.hooks(model, {point: lambda x, hook: x * 0}):
                assert not torch.allclose(model(**batch).last_hidden_state, plain), point


def test_resid_mid_edit_reaches_the_stream():
    """In a pre-LayerNorm block, replacing resid_mid replaces the stream the MLP adds to:
    resid_post = edited resid_mid + mlp_out."""
    model = small_model("llama")
    batch = padded_batch("llama")
    assert not architecture(model).post_ln
    names = ["blocks.0.hook_mlp_out", "blocks.0.hook_resid_post", "blocks.0.hook_resid_mid"]
    replacement = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(0))
    with (
        torch.no_grad(),
        probe.hooks(model, {"blocks.0.hook_resid_mid": lambda x, hook: replacement}),
        probe.trace(model, names) as cache,
    ):
        model(**batch)
    assert torch.equal(cache["blocks.0.hook_resid_mid"], replacement)
    torch.testing.assert_close(
        replacement + cache["blocks.0.hook_mlp_out"], cache["blocks.0.hook_resid_post"]
    )


def test_fused_mlp_halves_on_modernbert():
    """ModernBERT's one input projection gives hook_pre (the activation's input) and
    hook_pre_linear (the gate): hook_post = act(hook_pre) · hook_pre_linear; an edit of either
    half flows on. (TransformerLens's bridge does not load ModernBERT; Phi-3's are compared
    with it in test_tl_parity.)"""
    model = small_model("modernbert")
    batch = padded_batch("modernbert")
    names = [f"blocks.0.mlp.{p}" for p in ("hook_pre", "hook_pre_linear", "hook_post")]
    with torch.no_grad(), probe.trace(model, names) as cache:
        plain = model(**batch).last_hidden_state
    pre, linear, post = (cache[n] for n in names)
    assert pre.shape == linear.shape == post.shape == (3, 7, model.config.intermediate_size)
    act = blocks(model)[0].mlp.act
    torch.testing.assert_close(act(pre) * linear, post)
    with torch.no_grad(), probe.hooks(model, {names[1]: lambda x, hook: 2 * x}):
        edited = model(**batch).last_hidden_state
    assert not torch.allclose(edited, plain)


def test_per_head_inputs_on_a_post_layernorm_encoder():
    """On BERT (no norm before the attention) hook_attn_in is resid_pre repeated per head, and
    an edit of one head's hook_q_input changes that head's query only: x' W_Q[h] + b_Q[h]."""
    model = small_model("bert")
    batch = padded_batch("bert")
    w = probe.head_weights(model)[1]
    other = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(0))

    def replace_head_2(x, hook):
        x = x.clone()
        x[:, :, 2] = other
        return x

    names = ["blocks.1.hook_attn_in", "blocks.1.hook_resid_pre", "blocks.1.attn.hook_q"]
    with torch.no_grad(), probe.trace(model, names) as plain:
        model(**batch)
    edit = {"blocks.1.hook_q_input": replace_head_2}
    with torch.no_grad(), probe.hooks(model, edit), probe.trace(model, names[2]) as edited:
        model(**batch)
    pre = plain["blocks.1.hook_resid_pre"]
    assert torch.equal(plain["blocks.1.hook_attn_in"], pre.unsqueeze(2).expand(-1, -1, 4, -1))
    q, q_edited = plain["blocks.1.attn.hook_q"], edited["blocks.1.attn.hook_q"]
    torch.testing.assert_close(q_edited[:, :, 2], other @ w.W_Q[2] + w.b_Q[2])
    torch.testing.assert_close(q_edited[:, :, [0, 1, 3]], q[:, :, [0, 1, 3]])


@pytest.mark.parametrize("kind", ["gpt2", "gpt_neox", "phi3", "modernbert", "llama"])
def test_per_head_inputs_on_fused_projections(kind):
    """On one fused Q/K/V projection (GPT-2, GPT-NeoX, Phi-3, ModernBERT; Llama's separate ones
    beside them), an edit of one head's hook_k_input changes that head's key only, to
    LN₁(x') W_K[h] + b_K[h] computed by hand: the queries, values and other keys keep every bit,
    and the output is the output of the hand-computed key put in hook_k."""
    model = small_model(kind)
    with torch.no_grad():  # sharper patterns, so that an edited key moves the output
        for name, p in model.named_parameters():
            p.mul_(10 if p.dim() == 2 and "emb" not in name else 1)
    batch = padded_batch(kind)
    arch, block, w = architecture(model), blocks(model)[1], probe.head_weights(model)[1]
    shift = torch.linspace(-1, 1, model.config.hidden_size)

    def shift_head_1(x, hook):
        x = x.clone()
        x[:, :, 1] += shift
        return x

    qkv = [f"blocks.1.attn.hook_{p}" for p in "qkv"]
    with torch.no_grad(), probe.trace(model, [*qkv, "blocks.1.hook_resid_pre"]) as plain:
        before = model(**batch).last_hidden_state
    edit = {"blocks.1.hook_k_input": shift_head_1}
    with torch.no_grad(), probe.hooks(model, edit), probe.trace(model, qkv) as edited:
        out = model(**batch).last_hidden_state
    ln1 = block.get_submodule(arch.ln1)
    expected = ln1(plain["blocks.1.hook_resid_pre"] + shift) @ w.W_K[1] + w.b_K[1]
    k, k_edited = plain["blocks.1.attn.hook_k"], edited["blocks.1.attn.hook_k"]
    torch.testing.assert_close(k_edited[:, :, 1], expected, atol=1e-5, rtol=1e-5)
    others = [h for h in range(k.shape[2]) if h != 1]
    assert torch.equal(k_edited[:, :, others], k[:, :, others])
    for p in "qv":
        assert torch.equal(edited[f"blocks.1.attn.hook_{p}"], plain[f"blocks.1.attn.hook_{p}"])

    def hand_key(x, hook):
        x = x.clone()
        x[:, :, 1] = expected
        return x

    with torch.no_grad(), probe.hooks(model, {"blocks.1.attn.hook_k": hand_key}):
        by_hand = model(**batch).last_hidden_state
    change = (out - before).abs().max()
    print(f"{kind}: the edit moves the output by {change:.1e}")
    assert change > 1e-3  # far above the tolerance below
    torch.testing.assert_close(out, by_hand, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["qwen3", "gemma3_text"])
def test_query_key_norm_points(kind):
    """Qwen3's and Gemma 3's query and key norms, [batch, pos, head, …] (Gemma 3's norms see
    heads before positions): hook_scale is √(mean q² + ε) of hook_q, hook_normalized q / scale,
    hook_q_normed that times the norm's weight (Gemma's 1 + weight); doubling the scale halves
    hook_q_normed, and an edit of hook_k_normed flows on to the rotated keys."""
    model = small_model(kind)
    batch = padded_batch(kind)
    attn = blocks(model)[1].self_attn
    with torch.no_grad():  # weights other than their initial ones (1, or 0 for Gemma's 1 + w)
        attn.q_norm.weight.normal_(generator=torch.Generator().manual_seed(0))
    names = [f"blocks.1.attn.{p}" for p in ("hook_q", "hook_k", "hook_rot_k")]
    names += [f"blocks.1.attn.{n}" for n in ("q_norm.hook_scale", "q_norm.hook_normalized")]
    names += ["blocks.1.attn.hook_q_normed", "blocks.1.attn.hook_k_normed"]
    with torch.no_grad(), probe.trace(model, names) as cache:
        model(**batch)
    q = cache["blocks.1.attn.hook_q"]
    scale = (q.pow(2).mean(-1, keepdim=True) + model.config.rms_norm_eps).sqrt()
    weight = attn.q_norm.weight + (1 if kind == "gemma3_text" else 0)
    torch.testing.assert_close(cache["blocks.1.attn.q_norm.hook_scale"], scale)
    torch.testing.assert_close(cache["blocks.1.attn.q_norm.hook_normalized"], q / scale)
    torch.testing.assert_close(cache["blocks.1.attn.hook_q_normed"], q / scale * weight)
    doubled = {"blocks.1.attn.q_norm.hook_scale": lambda x, hook: 2 * x}
    with torch.no_grad(), probe.hooks(model, doubled), probe.trace(model, names[-2]) as edited:
        model(**batch)
    torch.testing.assert_close(edited[names[-2]], cache[names[-2]] / 2)
    zero = {"blocks.1.attn.hook_k_normed": lambda x, hook: torch.zeros_like(x)}
    with torch.no_grad(), probe.hooks(model, zero), probe.trace(model, names[2]) as edited:
        model(**batch)
    assert torch.equal(edited[names[2]], torch.zeros_like(edited[names[2]]))  # rotating 0 gives 0


@pytest.mark.parametrize(
    "kind", ["bert", "roberta", "electra", "distilbert", "albert", "modernbert"]
)
def test_embedding_norm_is_editable(kind):
    """The embeddings' LayerNorm of BERT-like encoders and ModernBERT: hook_normalized · weight
    + bias is the norm's output, and an edit of its scale does what the same edit by hand does."""
    model = small_model(kind)
    batch = padded_batch(kind)
    ln = model.embeddings.norm if kind == "modernbert" else model.embeddings.LayerNorm
    outputs = []

    def run():  # the norm's output after the mirror's own hook on it, which edits it
        handle = ln.register_forward_hook(lambda m, args, out: outputs.append(out))
        model(**batch)
        handle.remove()

    names = ["embed_ln.hook_scale", "embed_ln.hook_normalized"]
    with torch.no_grad(), probe.trace(model, names) as cache:
        run()
    with torch.no_grad(), probe.hooks(model, {names[0]: lambda x, hook: 2 * x}):
        run()
    normalized = cache["embed_ln.hook_normalized"]
    bias = 0 if ln.bias is None else ln.bias
    torch.testing.assert_close(normalized * ln.weight + bias, outputs[0])
    torch.testing.assert_close(outputs[1], normalized / 2 * ln.weight + bias)
