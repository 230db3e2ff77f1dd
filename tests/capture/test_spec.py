"""The model's description (``probe.capture.spec``): derived once, frozen, equal to what the
model's modules and weights say, and the only place the rest of probe reads those facts from."""

import ast
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from models import CONFIGS, ROTARY, SEQ2SEQ, small_model

from probe.capture.head_weights import iter_head_weights
from probe.capture.names import Attention
from probe.capture.spec import describe

ROOT = Path(__file__).resolve().parents[2]
# The functions that derive a fact from the Hugging Face model: called by the description alone
# (and by loading, on a config, before the model it chooses the class of exists).
DERIVATIONS = {"head_count", "head_dim", "is_causal", "is_encoder_decoder", "attentions",
               "max_positions", "is_rotary"}  # fmt: skip
DERIVERS = {
    "probe/capture/architectures.py", "probe/capture/head_weights.py", "probe/capture/spec.py"
}  # fmt: skip
ON_A_CONFIG = {("probe/pipeline/loading.py", "is_causal")}


@pytest.mark.parametrize("kind", sorted(CONFIGS | SEQ2SEQ))
def test_the_description_is_what_the_weights_say(kind):
    model = small_model(kind)
    spec = describe(model)
    assert describe(model) is spec  # derived once
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.causal = not spec.causal
    config = model.config
    assert spec.model_type == config.model_type and spec.d_model == config.hidden_size
    assert spec.d_vocab == model.get_input_embeddings().weight.shape[0]
    assert spec.encoder_decoder == (kind in SEQ2SEQ)
    names = [a.name for a in spec.attentions]
    if kind in SEQ2SEQ:
        assert names == [Attention.ENCODER, Attention.DECODER, Attention.CROSS]
    else:
        assert names == [Attention.BLOCKS]
    for a in spec.attentions:
        weights = list(iter_head_weights(model, a.name))
        assert a.n_layers == len(weights)
        assert a.n_heads == weights[0].W_Q.shape[0] and a.n_kv_heads == weights[0].W_K.shape[0]
        assert a.d_head == weights[0].W_Q.shape[-1]
        assert a.rotary == (kind in ROTARY)
    assert spec.n_layers == spec.attentions[0].n_layers
    json.dumps(spec.as_dict())  # as run.json holds it


def test_a_language_model_and_its_base_share_one_description():
    import transformers as tf

    lm = tf.LlamaForCausalLM(CONFIGS["llama"]())
    assert describe(lm) is describe(lm.model)
    assert describe(lm).attention().n_kv_heads == 2


def test_positions_are_the_table_learned_positions_have():
    assert describe(small_model("bert")).n_ctx == 512
    assert describe(small_model("roberta")).n_ctx == 510  # counted from its padding index + 1
    assert describe(small_model("gpt2")).n_ctx == 64
    assert describe(small_model("llama")).n_ctx is None  # rotary: no table


def test_no_module_derives_a_model_fact_itself():
    """Outside the description (and ``architectures``, where it derives them), no module of probe
    or the analyses calls a function that derives a fact about the model: it reads
    ``describe(model)``."""
    found = []
    for path in sorted([*(ROOT / "probe").rglob("*.py"), *(ROOT / "analyses").rglob("*.py")]):
        where = path.relative_to(ROOT).as_posix()
        if where in DERIVERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name in DERIVATIONS and (where, name) not in ON_A_CONFIG:
                    found.append(f"{where}:{node.lineno} {name}()")
    assert not found, "read probe.capture.spec.describe(model) instead:\n" + "\n".join(found)


def test_run_json_shows_the_description(sample_report):
    run = json.loads((sample_report / "run.json").read_text())
    assert run["spec"]["attentions"][0] == {
        "name": "blocks.attn", "n_layers": 6, "n_heads": 12, "n_kv_heads": 12, "d_head": 32,
        "rotary": False,
    }  # fmt: skip
    assert run["spec"]["n_ctx"] == 512 and run["spec"]["causal"] is False


def test_a_module_that_is_no_hugging_face_model_is_one_line():
    import probe

    with pytest.raises(probe.ProbeError, match="no Hugging Face model"):
        describe(torch.nn.Linear(2, 2))


def test_query_heads_that_do_not_divide_among_key_value_heads_are_refused():
    import transformers as tf

    from probe.capture.architectures import UnsupportedModelError

    config = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=3, head_dim=16,
                            vocab_size=64)  # fmt: skip
    with pytest.raises(UnsupportedModelError, match="its 4 query heads do not divide among its 3"):
        describe(tf.LlamaForCausalLM(config))
