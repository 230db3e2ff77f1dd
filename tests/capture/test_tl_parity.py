"""probe against TransformerLens on identical weights, for every architecture both support: every
hook point TransformerLens 4's TransformerBridge has exists in probe with the same shape and
value (the table lists, per architecture, the points compared and the largest difference), the
cache's TransformerLens conveniences give TransformerLens's results, and gradients are cached
under TransformerLens's ``_grad`` names.

Where the bridge departs from what TransformerLens documents (and from its own HookedTransformer
and HookedEncoder), probe keeps the documented meaning; ``BRIDGE_DEPARTS`` says what the bridge's
tensor is instead, and the test checks that too. Run as a script to print the table:

    PYTHONPATH=.:tests/support python tests/capture/test_tl_parity.py
"""

import copy
import re

import pytest
import torch
import transformers as tf
from models import CONFIGS, SEQ2SEQ

import probe
from probe.capture.architectures import architecture, blocks
from probe.capture.names import NORM_POINTS, hook_name, parse

pytest.importorskip(
    "transformer_lens.model_bridge",
    reason="TransformerLens ≥ 4 is not installed (pip install -e '.[parity]')",
)

HEADS = {
    "gpt2": tf.GPT2LMHeadModel,
    "llama": tf.LlamaForCausalLM,  # grouped-query attention: 4 query heads, 2 key/value heads
    "bert": tf.BertForMaskedLM,
    "gpt_neox": tf.GPTNeoXForCausalLM,
    "opt": tf.OPTForCausalLM,
    "mistral": tf.MistralForCausalLM,
    "qwen2": tf.Qwen2ForCausalLM,
    "qwen3": tf.Qwen3ForCausalLM,
    "gemma2": tf.Gemma2ForCausalLM,
    "gemma3_text": tf.Gemma3ForCausalLM,
    "phi3": tf.Phi3ForCausalLM,
}
# The bridge's points that are no activation of the model's: its rotary tables, and an alias of
# the attention's output before its projection.
NOT_ACTIVATIONS = {"hook_cos", "hook_sin", "hook_hidden_states"}
# The bridge's points probe does not have yet, by architecture.
MISSING: dict[str, set[str]] = {}


def _norm(model, layer, part):
    return blocks(model)[layer].get_submodule(getattr(architecture(model), part))


def _layer(name):
    return int(name.split(".")[1])


def _at(ours, name, point):
    return ours[f"blocks.{_layer(name)}.{point}"]


# Qwen3's query and key norms' points, after "blocks.{l}.".
QK_NORM_POINTS = [f"attn.{norm}.{p}" for norm in ("q_norm", "k_norm") for p in NORM_POINTS]
QK_NORM_POINTS += ["attn.hook_q_normed", "attn.hook_k_normed"]

# arch -> point (the name after "blocks.{l}.", or the whole name) -> (what the bridge computes
# instead, that tensor from probe's cache and the model).
BRIDGE_DEPARTS = {
    "bert": {
        "hook_embed": (
            "the embeddings' output after their LayerNorm, not the token embedding",
            lambda ours, model, name: ours["blocks.0.hook_resid_pre"],
        ),
        "attn.hook_attn_scores": (
            "after the softmax: the pattern",
            lambda ours, model, name: ours[name.replace("attn_scores", "pattern")],
        ),
        "hook_attn_out": (
            "LN₁(resid_mid), not the attention's output",
            lambda ours, model, name: _norm(model, _layer(name), "ln1")(
                _at(ours, name, "hook_resid_mid")
            ),
        ),
        "hook_mlp_in": (
            "LN₁(resid_mid), after the norm (HookedEncoder: before it)",
            lambda ours, model, name: _norm(model, _layer(name), "ln1")(
                _at(ours, name, "hook_resid_mid")
            ),
        ),
        "hook_resid_mid": (
            "after the MLP: resid_post",
            lambda ours, model, name: _at(ours, name, "hook_resid_post"),
        ),
        "hook_resid_post": (
            "LN₂(resid_post), HookedEncoder's hook_normalized_resid_post",
            lambda ours, model, name: _norm(model, _layer(name), "ln2")(ours[name]),
        ),
    },
    **{
        kind: {
            point: (
                "[batch, head, pos, …]: heads before positions, unlike its hook_q and hook_rot_q",
                lambda ours, model, name: ours[name].transpose(1, 2),
            )
            for point in QK_NORM_POINTS
        }
        for kind in ("qwen3", "gemma3_text")
    },
    "opt": {
        "attn.hook_attn_scores": (
            "after the softmax: the pattern",
            lambda ours, model, name: ours[name.replace("attn_scores", "pattern")],
        ),
        "ln2.hook_scale": (
            "[batch·pos, 1], positions flattened as OPT's MLP has them",
            lambda ours, model, name: ours[name].flatten(0, 1),
        ),
        "ln2.hook_normalized": (
            "[batch·pos, d_model], positions flattened",
            lambda ours, model, name: ours[name].flatten(0, 1),
        ),
    },
}


