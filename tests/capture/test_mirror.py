"""Hook points mirrored onto Hugging Face models: outputs unchanged, captures exact, edits real."""

import ast
from pathlib import Path

import pytest
import torch
import transformers as tf
from models import CONFIGS, ENCODERS, ROTARY, padded_batch, small_model

import probe
from probe.capture import attention_function
from probe.capture.architectures import architecture, blocks, is_rotary
from probe.capture.names import Attention, HookName, Stack, hook_name, parse

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
    assert is_rotary(model) == (kind in ROTARY)
    for layer, w in enumerate(weights):
        name = f"blocks.{layer}.attn."
        assert cache[name + "hook_q"].shape == (3, 7, 4, 8)
        assert cache[name + "hook_k"].shape == cache[name + "hook_v"].shape == (3, 7, n_kv, 8)
        if kind in ROTARY:
            assert cache[name + "hook_rot_q"].shape == (3, 7, 4, 8)
            assert cache[name + "hook_rot_k"].shape == (3, 7, n_kv, 8)
        assert cache[name + "hook_attn_scores"].shape == (3, 4, 7, 7)
        assert cache[name + "hook_z"].shape == (3, 7, 4, 8)
        result = cache[name + "hook_result"]
        assert result.shape == (3, 7, 4, 32)
        torch.testing.assert_close(
            (result.sum(2) + w.b_O)[real], outputs[layer][real], atol=1e-5, rtol=0
        )
        x = inputs[layer]
        # Keys and values from the head weights, on every layout: before any rotation or norm.
        for head in range(n_kv):
            for point, W, b in (("hook_k", w.W_K, w.b_K), ("hook_v", w.W_V, w.b_V)):
                torch.testing.assert_close(
                    cache[name + point][:, :, head], x @ W[head] + b[head], atol=1e-5, rtol=0
                )
        for head in range(4):  # OPT's too, before it scales them (as TransformerLens)
            expected = x @ w.W_Q[head] + w.b_Q[head]
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


def rotate(x, theta: float):
    """Rotary position embedding of ``x`` [batch, pos, head, d_head] at positions 0, 1, …,
    computed here from the base θ: dimension pairs (i, i + d/2) turn by pos·θ^(-2i/d)."""
    d = x.shape[-1]
    angles = torch.arange(x.shape[1])[:, None] * theta ** (-torch.arange(0, d, 2) / d)
    cos, sin = (f(angles).repeat(1, 2)[:, None] for f in (torch.cos, torch.sin))  # [pos, 1, d]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_rotary_points_before_and_after_the_rotation(kind):
    """As TransformerLens: hook_q and hook_k are the projections of the block's normalised input,
    hook_rot_q and hook_rot_k those rotated (Qwen3: after its query and key norms), and they are
    what meets in the scores. Grouped-query attention: 4 query heads, 2 key heads."""
    model = small_model(kind)
    batch = padded_batch(kind)
    with torch.no_grad(), probe.trace(model) as cache:
        model(**batch)
    theta = model.config.rope_parameters["rope_theta"]
    for layer, block in enumerate(blocks(model)):
        attn, name = block.self_attn, f"blocks.{layer}.attn."
        x = block.input_layernorm(cache[f"blocks.{layer}.hook_resid_pre"])
        q, k = cache[name + "hook_q"], cache[name + "hook_k"]
        assert q.shape == (3, 7, 4, 8) and k.shape == (3, 7, 2, 8)
        torch.testing.assert_close(q, attn.q_proj(x).unflatten(-1, (4, 8)), atol=1e-6, rtol=0)
        torch.testing.assert_close(k, attn.k_proj(x).unflatten(-1, (2, 8)), atol=1e-6, rtol=0)
        if kind == "qwen3":
            q, k = attn.q_norm(q), attn.k_norm(k)
        rot_q, rot_k = cache[name + "hook_rot_q"], cache[name + "hook_rot_k"]
        torch.testing.assert_close(rot_q, rotate(q, theta), atol=1e-5, rtol=0)
        torch.testing.assert_close(rot_k, rotate(k, theta), atol=1e-5, rtol=0)
        scores = cache[name + "hook_attn_scores"]  # [batch, head, q_pos, k_pos]
        expected = torch.einsum("bqhd,bkhd->bhqk", rot_q, rot_k.repeat_interleave(2, dim=2))
        allowed = scores > torch.finfo(scores.dtype).min / 2  # causal and padding mask
        assert allowed.any() and not allowed.all()
        torch.testing.assert_close(
            scores[allowed], (expected * attn.scaling)[allowed], atol=1e-5, rtol=0
        )


