"""Encoder-decoder models (BART, mBART, Marian, T5, Flan-T5): every attention mirrored, the
decoder's cross-attention included, checked against the eager implementation on padded batches."""

import math

import pytest
import torch
from models import SEQ2SEQ, seq2seq_batch, small_model
from references import assert_spectrum, dense

import probe
from probe.capture.architectures import architecture, blocks
from probe.capture.hookpoints import Hook

KINDS = sorted(SEQ2SEQ)
ATTENTIONS = ("encoder.attn", "decoder.attn", "decoder.cross_attn")
PRE_LAYERNORM = {"mbart", "t5", "flan-t5"}


def real_rows(attention: str, batch) -> torch.Tensor:
    """Bool [batch, q_pos]: the real queries of one attention."""
    stack = attention.split(".")[0]
    return batch["attention_mask" if stack == "encoder" else "decoder_attention_mask"].bool()


def attention_io(model, batch, attention):
    """Per layer, the attention module's query-side input and its output projection's output,
    from plain forward hooks, and the model's outputs."""
    arch = architecture(model, attention)
    inputs, outputs, handles = [], [], []
    for block in blocks(model, attention):
        attn, o = block.get_submodule(arch.attention), block.get_submodule(arch.o)
        handles.append(
            attn.register_forward_pre_hook(
                lambda m, a, k: inputs.append(a[0] if a else k["hidden_states"]),
                with_kwargs=True,
            )
        )
        handles.append(o.register_forward_hook(lambda m, a, out: outputs.append(out)))
    try:
        with torch.no_grad():
            out = model(**batch)
    finally:
        for h in handles:
            h.remove()
    return inputs, outputs, out