def pair(kind):
    """A small random model with a head, and TransformerLens's bridge on a copy of it."""
    from tokenizers_util import wordpiece
    from transformer_lens.model_bridge import TransformerBridge

    torch.manual_seed(0)
    head = (HEADS | SEQ2SEQ_HEADS)[kind]
    model = head((CONFIGS | SEQ2SEQ)[kind]()).eval()
    model.config.architectures = [head.__name__]  # how the bridge finds Gemma 3's adapter
    with torch.no_grad():  # random biases, so that they count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=0.1)
    bridge = TransformerBridge.boot_transformers(
        kind, hf_model=copy.deepcopy(model), tokenizer=wordpiece(), device="cpu"
    )
    return model, bridge


def _point(name):
    parts = name.split(".")
    return ".".join(parts[2:]) if parts[0] == "blocks" else name


def _allowed(x, *others):
    """Scores where no mask is added (masked entries: each its own large negative)."""
    keep = x > torch.finfo(x.dtype).min / 2
    return [t[keep] for t in (x, *others)]


def compare(kind):
    """Rows (arch, point, layers, largest difference, note) over every point of the bridge's."""
    model, bridge = pair(kind)
    ids = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, theirs = bridge.run_with_cache(ids)
        with probe.trace(model) as ours:
            model(ids)
    departs = BRIDGE_DEPARTS.get(kind, {})
    worst: dict[str, list] = {}
    for name in theirs.keys():  # noqa: SIM118 (an ActivationCache, not a dict)
        point = _point(name)
        if name.endswith(("hook_in", "hook_out")):
            continue  # the bridge's aliases of each module's input and output
        if name.rpartition(".")[2] in NOT_ACTIVATIONS or point in MISSING.get(kind, ()):
            continue
        assert name in ours, f"{kind}: probe has no {name}"
        note, expected = departs.get(point, ("", lambda ours, model, name: ours[name]))
        with torch.no_grad():
            a, b = expected(ours, model, name), theirs[name]
        assert a.shape == b.shape, f"{kind} {name}: {tuple(a.shape)} != {tuple(b.shape)}"
        if point.endswith("hook_attn_scores") and not note:
            assert torch.equal(*(t > torch.finfo(t.dtype).min / 2 for t in (a, b))), name
            a, b = _allowed(a, b)
        diff = (a - b).abs().max().item()
        row = worst.setdefault(point, [kind, point, 0, 0.0, note])
        row[2] += 1
        row[3] = max(row[3], diff)
    return [tuple(row) for row in worst.values()]


@pytest.mark.parametrize("kind", sorted(HEADS))
def test_every_transformer_lens_point_exists_and_agrees(kind):
    rows = compare(kind)
    print(f"\n{'arch':11} {'hook':32} {'layers':>6} {'max diff':>9}  bridge departs")
    for arch, point, layers, diff, note in rows:
        print(f"{arch:11} {point:32} {layers:6d} {diff:9.1e}  {note}")
    assert {"attn.hook_pattern", "hook_resid_pre", "hook_embed"} <= {r[1] for r in rows}
    for _, point, _, diff, _ in rows:
        assert diff <= 1e-5, f"{kind} {point}: {diff}"


SEQ2SEQ_HEADS = {
    "bart": tf.BartForConditionalGeneration,
    "mbart": tf.MBartForConditionalGeneration,
    "marian": tf.MarianMTModel,
    "t5": tf.T5ForConditionalGeneration,
}


def _seq2seq_name(name):
    """probe's name of a point of the bridge's encoder-decoder models (``encoder_blocks.0.``,
    ``decoder_blocks.0.self_attn.``)."""
    name = re.sub(r"^(encoder|decoder)_blocks\.(\d+)\.", r"\1.\2.", name)
    return name.replace(".self_attn.", ".attn.")