@pytest.mark.parametrize("kind", ["llama", "qwen3", "phi3", "gpt_neox", "modernbert"])
def test_edits_before_the_rotation_flow_through_it(kind):
    """Zeroing query head 1 in hook_q zeroes it after the norm and the rotation, so its scores
    are 0 and its pattern uniform over the keys it may see; zeroing key head 0 in hook_k does
    the same to its rotated keys. Both change the output (separate and fused projections)."""
    model = small_model(kind)
    batch = padded_batch(kind)

    def zero(head):
        def edit(x, hook):
            x = x.clone()
            x[:, :, head] = 0
            return x

        return edit

    real = batch["attention_mask"].bool()
    with torch.no_grad():
        plain = model(**batch).last_hidden_state
        edits = {"blocks.0.attn.hook_q": zero(1), "blocks.0.attn.hook_k": zero(0)}
        names = ["blocks.0.attn.hook_rot_q", "blocks.0.attn.hook_rot_k", "hook_pattern"]
        with probe.hooks(model, edits), probe.trace(model, names) as cache:
            edited = model(**batch).last_hidden_state
    assert (cache["blocks.0.attn.hook_rot_q"][:, :, 1] == 0).all()
    assert (cache["blocks.0.attn.hook_rot_q"][:, :, 0] != 0).any()
    assert (cache["blocks.0.attn.hook_rot_k"][:, :, 0] == 0).all()
    pattern = cache["blocks.0.attn.hook_pattern"][:, 1]  # [batch, q_pos, k_pos]
    seen = pattern > 0
    uniform = 1 / seen.sum(-1, keepdim=True).expand_as(pattern)
    torch.testing.assert_close(pattern[seen], uniform[seen], atol=1e-6, rtol=0)
    assert (edited - plain)[real].abs().max() > 1e-5  # ModernBERT: near-uniform at random init


@pytest.mark.parametrize("kind", ["gpt2", "bert", "opt"])
def test_models_without_rotation_have_no_rotated_points(kind):
    model = small_model(kind)
    assert not is_rotary(model)
    with pytest.raises(KeyError, match="unknown hook point 'hook_rot_q'"):
        probe.trace(model, "hook_rot_q").__enter__()


def test_names_are_built_and_parsed_in_one_place():
    examples = {
        "blocks.3.attn.hook_pattern": HookName("hook_pattern", 3, Stack.BLOCKS, "attn"),
        "encoder.0.attn.hook_z": HookName("hook_z", 0, Stack.ENCODER, "attn"),
        "decoder.1.cross_attn.hook_q": HookName("hook_q", 1, Stack.DECODER, "cross_attn"),
        "blocks.2.attn.hook_rot_k": HookName("hook_rot_k", 2, Stack.BLOCKS, "attn"),
        "blocks.0.hook_resid_pre": HookName("hook_resid_pre", 0, Stack.BLOCKS),
        "decoder.1.hook_cross_attn_out": HookName("hook_cross_attn_out", 1, Stack.DECODER),
        "hook_embed": HookName("hook_embed"),
        "hook_z": HookName("hook_z"),
    }
    for name, parts in examples.items():
        assert parse(name) == parts and str(parts) == name
    assert hook_name("pattern", 3) == "blocks.3.attn.hook_pattern"  # TransformerLens's short form
    assert hook_name("hook_z", 1, Attention.CROSS) == "decoder.1.cross_attn.hook_z"
    assert hook_name("hook_q", 0, "encoder") == "encoder.0.attn.hook_q"
    assert hook_name("hook_resid_pre", 2, "decoder.cross_attn") == "decoder.2.hook_resid_pre"
    assert parse("decoder.1.cross_attn.hook_z").attention == "decoder.cross_attn"
    assert Attention.CROSS.stack == "decoder" and Attention.CROSS.attn == "cross_attn"
    for bad in ("blocks.0.cross_attn.hook_z", "layers.0.attn.hook_z", "blocks.0.hook_q"):
        with pytest.raises(ValueError, match="not a probe hook name"):
            parse(bad)
    with pytest.raises(ValueError, match="unknown hook point 'hook_zz'"):
        hook_name("hook_zz", 0)
    with pytest.raises(ValueError, match="unknown site"):
        hook_name("hook_z", 0, "decoder.self_attn")


