"""probe's hook points against TransformerLens's on identical weights: same names, same shapes,
same values. TransformerLens 4 wraps the Hugging Face model in a ``TransformerBridge`` that
recomputes the attention step by step (projections, norms, rotation, scores) with its own hooks;
it is given a copy of the model probe mirrors, and works offline."""

import copy

import pytest
import torch
import transformers as tf
from models import CONFIGS

import probe
from probe.capture.names import ATTENTION_POINTS, ROTARY_POINTS, hook_name

pytest.importorskip(
    "transformer_lens.model_bridge",
    reason="TransformerLens ≥ 4 is not installed (pip install -e '.[parity]')",
)

# Decoders with grouped-query attention (4 query heads, 2 key/value heads); Qwen3 with its
# query and key norms between the projections and the rotation.
MODELS = {"llama": tf.LlamaForCausalLM, "qwen3": tf.Qwen3ForCausalLM}
# TransformerLens computes hook_result only on request (cfg.use_attn_result).
COMPARED = [p for p in ATTENTION_POINTS + ROTARY_POINTS if p != "hook_result"]


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_attention_points_equal_transformer_lens(kind):
    from tokenizers_util import wordpiece
    from transformer_lens.model_bridge import TransformerBridge

    torch.manual_seed(0)
    model = MODELS[kind](CONFIGS[kind]()).eval()
    bridge = TransformerBridge.boot_transformers(
        kind, hf_model=copy.deepcopy(model), tokenizer=wordpiece(), device="cpu"
    )
    ids = torch.randint(3, 99, (2, 7))
    with torch.no_grad():
        _, theirs = bridge.run_with_cache(ids)
        with probe.trace(model, COMPARED) as ours:
            model(ids)
    for layer in range(model.config.num_hidden_layers):
        for point in COMPARED:
            name = hook_name(point, layer)
            a, b = ours[name], theirs[name]
            assert a.shape == b.shape, name
            if point == "hook_attn_scores":  # masked entries: each its own large negative
                allowed = b > torch.finfo(b.dtype).min / 2
                assert torch.equal(allowed, a > torch.finfo(a.dtype).min / 2), name
                a, b = a[allowed], b[allowed]
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    assert ours["blocks.0.attn.hook_k"].shape == (2, 7, 2, 8)  # keys keep their 2 heads