def _block_norm(model, name, part):
    """The norm ``part`` (probe's ln1, ln2, ln3) of the block of the point ``name``."""
    parsed = parse(name)
    arch = architecture(model, f"{parsed.stack}.attn")
    paths = {"ln1": arch.ln1, "ln2": arch.ln_cross or arch.ln2, "ln3": arch.ln2}
    return blocks(model, f"{parsed.stack}.attn")[parsed.layer].get_submodule(paths[part])


def _same_block(ours, name, point):
    parsed = parse(name)
    return ours[hook_name(point, parsed.layer, parsed.stack)]


def _normed(part, point):
    """The block's norm ``part`` applied to probe's ``point`` of the same block."""
    return lambda ours, model, name: _block_norm(model, name, part)(_same_block(ours, name, point))


def _centred(ours, model, name):
    """A norm's point computed as a LayerNorm's (the mean subtracted) on the norm's input,
    recovered from probe's points as hook_normalized · hook_scale."""
    norm, _, point = name.rpartition(".")
    x = ours[f"{norm}.hook_normalized"] * ours[f"{norm}.hook_scale"]
    x = x - x.mean(-1, keepdim=True)
    scale = (x.pow(2).mean(-1, keepdim=True) + model.config.layer_norm_epsilon).sqrt()
    return scale if point == "hook_scale" else x / scale


_PATTERN = (
    "after the softmax: the pattern",
    lambda o, m, n: o[n.replace("attn_scores", "pattern")],
)
_AFTER = "after the norm that follows it (probe: before, as HookedEncoder)"
# The bridge's departures on encoder-decoder models: point (the name without the layer) ->
# (what its tensor is, that tensor from probe's cache and the model).
_POST_LN_DEPARTS = {
    "hook_embed": (
        "the embeddings after their LayerNorm: encoder.0.hook_resid_pre",
        lambda ours, model, name: ours["encoder.0.hook_resid_pre"],
    ),
    **{f"{a}.hook_attn_scores": _PATTERN for a in ("encoder.attn", "decoder.attn")},
    "decoder.cross_attn.hook_attn_scores": _PATTERN,
    "encoder.hook_resid_mid": (
        "after the MLP: resid_post",
        lambda ours, model, name: _same_block(ours, name, "hook_resid_post"),
    ),
    "encoder.hook_mlp_in": (f"LN₁(mlp_in), {_AFTER}", _normed("ln1", "hook_mlp_in")),
    "encoder.hook_resid_post": ("LN₂(resid_post)", _normed("ln2", "hook_resid_post")),
    "decoder.hook_resid_mid": (
        "after the cross-attention: LN₁(resid_mid) + cross_attn_out, probe's mlp_in",
        lambda ours, model, name: _same_block(ours, name, "hook_mlp_in"),
    ),
    "decoder.hook_mlp_in": (f"LN₂(mlp_in), {_AFTER}", _normed("ln2", "hook_mlp_in")),
    "decoder.hook_resid_post": ("LN₃(resid_post)", _normed("ln3", "hook_resid_post")),
}
SEQ2SEQ_DEPARTS = {
    "bart": _POST_LN_DEPARTS,
    "marian": {
        **{k: v for k, v in _POST_LN_DEPARTS.items() if k != "hook_embed"},
        "hook_pos_embed": (
            "[pos, d_model], without the batch axis",
            lambda ours, model, name: ours["hook_pos_embed"][0],
        ),
    },
    "mbart": {
        **{k: v for k, v in _POST_LN_DEPARTS.items() if k.endswith(("scores", "hook_embed"))},
        "encoder.hook_mlp_in": (f"LN₂(mlp_in), {_AFTER}", _normed("ln2", "hook_mlp_in")),
        "decoder.hook_mlp_in": (f"LN₃(mlp_in), {_AFTER}", _normed("ln3", "hook_mlp_in")),
    },
    "t5": {
        f"{norm}.{p}": ("centred, though T5's norms are RMSNorms (no mean subtracted)", _centred)
        for norm in (
            *(f"{stack}.{ln}" for stack in ("encoder", "decoder") for ln in ("ln1", "ln2")),
            "decoder.ln3", "encoder_ln_final", "decoder_ln_final",
        )
        for p in NORM_POINTS
    },
}  # fmt: skip
# The bridge's points probe has not.
SEQ2SEQ_MISSING: dict[str, set[str]] = {}


