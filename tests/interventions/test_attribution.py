"""Attribution against exact patching: equal where the model is linear in the patched quantity,
and ranked alike on the induction model."""

import pytest
import torch
from induction import MODEL
from test_patching import pairs, repeats_metric

import probe

D, H = 16, 4


@pytest.fixture(scope="module")
def model():
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(MODEL, dtype=torch.float32).eval()


@pytest.mark.parametrize("per_position", [False, True])
def test_exact_where_the_model_is_linear(per_position):
    """One attention layer and a linear read-out: the output is linear in each head's z and v,
    so AtP equals patching; it is linear in the pattern, so AtP*, which computes the pattern of
    a patched query or key exactly, equals patching too, where plain AtP does not."""
    torch.manual_seed(0)
    mha = probe.MultiHeadAttention(D, H).eval()
    clean, corrupted = {"query": torch.randn(3, 6, D)}, {"query": torch.randn(3, 6, D)}
    w = torch.randn(D)

    def metric(out):
        return out[:, -1] @ w

    def gap(method, hook):
        exact = probe.patch(mha, clean, corrupted, metric, hook=hook, per_position=per_position)
        estimate = probe.attribute(
            mha, clean, corrupted, metric, method, hook=hook, per_position=per_position
        )
        assert len(estimate) == len(exact)
        return float((estimate.attribution - exact.effect).abs().max())

    assert gap("atp", "hook_z") < 1e-5
    assert gap("ig", "hook_z") < 1e-5
    assert gap("atp", "hook_v") < 1e-5
    for hook in ("hook_q", "hook_k"):
        assert gap("atp*", hook) < 1e-5
        assert gap("atp", hook) > 1e-2  # the softmax's curvature, which atp* removes


def test_atp_star_before_a_rotation_points_to_the_rotated_point():
    """A rotary model's scores are made of the rotated queries and keys: atp* at ``hook_q`` or
    ``hook_k`` is refused in one line naming ``hook_rot_q`` (``hook_rot_k``), where it works."""
    from models import small_model

    model = small_model("llama")
    clean, corrupted = torch.randint(3, 99, (3, 6)), torch.randint(3, 99, (3, 6))

    def metric(out):
        return out.last_hidden_state[:, -1, 0]

    for hook in ("hook_q", "hook_k"):
        rotated = hook.replace("hook_", "hook_rot_")
        with pytest.raises(probe.ProbeError, match=rf"use hook='{rotated}' \(after the rotat"):
            probe.attribute(model, clean, corrupted, metric, "atp*", hook=hook)
        fixed = probe.attribute(model, clean, corrupted, metric, "atp*", hook=rotated)
        assert fixed.attribution.notna().all()


def test_ranking_against_patching(model):
    """The repeats task on the induction model: every head's attribution beside its exact
    patching effect, and the Spearman correlation of the two."""
    clean, corrupted = pairs(16, n=10)
    metric = repeats_metric(clean["input_ids"], 10)
    exact = probe.patch(model, clean, corrupted, metric)
    side = exact[["layer", "head", "effect"]].copy()
    for method in ("atp", "atp*", "ig"):
        side[method] = probe.attribute(model, clean, corrupted, metric, method).attribution.values
    print(side.round(3).to_string())
    rho = side.drop(columns=["layer", "head"]).corr(method="spearman").effect
    print("Spearman with exact patching:", rho.round(3).to_dict())
    assert rho["atp"] > 0.6
    # The induction heads (layer 1) act on the metric nearly directly: integrated gradients come
    # within a quarter of patching's effect. The previous-token head (0, 0) patched alone points
    # the induction heads at the corrupted first copy, so they copy the wrong tokens: its exact
    # effect is negative, which no first-order estimate sees.
    layer1 = side[side.layer == 1]
    assert ((layer1.ig - layer1.effect).abs() < 0.25 * layer1.effect.abs()).all()
    assert side.effect[0] < 0 < side.atp[0]

    # Queries: the softmax fix brings AtP* closer to patching than AtP.
    for hook in ("hook_q", "hook_k"):
        exact = probe.patch(model, clean, corrupted, metric, hook=hook).effect
        plain = probe.attribute(model, clean, corrupted, metric, "atp", hook=hook).attribution
        fixed = probe.attribute(model, clean, corrupted, metric, "atp*", hook=hook).attribution
        print(hook, "atp error", (plain - exact).abs().max(), "atp*", (fixed - exact).abs().max())
        assert (fixed - exact).abs().max() < (plain - exact).abs().max()
        assert fixed.corr(exact, method="spearman") > 0.4


def test_leaves_the_model_alone(model):
    clean, corrupted = pairs(2, n=4)
    probe.attribute(model, clean, corrupted, repeats_metric(clean["input_ids"], 4))
    assert all(p.grad is None for p in model.parameters())


def test_bad_input_is_one_clear_line(model):
    clean, corrupted = pairs(2, n=4)
    metric = repeats_metric(clean["input_ids"], 4)
    with pytest.raises(probe.ProbeError, match="not differentiable"):
        probe.attribute(model, clean, corrupted, lambda logits: logits[:, -1].argmax(-1).float())
    with pytest.raises(probe.ProbeError, match="not differentiable"):
        probe.attribute(model, clean, corrupted, lambda logits: float(logits[0, -1, 0]))
    with pytest.raises(probe.ProbeError, match="same length"):
        probe.attribute(model, clean, {"input_ids": corrupted["input_ids"][:, :-1]}, metric)
    with pytest.raises(probe.ProbeError, match="method must be one of"):
        probe.attribute(model, clean, corrupted, metric, "eap")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "hook", "per_position"),
    [("atp", "hook_z", False), ("ig", "hook_result", True), ("atp*", "hook_k", True)],
)
def test_estimates_do_not_depend_on_the_budget(model, method, hook, per_position):
    """Two pairs at a time (the smallest budget, named by the error for a smaller one) give
    what every pair at once gives, to rounding (atp*'s score scale is fitted over the pairs of
    a chunk), to float32 rounding: runs of fewer pairs round differently."""
    import re

    clean, corrupted = pairs(3, n=4)
    metric = repeats_metric(clean["input_ids"], 4)

    def estimate(max_bytes):
        return probe.attribute(model, clean, corrupted, metric, method, hook=hook,
                               per_position=per_position, steps=2, max_bytes=max_bytes)  # fmt: skip

    with pytest.raises(probe.ProbeError, match=r"too small for two pairs.* at least") as e:
        estimate(1)
    smallest = int(re.search(r"max_bytes=([\d,]+) \(", str(e.value)).group(1).replace(",", ""))
    one, whole = estimate(smallest), estimate(1 << 32)
    scale = float(whole.attribution.abs().max())
    for column in ("attribution", "attribution_low", "attribution_high"):
        torch.testing.assert_close(
            torch.tensor(one[column].values),
            torch.tensor(whole[column].values),
            rtol=1e-5,
            atol=1e-6 * scale,
        )