def probe_imports() -> dict[str, set[str]]:
    """Each module of the probe package -> the probe modules it imports, anywhere in it
    (inside functions too)."""
    root = Path(probe.__file__).parent
    modules = {
        ".".join(("probe", *f.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
        for f in root.rglob("*.py")
    }
    graph = {}
    for module in modules:
        path = root.joinpath(*module.split(".")[1:])
        source = (path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text()
        found = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.module:
                found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        graph[module] = (found & modules) - {module}
    return graph


def test_the_library_core_imports_no_cycle():
    """hookpoints imports mirror (for Hugging Face models), so mirror (and its parts) must not
    import hookpoints; names and architectures sit below both."""
    graph = probe_imports()
    assert "probe.capture.mirror" in graph["probe.capture.hookpoints"]
    for start in (
        "probe.capture.hookpoints",
        "probe.capture.mirror",
        "probe.capture.sites",
        "probe.capture.hooks",
        "probe.capture.attention_function",
        "probe.capture.norms",
        "probe.capture.modes",
        "probe.capture.names",
        "probe.capture.architectures",
        "probe.capture.head_weights",
    ):
        seen, todo = set(), [start]
        while todo:
            for module in graph[todo.pop()] - seen:
                seen.add(module)
                todo.append(module)
        assert start not in seen, f"{start} imports itself through {sorted(seen)}"
    assert graph["probe.capture.names"] == set()


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


def test_a_mirror_is_built_once_per_model_and_anew_when_a_module_is_swapped():
    """Traces reuse the model's mirror (building one per trace cost ~10 ms of MiniLM's ~90 ms
    batches); a module swapped in gets hooked, and a model no longer used is freed."""
    import gc
    import weakref

    from probe.capture import mirror as mirror_module

    model, batch = small_model("gpt2"), padded_batch("gpt2")
    with torch.no_grad():
        with probe.trace(model, "hook_z") as first:
            model(**batch)
        built = mirror_module._BUILT[model][1]
        with probe.trace(model, "hook_z") as second:
            model(**batch)
        assert mirror_module._BUILT[model][1] is built and set(first) == set(second)
        old = model.h[1].attn
        model.h[1].attn = type(old)(model.config, layer_idx=1).eval()  # new weights
        with probe.trace(model, "hook_z") as third:
            out = model(**batch).last_hidden_state
        assert mirror_module._BUILT[model][1] is not built
        z = third["blocks.1.attn.hook_z"]
        assert not torch.equal(z, second["blocks.1.attn.hook_z"])
        with probe.trace(model, "hook_z", keep_grad=False) as plain:  # and what it captured is
            assert torch.equal(model(**batch).last_hidden_state, out)  # the new module's z
        assert torch.equal(plain["blocks.1.attn.hook_z"], z)
    gone = weakref.ref(model)
    del model, built, old, first, second, third, plain  # a Cache keeps its model
    gc.collect()
    assert gone() is None


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


@pytest.mark.slow
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


@pytest.mark.parametrize("kind", ["llama", "gpt2", "bert"])
def test_two_models_sharing_a_config_traced_at_once(kind):
    """A model built from another's config shares it; traced together (nested), each runs as it
    does alone, captures its own points, and both are restored when the blocks end."""
    a = small_model(kind)
    b = type(a)(a.config).eval()
    batch = padded_batch(kind)
    plain = [m(**batch)[0] for m in (a, b)]
    implementation = a.config._attn_implementation
    with probe.trace(a, "hook_pattern") as first, probe.trace(b, "hook_pattern") as second:
        traced = [m(**batch)[0] for m in (a, b)]
        assert attention_function._BY_CONFIG[id(a.config)] is not None
    assert all(torch.equal(x, y) for x, y in zip(plain, traced, strict=True))
    assert not torch.equal(first["pattern", 0], second["pattern", 0])
    assert a.config._attn_implementation == implementation
    assert not attention_function._BY_CONFIG and not attention_function._MIRRORS