def compare_seq2seq(kind):
    """Rows as ``compare``'s over every point of the bridge's on an encoder-decoder model, named
    as probe names them (``encoder.attn.hook_q`` for every layer of ``encoder.{l}.attn.hook_q``);
    and probe's own points the bridge lacks."""
    model, bridge = pair(kind)
    ids = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, theirs = bridge.run_with_cache(ids, decoder_input=ids[:, :5])
        with probe.trace(model) as ours:
            model(input_ids=ids, decoder_input_ids=ids[:, :5])
    departs, worst = SEQ2SEQ_DEPARTS.get(kind, {}), {}
    for their_name in theirs.keys():  # noqa: SIM118 (an ActivationCache, not a dict)
        name = _seq2seq_name(their_name)
        point = re.sub(r"\.\d+\.", ".", name)
        if name.endswith(("hook_in", "hook_out")) or point in SEQ2SEQ_MISSING.get(kind, ()):
            continue
        assert name in ours, f"{kind}: probe has no {name} (the bridge's {their_name})"
        note, expected = departs.get(point, ("", lambda ours, model, name: ours[name]))
        with torch.no_grad():
            a, b = expected(ours, model, name), theirs[their_name]
        assert a.shape == b.shape, f"{kind} {name}: {tuple(a.shape)} != {tuple(b.shape)}"
        if point.endswith("hook_attn_scores") and not note:
            a, b = _allowed(a, b)
        row = worst.setdefault(point, [kind, point, 0, 0.0, note])
        row[2] += 1
        row[3] = max(row[3], (a - b).abs().max().item())
    theirs_named = {_seq2seq_name(n) for n in theirs.keys()}  # noqa: SIM118
    return [tuple(row) for row in worst.values()], sorted(set(ours) - theirs_named)


@pytest.mark.parametrize("kind", sorted(SEQ2SEQ_HEADS))
@pytest.mark.slow
def test_encoder_decoder_points_equal_transformer_lens(kind):
    """Every point of the bridge's on BART, mBART, Marian and T5 is probe's, with the same
    value or, where the bridge departs, the value of what it computes instead."""
    rows, only_ours = compare_seq2seq(kind)
    print(f"\n{'arch':11} {'hook':36} {'layers':>6} {'max diff':>9}  bridge departs")
    for arch, point, layers, diff, note in rows:
        print(f"{arch:11} {point:36} {layers:6d} {diff:9.1e}  {note}")
    only_ours = sorted({re.sub(r"\.\d+\.", ".", n) for n in only_ours})
    print(f"probe's, not the bridge's: {', '.join(only_ours)}")
    points = {r[1] for r in rows}
    assert {"encoder.attn.hook_pattern", "decoder.cross_attn.hook_z", "hook_unembed"} <= points
    assert {"decoder.ln2.hook_scale", "decoder.ln3.hook_scale"} <= points
    assert ("decoder.hook_resid_mid2" in points) == (kind == "t5")
    for _, point, _, diff, _ in rows:
        assert diff <= 1e-5, f"{kind} {point}: {diff}"


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_cache_methods_equal_transformer_lens(kind):
    model, bridge = pair(kind)
    ids = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, theirs = bridge.run_with_cache(ids)
        with probe.trace(model) as ours:
            model(ids)
    calls = [
        ("accumulated_resid", {}),
        ("accumulated_resid", {"layer": 1, "incl_mid": True}),
        ("accumulated_resid", {"apply_ln": True}),
        ("accumulated_resid", {"layer": 1, "mlp_input": True, "apply_ln": True, "pos_slice": -1}),
        ("decompose_resid", {}),
        ("decompose_resid", {"layer": 1, "mlp_input": True, "mode": "attn", "apply_ln": True}),
        ("decompose_resid", {"pos_slice": (2, 5), "apply_ln": True}),
        ("stack_head_results", {}),
        ("stack_head_results", {"layer": 1, "incl_remainder": True, "apply_ln": True}),
        ("stack_head_results", {"pos_slice": -1, "apply_ln": True}),
    ]
    with torch.no_grad():
        for method, kwargs in calls:
            a, labels_a = getattr(ours, method)(**kwargs, return_labels=True)
            b, labels_b = getattr(theirs, method)(**kwargs, return_labels=True)
            assert labels_a == labels_b, (method, kwargs)
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"{method} {kwargs}")
        stack = ours.decompose_resid(pos_slice=-1)
        for kwargs in ({"layer": 1}, {"layer": 0, "mlp_input": True}, {"layer": None}):
            full = ours.decompose_resid()
            torch.testing.assert_close(
                ours.apply_ln_to_stack(full, **kwargs),
                theirs.apply_ln_to_stack(full, **kwargs),
                atol=1e-5,
                rtol=1e-5,
            )
        for kwargs in (
            {"tokens": ids[:, -1]},
            {"tokens": 5},
            {"tokens": ids[:, -1], "incorrect_tokens": ids[:, 0]},
        ):
            torch.testing.assert_close(
                ours.logit_attrs(stack, pos_slice=-1, **kwargs),
                theirs.logit_attrs(stack, pos_slice=-1, **kwargs),
                atol=1e-5,
                rtol=1e-5,
            )
    for key in [("pattern", 0), ("q", 1, "attn"), ("scale", 0, "ln1"), ("resid_pre", -1)]:
        assert torch.equal(
            ours[key], ours[probe.capture.names.act_name(*key[:1], key[1] % 2, *key[2:])]
        )
        torch.testing.assert_close(ours[key], theirs[key], atol=1e-5, rtol=1e-5)
    for key in ("scale", "embed", "pos_embed" if kind == "gpt2" else "unembed"):
        torch.testing.assert_close(ours[key], theirs[key], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_gradients_cached_under_transformer_lens_names(kind):
    """trace(incl_bwd=True) caches each point's gradient as TransformerLens's run_with_cache
    (incl_bwd=True) does: same names, same values."""
    model, bridge = pair(kind)
    ids = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(3))
    names = ("hook_pattern", "hook_resid_pre", "hook_z", "ln1.hook_scale", "hook_embed")

    def wanted(name):
        return name.endswith(names) and "ln_final" not in name

    _, theirs = bridge.run_with_cache(
        ids, names_filter=wanted, incl_bwd=True, return_type="loss"
    )  # the mean next-token cross-entropy, as transformers' loss with labels=ids
    with probe.trace(model, wanted, incl_bwd=True) as ours:
        model(ids, labels=ids).loss.backward()
    grads = [n for n in theirs.keys() if n.endswith("_grad")]  # noqa: SIM118
    assert len(grads) == 2 * 4 + 1
    for name in grads:
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-5, rtol=1e-4, msg=name)


