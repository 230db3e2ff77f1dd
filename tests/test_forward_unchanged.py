"""A trace that edits nothing leaves the model's output bit for bit as it was: the mirror runs
the model's own attention kernel (sdpa or its eager function) and computes what it captures
beside it."""

import pytest
import torch
from models import CONFIGS, SEQ2SEQ, small_model

import probe
from probe.runner import decoder_inputs


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
