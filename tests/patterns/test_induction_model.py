"""The tiny GPT-2 with known heads (tests/support/induction.py) does what its constants say it does.

Nothing is trained here: the model was trained once by tests/support/make_induction_model.py.
"""

import pytest
import torch
from induction import (
    INDUCTION,
    MODEL,
    PREVIOUS_TOKEN,
    VOCAB,
    copy_losses,
    fresh,
    induction_scores,
    previous_token_scores,
    repeated,
)

import probe

N = 20  # copy length, inside the trained range (2..30); the seeds below differ from training's


@pytest.fixture(scope="module")
def model():
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(MODEL, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def patterns(model):
    """``[layer, batch, head, q, k]`` on repeated sequences."""
    with torch.no_grad(), probe.trace(model, "hook_pattern") as cache:
        model(input_ids=repeated(64, N, VOCAB, seed=7))
    return torch.stack([cache[f"blocks.{layer}.attn.hook_pattern"] for layer in range(2)])


def losses(model, ids: torch.Tensor) -> tuple[float, float]:
    with torch.no_grad():
        return copy_losses(model(input_ids=ids).logits, ids, N)


def test_small_on_disk():
    size = sum(f.stat().st_size for f in MODEL.iterdir())
    assert size < 1_000_000, size
    assert (MODEL / "model.safetensors").exists() and (MODEL / "config.json").exists()


def test_loads_as_float32(model):
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert (model.config.n_layer, model.config.n_head, model.config.vocab_size) == (2, 4, VOCAB)


def test_loads_with_its_tokenizer():
    """As `probe analyze -m tests/data/induction-gpt2` loads it: token i is "ti", BOS first."""
    model, tokenizer = probe.load(str(MODEL))
    assert tokenizer("t5 t63 t5")["input_ids"] == [0, 5, 63, 5]
    assert tokenizer.convert_ids_to_tokens([0, 1]) == ["t0", "t1"]
    assert model.config.n_layer == 2


def test_second_copy_predicted(model):
    first, second = losses(model, repeated(64, N, VOCAB, seed=3))
    print(f"repeated: first copy {first:.3f}, second copy {second:.3f} (log 63 = 4.143)")
    assert first > 0.9 * torch.log(torch.tensor(VOCAB - 1.0)).item()
    assert second < 0.1 * first
    null_first, null_second = losses(model, fresh(64, N, VOCAB, seed=3))
    print(f"fresh: first copy {null_first:.3f}, second copy {null_second:.3f}")
    assert null_second > 0.9 * null_first  # nothing repeated, nothing to copy


def test_previous_token_head(patterns):
    scores = previous_token_scores(patterns)
    print("previous-token scores [layer, head]:", scores)
    assert scores[PREVIOUS_TOKEN] > 0.8
    assert divmod(int(scores.argmax()), scores.shape[1]) == PREVIOUS_TOKEN


def test_induction_head(patterns):
    scores = induction_scores(patterns, N)
    print("induction scores [layer, head]:", scores)
    assert scores[INDUCTION] > 0.5
    assert divmod(int(scores.argmax()), scores.shape[1]) == INDUCTION


@pytest.mark.slow
def test_ablating_the_induction_head_breaks_copying(model):
    ids = repeated(64, N, VOCAB, seed=5)
    first, second = losses(model, ids)
    with probe.ablate(model, [INDUCTION]):
        ablated_first, ablated_second = losses(model, ids)
    print(f"second copy {second:.3f}; with head {INDUCTION} zero-ablated {ablated_second:.3f}")
    assert ablated_first == pytest.approx(first, abs=0.1)  # little to copy in the first copy
    # The other three layer-1 heads also do induction (less), so the loss does not go back to
    # log 63 (it does with all four ablated), but it triples.
    assert ablated_second > 2 * second and ablated_second > second + 0.25
    with probe.ablate(model, [(1, h) for h in range(4)]):
        assert losses(model, ids)[1] > 0.9 * first