if __name__ == "__main__":
    print(f"{'arch':11} {'hook':32} {'layers':>6} {'max diff':>9}  bridge departs")
    for kind in HEADS:
        for arch, point, layers, diff, note in compare(kind):
            print(f"{arch:11} {point:32} {layers:6d} {diff:9.1e}  {note}")
    for kind in SEQ2SEQ_HEADS:
        for arch, point, layers, diff, note in compare_seq2seq(kind)[0]:
            print(f"{arch:11} {point:36} {layers:6d} {diff:9.1e}  {note}")


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2", "gpt_neox", "phi3"])
@pytest.mark.slow
def test_per_head_inputs_equal_transformer_lens(kind):
    """hook_attn_in and hook_q_input/k_input/v_input (TransformerLens's use_attn_in and
    use_split_qkv_input): the same tensors, and the same output when one head's input is
    edited (the edit reaches only that head, through ln1)."""
    model, bridge = pair(kind)
    ids = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(4))

    def shift_head_1(x, hook):
        x = x.clone()
        x[:, :, 1] += torch.linspace(-1, 1, x.shape[-1])
        return x

    for flag, points in (
        ("attn_in", ["hook_attn_in"]),
        ("split", ["hook_q_input", "hook_v_input"]),
    ):
        getattr(bridge, "set_use_attn_in" if flag == "attn_in" else "set_use_split_qkv_input")(True)
        with torch.no_grad():
            _, theirs = bridge.run_with_cache(ids)
            with probe.trace(model, points) as ours:
                model(ids)
            for name in ours:
                torch.testing.assert_close(ours[name], theirs[name], atol=1e-5, rtol=1e-5)
            edits = [(f"blocks.1.{p}", shift_head_1) for p in points]
            expected = bridge.run_with_hooks(ids, fwd_hooks=edits)
            with probe.hooks(model, edits):
                got = model(ids).logits
            assert not torch.allclose(got, model(ids).logits, atol=1e-4)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        getattr(bridge, "set_use_attn_in" if flag == "attn_in" else "set_use_split_qkv_input")(
            False
        )