@pytest.mark.parametrize("kind", KINDS)
def test_outputs_unchanged_and_restored(kind):
    model, batch = small_model(kind), seq2seq_batch()
    source, target = batch["attention_mask"].bool(), batch["decoder_attention_mask"].bool()
    before = model.config._attn_implementation
    with torch.no_grad():
        expected = model(**batch)
        with probe.trace(model) as cache:
            got = model(**batch)
        after = model(**batch)
    torch.testing.assert_close(
        got.last_hidden_state[target], expected.last_hidden_state[target], atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(
        got.encoder_last_hidden_state[source],
        expected.encoder_last_hidden_state[source],
        atol=1e-5,
        rtol=1e-5,
    )
    assert model.config._attn_implementation == before
    assert torch.equal(after.last_hidden_state, expected.last_hidden_state)
    for attention in ATTENTIONS:  # TransformerLens's names, every layer of every attention
        stack, attn = attention.split(".")
        assert f"{stack}.1.{attn}.hook_pattern" in cache
    assert not any(name.startswith("blocks.") for name in cache)


@pytest.mark.parametrize("kind", KINDS)
def test_patterns_equal_eager_attentions(kind):
    model, batch = small_model(kind, attn_implementation="eager"), seq2seq_batch()
    with torch.no_grad():
        eager = model(**batch, output_attentions=True)
        with probe.trace(model, "hook_pattern") as cache:
            model(**batch)
    for attention, expected in zip(
        ATTENTIONS,
        (eager.encoder_attentions, eager.decoder_attentions, eager.cross_attentions),
        strict=True,
    ):
        stack, attn = attention.split(".")
        real = real_rows(attention, batch)
        for layer, pattern in enumerate(expected):
            got = cache[f"{stack}.{layer}.{attn}.hook_pattern"]
            assert got.shape == pattern.shape
            torch.testing.assert_close(
                got.transpose(1, 2)[real], pattern.transpose(1, 2)[real], atol=1e-5, rtol=0
            )
    # Cross-attention: [batch, head, target_pos, source_pos]
    assert cache["decoder.0.cross_attn.hook_pattern"].shape == (3, 4, 6, 7)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_shapes_projections_and_results(kind, attention):
    """Per-hook shapes; hook_q and hook_v from the head weights; Σ_i result_i + b^O is the
    attention's output. Cross-attention reads its values from the encoder's output."""
    model, batch = small_model(kind), seq2seq_batch()
    stack, attn = attention.split(".")
    weights = probe.head_weights(model, attention)
    with probe.trace(model) as cache:
        inputs, outputs, out = attention_io(model, batch, attention)
    real = real_rows(attention, batch)
    T_q = real.shape[1]
    T_k = 7 if attention != "decoder.attn" else 6
    for layer, w in enumerate(weights):
        name = f"{stack}.{layer}.{attn}."
        assert cache[name + "hook_q"].shape == (3, T_q, 4, 8)
        assert cache[name + "hook_k"].shape == cache[name + "hook_v"].shape == (3, T_k, 4, 8)
        assert cache[name + "hook_attn_scores"].shape == (3, 4, T_q, T_k)
        assert cache[name + "hook_z"].shape == (3, T_q, 4, 8)
        result = cache[name + "hook_result"]
        assert result.shape == (3, T_q, 4, 32)
        torch.testing.assert_close(
            (result.sum(2) + w.b_O)[real], outputs[layer][real], atol=1e-5, rtol=0
        )
        keys = out.encoder_last_hidden_state if attn == "cross_attn" else inputs[layer]
        for head in range(4):
            q = inputs[layer] @ w.W_Q[head] + w.b_Q[head]
            torch.testing.assert_close(cache[name + "hook_q"][:, :, head], q, atol=1e-5, rtol=0)
            v = keys @ w.W_V[head] + w.b_V[head]
            torch.testing.assert_close(cache[name + "hook_v"][:, :, head], v, atol=1e-5, rtol=0)


def entering_encoder(model, cache) -> torch.Tensor:
    """What enters the encoder's first block, from hook_embed, hook_pos_embed and the
    embeddings' norm, as the model sums them (T5's positions are a bias on the scores)."""
    encoder = model.get_encoder()
    x = cache["hook_embed"] * getattr(encoder, "embed_scale", 1.0)  # Marian scales outside
    x = x if model.config.model_type == "t5" else x + cache["hook_pos_embed"]
    return encoder.layernorm_embedding(x) if "embed_ln.hook_scale" in cache else x


def normed(cache, norm: str, module) -> torch.Tensor:
    """A norm's output from its hook_normalized: times its weight, plus its bias."""
    out = cache[f"{norm}.hook_normalized"] * module.weight
    return out if getattr(module, "bias", None) is None else out + module.bias


@pytest.mark.parametrize("kind", KINDS)
def test_embeddings_and_final_norms(kind):
    """hook_embed is the encoder's token embedding (TransformerLens's meaning), hook_pos_embed
    its positions where they are learned or sinusoidal (BART, mBART, Marian; on T5, as the
    bridge's, the encoder's relative position bias [q_pos, k_pos, head]);
    embed_ln and decoder_embed_ln (BART, mBART) give each stack's first hook_resid_pre, and
    encoder_ln_final and decoder_ln_final (mBART, T5) each stack's output."""
    model, batch = small_model(kind), seq2seq_batch()
    with torch.no_grad(), probe.trace(model) as cache:
        out = model(**batch)
    encoder, decoder = model.get_encoder(), model.get_decoder()
    assert torch.equal(cache["hook_embed"], encoder.embed_tokens(batch["input_ids"]))
    has = {n for n in cache if not n.startswith(("encoder.", "decoder."))}
    norms = {"bart": {"embed_ln", "decoder_embed_ln"}, "marian": set()}
    norms["mbart"] = norms["bart"] | {"encoder_ln_final", "decoder_ln_final"}
    expected = norms.get(kind, {"encoder_ln_final", "decoder_ln_final"})
    assert has == {"hook_embed", "hook_pos_embed"} | {
        f"{n}.{p}" for n in expected for p in ("hook_scale", "hook_normalized")
    }
    with torch.no_grad():
        if "embed_ln" in expected:
            embed_ln = normed(cache, "embed_ln", encoder.layernorm_embedding)
            torch.testing.assert_close(embed_ln, cache["encoder.0.hook_resid_pre"])
            first = normed(cache, "decoder_embed_ln", decoder.layernorm_embedding)
            torch.testing.assert_close(first, cache["decoder.0.hook_resid_pre"])
        if "encoder_ln_final" in expected:
            final = encoder.final_layer_norm if kind in {"t5", "flan-t5"} else encoder.layer_norm
            torch.testing.assert_close(
                normed(cache, "encoder_ln_final", final), out.encoder_last_hidden_state
            )
            final = decoder.final_layer_norm if kind in {"t5", "flan-t5"} else decoder.layer_norm
            torch.testing.assert_close(
                normed(cache, "decoder_ln_final", final), out.last_hidden_state
            )


@pytest.mark.parametrize("kind", ["t5", "flan-t5"])
def test_t5_positions_are_the_relative_bias_the_scores_add(kind):
    """T5's hook_pos_embed is the encoder's bias per (query, key) distance and head: each layer's
    scores are q·k plus it on the real keys (T5 does not scale), and an edit moves them."""
    model, batch = small_model(kind), seq2seq_batch()
    names = ["hook_pos_embed", "encoder.0.attn.hook_q", "encoder.0.attn.hook_k",
             "encoder.0.attn.hook_attn_scores"]  # fmt: skip
    with torch.no_grad(), probe.trace(model, names) as cache:
        model(**batch)
    bias = cache["hook_pos_embed"]
    T = batch["input_ids"].shape[1]
    assert bias.shape == (T, T, model.config.num_heads)
    q, k = cache["encoder.0.attn.hook_q"], cache["encoder.0.attn.hook_k"]
    plain = torch.einsum("bqhd,bkhd->bhqk", q, k)
    real = batch["attention_mask"].bool()[:, None, None, :].expand_as(plain)
    scores = cache["encoder.0.attn.hook_attn_scores"]
    added = (scores - plain)[real]
    torch.testing.assert_close(added, bias.permute(2, 0, 1).expand_as(plain)[real])
    zero = {"hook_pos_embed": lambda bias, hook: torch.zeros_like(bias)}
    with torch.no_grad(), probe.hooks(model, zero), probe.trace(model, names) as edited:
        model(**batch)
    torch.testing.assert_close(edited["encoder.0.attn.hook_attn_scores"][real], plain[real])


@pytest.mark.parametrize("kind", KINDS)
def test_residual_stream(kind):
    """Blocks chain within each stack; hook_cross_attn_out is Σ cross results + b^O; on
    pre-LayerNorm models each block adds its attention(s) and MLP to the stream."""
    model, batch = small_model(kind), seq2seq_batch()
    with torch.no_grad(), probe.trace(model) as cache:
        model(**batch)
    assert torch.equal(entering_encoder(model, cache), cache["encoder.0.hook_resid_pre"])
    cross = probe.head_weights(model, "decoder.cross_attn")
    for stack in ("encoder", "decoder"):
        post, arch = cache[f"{stack}.0.hook_resid_post"], architecture(model, f"{stack}.attn")
        if arch.post_ln:  # BART, Marian: the next block reads LN₂(resid_post)
            post = blocks(model, f"{stack}.attn")[0].get_submodule(arch.ln2)(post)
        assert torch.equal(post, cache[f"{stack}.1.hook_resid_pre"])
        for layer in range(2):
            name = f"{stack}.{layer}."
            parts = [cache[name + "hook_resid_pre"], cache[name + "hook_attn_out"]]
            if stack == "decoder":
                result = cache[f"decoder.{layer}.cross_attn.hook_result"].sum(2)
                cross_out = cache[name + "hook_cross_attn_out"]
                torch.testing.assert_close(result + cross[layer].b_O, cross_out, atol=1e-5, rtol=0)
                parts.append(cross_out)
            if kind in PRE_LAYERNORM:
                total = sum(parts) + cache[name + "hook_mlp_out"]
                post = cache[name + "hook_resid_post"]
                torch.testing.assert_close(total, post, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_ablating_a_cross_attention_head_equals_a_plain_hook(kind):
    """probe.ablate on the cross-attention zeroes exactly that head's slice of the output
    projection's input, as a plain PyTorch pre-hook does; the edit changes the output."""
    model, batch = small_model(kind), seq2seq_batch()
    arch = architecture(model, "decoder.cross_attn")
    o = blocks(model, "decoder.cross_attn")[1].get_submodule(arch.o)

    def zero_head_2(_module, args):
        x = args[0].clone()
        x[..., 16:24] = 0
        return (x, *args[1:])

    target = batch["decoder_attention_mask"].bool()
    with torch.no_grad():
        plain = model(**batch).last_hidden_state
        with probe.ablate(model, [(1, 2)], attention="decoder.cross_attn"):
            ours = model(**batch).last_hidden_state
        handle = o.register_forward_pre_hook(zero_head_2)
        try:
            theirs = model(**batch).last_hidden_state
        finally:
            handle.remove()
    torch.testing.assert_close(ours[target], theirs[target], atol=1e-5, rtol=0)
    assert not torch.allclose(ours[target], plain[target], atol=1e-4)
    means = probe.head_means(model, [batch], attention="decoder.cross_attn")
    assert means[1].shape == (4, 8)
    with (
        torch.no_grad(),
        probe.ablate(model, [(1, 2)], mode="mean", means=means, attention="decoder.cross_attn"),
    ):
        assert not torch.allclose(model(**batch).last_hidden_state[target], ours[target])


@pytest.mark.parametrize("kind", KINDS)
def test_spectra_of_every_attention_equal_dense_svd(kind):
    model = small_model(kind)
    table = probe.spectra(model)
    assert list(table.columns[:2]) == ["attention", "keys_from"]
    assert set(table.attention) == set(ATTENTIONS)
    keys_from = table.drop_duplicates("attention").set_index("attention").keys_from
    assert keys_from.to_dict() == {
        "encoder.attn": "encoder",
        "decoder.attn": "decoder",
        "decoder.cross_attn": "encoder",
    }
    for attention in ATTENTIONS:
        weights = probe.head_weights(model, attention)
        for row in table[table.attention == attention].itertuples():
            w = weights[row.layer]
            A, B = (
                (w.W_Q[row.head], w.W_K[row.head])
                if row.circuit == "QK"
                else (w.W_V[row.head], w.W_O[row.head].T)
            )
            s, _ = dense(A, B)
            assert_spectrum(torch.from_numpy(row.singular_values), s)


def test_names_and_unknown_attentions():
    model = small_model("t5")
    assert Hook("decoder.1.cross_attn.hook_z").layer() == 1
    with pytest.raises(probe.ProbeError, match=r"has no attention 'decoder\.cross'.*cross_attn"):
        probe.head_weights(model, "decoder.cross")
    bert = small_model("bert")
    with (
        pytest.raises(probe.ProbeError, match="for encoder-decoder models"),
        probe.ablate(bert, [(0, 0)], attention="decoder.attn"),
    ):
        pass


@pytest.mark.parametrize("kind", ["bart", "t5"])
def test_cache_stack_takes_one_attention_at_a_time(kind):
    """Stacking a point over layers never mixes the encoder's, the decoder's and the
    cross-attention's layers: without an attention it is refused, naming them; with one it is
    that attention's layers in order (the residual stream's points: one stack's)."""
    model, batch = small_model(kind), seq2seq_batch()
    with torch.no_grad(), probe.trace(model, ["hook_pattern", "hook_resid_pre"]) as cache:
        model(**batch)
    with pytest.raises(
        probe.ProbeError,
        match=r"encoder\.attn, decoder\.attn, decoder\.cross_attn.*attention='decoder\.cross_attn'",
    ):
        cache.stack("hook_pattern")
    for attention in ATTENTIONS:
        stack, attn = attention.split(".")
        expected = torch.stack([cache[f"{stack}.{i}.{attn}.hook_pattern"] for i in range(2)], 1)
        assert torch.equal(cache.stack("hook_pattern", dim=1, attention=attention), expected)
    with pytest.raises(probe.ProbeError, match="encoder, decoder"):
        cache.stack("hook_resid_pre")
    residual = cache.stack("hook_resid_pre", attention="decoder")
    assert torch.equal(residual[1], cache["decoder.1.hook_resid_pre"])
    with pytest.raises(KeyError, match=r"no captured hook_pattern of 'blocks\.attn'"):
        cache.stack("hook_pattern", attention="blocks.attn")


def shifted_identity(n_layers: int, T: int, shift: int) -> torch.Tensor:
    """Cross patterns ``[1, layer, head, T, T]`` where target position t attends wholly to
    source position t + shift (clamped to the sentence)."""
    source = (torch.arange(T) + shift).clamp(0, T - 1)
    one = torch.nn.functional.one_hot(source, T).float()
    return one.expand(1, n_layers, 4, T, T).clone()


def test_cross_statistics_by_hand():
    """Head 0 reads the diagonal (t), head 1 the token just read (t - 1), head 2 is uniform:
    the statistics are worked out by hand."""
    from by_hand import hand_batch
    from streams import context, feed

    from analyses.cross import CrossAttention

    model = small_model("bart")
    batch = hand_batch()  # 6 real source tokens; decoder positions 0…5 are all real
    patterns = shifted_identity(2, 6, 0)
    patterns[0, :, 1] = shifted_identity(2, 6, -1)[0, :, 1]
    patterns[0, :, 2] = 1 / 6
    analysis = CrossAttention(context(2, 4, model=model))
    feed(analysis, batch, patterns)
    table = analysis.finish()["cross_attention"].set_index(["layer", "head"])
    diagonal, previous, uniform = (table.loc[(1, h)] for h in range(3))
    assert diagonal.at_predicted == 1 and diagonal.max_at_predicted == 1
    assert diagonal.entropy == 0 and diagonal.diagonal == 1
    # t - 1 for t ≥ 1; position 0 has nothing before it and attends to source 0 (= t).
    assert previous.at_read == pytest.approx(5 / 6) and previous.at_predicted == pytest.approx(
        1 / 6
    )
    assert previous.max_at_read == pytest.approx(5 / 6)
    assert uniform.entropy == pytest.approx(math.log(6), rel=1e-6)  # float32 patterns
    assert uniform.entropy_normalised == pytest.approx(1, rel=1e-6)
    # within ±1 of t: 2 keys at the sentence's ends, 3 inside
    assert uniform.diagonal == pytest.approx((2 * 2 + 4 * 3) / 36)
    assert table.queries.iloc[0] == 6
    assert set(table.columns) >= {"qk_effective_rank", "ov_effective_rank"}


@pytest.mark.parametrize("kind", ["bart", "t5"])
@pytest.mark.slow
def test_analyze_an_encoder_decoder_model(tmp_path, kind):
    """probe analyze on a small random model: syntax and roles on the encoder, and the
    cross-attention section; importance, which does not handle these models, is refused."""
    import json

    import pandas as pd
    import transformers as tf
    from tokenizers_util import wordpiece
    from typer.testing import CliRunner

    from probe.app.cli import app

    folder = tmp_path / kind
    config = SEQ2SEQ[kind]()
    config.vocab_size = 128  # the test tokenizer's
    torch.manual_seed(0)
    tf.AutoModel.from_config(config).save_pretrained(folder)
    wordpiece().save_pretrained(folder)
    out = tmp_path / "report"
    args = ["analyze", "-m", str(folder), "-n", "20", "-q", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    run = json.loads((out / "run.json").read_text())
    assert run["analyses"] == ["syntax", "roles", "spectra", "probe", "coref", "cross"]
    assert run["layers"] == 2 and run["heads"] == 4
    cross = pd.read_csv(out / "cross_attention.csv")
    assert len(cross) == 2 * 4 and (cross.queries > 0).all()
    assert (
        cross[["at_read", "at_predicted", "at_next", "entropy_normalised"]]
        .stack()
        .between(0, 1)
        .all()
    )
    assert len(pd.read_csv(out / "syntax.csv")) > 0
    assert "Cross-attention" in (out / "index.html").read_text()
    refused = CliRunner().invoke(
        app, [*args[:-2], "-a", "importance", "--out", str(tmp_path / "x")]
    )
    assert refused.exit_code == 1
    assert "importance does not handle encoder-decoder models" in refused.output


def test_a_decoder_with_other_heads_than_its_encoder():
    """BART's decoder may have other heads than its encoder: each attention is split by its
    own heads, and its results still sum to its output."""
    import transformers as tf

    config = SEQ2SEQ["bart"]()
    config.decoder_attention_heads = 2
    torch.manual_seed(0)
    model = tf.AutoModel.from_config(config).eval()
    batch = seq2seq_batch()
    for attention, heads in (("encoder.attn", 4), ("decoder.attn", 2), ("decoder.cross_attn", 2)):
        weights = probe.head_weights(model, attention)
        assert weights[0].W_Q.shape == (heads, 32, 32 // heads)
        with probe.trace(model, "hook_result") as cache:
            _, outputs, _ = attention_io(model, batch, attention)
        stack, attn = attention.split(".")
        real = real_rows(attention, batch)
        result = cache[f"{stack}.0.{attn}.hook_result"]
        assert result.shape[2] == heads
        torch.testing.assert_close(
            (result.sum(2) + weights[0].b_O)[real], outputs[0][real], atol=1e-5, rtol=0
        )
    assert probe.spectra(model).groupby("attention")["head"].nunique().to_dict() == {
        "decoder.attn": 2,
        "decoder.cross_attn": 2,
        "encoder.attn": 4,
    }


def test_the_viewer_labels_decoder_positions_with_the_decoder_tokens():
    from tokenizers_util import wordpiece

    config = SEQ2SEQ["bart"]()
    config.vocab_size = 128
    import transformers as tf

    model = tf.AutoModel.from_config(config).eval()
    tokenizer = wordpiece()
    view = probe.show(model, tokenizer, "the cat sat", attention="decoder.attn")
    ids = tokenizer("the cat sat", return_tensors="pt")["input_ids"]
    shifted = [config.decoder_start_token_id, *ids[0, :-1].tolist()]
    assert view.tokens[0] == tokenizer.convert_ids_to_tokens(shifted)
    with pytest.raises(ValueError, match="cross-attention"):
        probe.show(model, tokenizer, "the cat sat", attention="decoder.cross_attn")


@pytest.mark.parametrize("kind", KINDS)
def test_decoder_norms_as_transformer_lens_names_them(kind):
    """A decoder block's norms are TransformerLens's ln1 (before the self-attention), ln2 (the
    cross-attention's) and ln3 (the MLP's): each hook_normalized · weight (+ bias) is its
    module's output; hook_mlp_in is the input of the norm the MLP's input passes (post-LN: the
    cross-attention's, pre-LN: the MLP's)."""
    model, batch = small_model(kind), seq2seq_batch()
    arch = architecture(model, "decoder.attn")
    block = blocks(model, "decoder.attn")[1]
    modules = {"ln1": arch.ln1, "ln2": arch.ln_cross, "ln3": arch.ln2}
    modules = {part: block.get_submodule(path) for part, path in modules.items()}
    seen, handles = {}, []
    for part, module in modules.items():
        hook = lambda m, args, out, part=part: seen.update({part: (args[0], out)})  # noqa: E731
        handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad(), probe.trace(model) as cache:
            model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    for part, module in modules.items():
        normed = cache[f"decoder.1.{part}.hook_normalized"] * module.weight
        normed = normed if getattr(module, "bias", None) is None else normed + module.bias
        torch.testing.assert_close(normed, seen[part][1], atol=1e-5, rtol=1e-5)
    mlp_norm = "ln2" if arch.post_ln else "ln3"
    assert torch.equal(cache["decoder.1.hook_mlp_in"], seen[mlp_norm][0])


@pytest.mark.parametrize("kind", ["t5", "flan-t5"])
def test_resid_mid2_is_the_stream_after_the_cross_attention(kind):
    """T5's decoder blocks: hook_resid_mid2 = resid_mid + cross_attn_out, resid_post = resid_mid2
    + mlp_out, and a replacement of resid_mid2 is the stream the MLP adds to."""
    model, batch = small_model(kind), seq2seq_batch()
    names = [f"decoder.1.{p}" for p in ("hook_resid_mid", "hook_cross_attn_out")]
    names += [f"decoder.1.{p}" for p in ("hook_resid_mid2", "hook_mlp_out", "hook_resid_post")]
    with torch.no_grad(), probe.trace(model, names) as cache:
        model(**batch)
    mid, cross, mid2, mlp_out, post = (cache[n] for n in names)
    torch.testing.assert_close(mid + cross, mid2, atol=1e-5, rtol=0)
    torch.testing.assert_close(mid2 + mlp_out, post, atol=1e-5, rtol=0)
    other = torch.randn(mid2.shape, generator=torch.Generator().manual_seed(0))
    edit = {"decoder.1.hook_resid_mid2": lambda x, hook: other}
    with torch.no_grad(), probe.hooks(model, edit), probe.trace(model, names[3:]) as edited:
        model(**batch)
    torch.testing.assert_close(
        other + edited["decoder.1.hook_mlp_out"], edited["decoder.1.hook_resid_post"]
    )


@pytest.mark.parametrize("kind", KINDS)
def test_per_head_inputs_in_each_stack(kind):
    """hook_k_input in the encoder and the decoder: an edit of one head's input changes that
    head's key only, to LN₁(x') W_K[h] + b_K[h] (no norm before a post-LN block's attention)."""
    model, batch = small_model(kind), seq2seq_batch()
    shift = torch.linspace(-1, 1, 32)

    def shift_head_1(x, hook):
        x = x.clone()
        x[:, :, 1] += shift
        return x

    for stack in ("encoder", "decoder"):
        arch, w = architecture(model, f"{stack}.attn"), probe.head_weights(model, f"{stack}.attn")
        names = [f"{stack}.1.attn.hook_k", f"{stack}.1.hook_resid_pre"]
        with torch.no_grad(), probe.trace(model, names) as plain:
            model(**batch)
        edit = {f"{stack}.1.hook_k_input": shift_head_1}
        with torch.no_grad(), probe.hooks(model, edit), probe.trace(model, names[0]) as edited:
            model(**batch)
            x = plain[names[1]] + shift
            x = x if arch.post_ln else blocks(model, f"{stack}.attn")[1].get_submodule(arch.ln1)(x)
        k, k_edited = plain[names[0]], edited[names[0]]
        torch.testing.assert_close(k_edited[:, :, 1], x @ w[1].W_K[1] + w[1].b_K[1])
        assert torch.equal(k_edited[:, :, [0, 2, 3]], k[:, :, [0, 2, 3]])
