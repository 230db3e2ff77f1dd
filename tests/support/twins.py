"""The ungrouped twin of a model with grouped-query attention: the same model with each key and
value head's weights repeated for every query head it serves (``num_key_value_heads`` =
``num_attention_heads``). Its outputs are the model's, and each of its query heads has keys and
values of its own: what probe's ungrouped view of the grouped model must match."""

from __future__ import annotations

import copy

import torch


def ungrouped_twin(model):
    """A new model of ``model``'s class whose ``k_proj`` and ``v_proj`` rows (weights and biases)
    are repeated per group of query heads; every other weight (the query and key norms of Qwen3
    and Gemma, which are per ``d_head`` and shared by the heads) is copied as it is."""
    config = copy.deepcopy(model.config)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    group = heads // kv_heads
    d_head = getattr(config, "head_dim", None) or config.hidden_size // heads
    config.num_key_value_heads = heads
    twin = type(model)(config).eval()
    state = {}
    for name, value in model.state_dict().items():
        if name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
            rows = value.unflatten(0, (kv_heads, d_head)).repeat_interleave(group, dim=0)
            value = rows.flatten(0, 1)
        state[name] = value
    twin.load_state_dict(state)
    assert twin.config.num_key_value_heads == heads and group > 1
    return twin.to(next(model.parameters()).dtype)


def causal_lm(kind: str, seed: int = 0):
    """A small random causal LM of ``kind`` (tests/support/models.py's configs) with grouped-query
    attention, biases and norm weights that count."""
    import transformers as tf
    from models import CONFIGS

    torch.manual_seed(seed)
    config = CONFIGS[kind]()
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    return model
