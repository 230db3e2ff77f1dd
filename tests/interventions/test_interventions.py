"""Interventions: head ablation (zero and mean, checked heads) and activation patching, against
computations made here without probe's hooks."""

import pytest
import torch
from models import padded_batch, small_model

import probe
from probe.capture.architectures import architecture, blocks, head_dim

D, H = 16, 4


def test_head_means_are_over_real_tokens_only():
    """By hand: each head's z summed over the positions the mask marks real, over the count."""
    model = small_model("bert")
    batch = padded_batch("bert")
    with torch.no_grad(), probe.trace(model, "hook_z") as cache:
        model(**batch)
    means = probe.head_means(model, [batch])
    real = batch["attention_mask"].bool()
    for layer in range(2):
        z = cache[f"blocks.{layer}.attn.hook_z"]  # [batch, pos, head, d_head]
        torch.testing.assert_close(means[layer], z[real].mean(0))
        assert not torch.allclose(means[layer], z.mean((0, 1)), atol=1e-4)  # padding would count


@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama"])
def test_head_means_of_some_layers_stop_after_the_highest(kind):
    """The means of the layers asked for are those of every layer's run, and no block above the
    highest runs; a layer the model lacks is one line."""
    model = small_model(kind)
    batch = padded_batch(kind)
    every = probe.head_means(model, [batch])
    ran = []
    handles = [block.register_forward_pre_hook(lambda _m, _a, k=k: ran.append(k))
               for k, block in enumerate(blocks(model))]  # fmt: skip
    try:
        some = probe.head_means(model, [batch, batch], layers=[0])
    finally:
        for handle in handles:
            handle.remove()
    assert list(some) == [0] and ran == [0, 0]  # each batch stopped after block 0
    torch.testing.assert_close(some[0], every[0], atol=1e-6, rtol=1e-5)
    assert probe.head_means(model, [batch], layers=[1]).keys() == {1}
    for bad in ([2], [-1], []):
        with pytest.raises(probe.ProbeError, match="layers are 0-based"):
            probe.head_means(model, [batch], layers=bad)


def test_mean_ablation_does_not_depend_on_batching():
    """Means from one padded batch equal those from each sentence alone, and a mean-ablated
    sentence gives the same output alone as in a padded batch."""
    model = small_model("bert")
    batch = padded_batch("bert")
    alone = [
        {k: v[i : i + 1, : int(batch["attention_mask"][i].sum())] for k, v in batch.items()}
        for i in range(3)
    ]
    together, separately = probe.head_means(model, [batch]), probe.head_means(model, alone)
    for layer in together:
        torch.testing.assert_close(together[layer], separately[layer], atol=1e-6, rtol=0)
    heads = [(0, 1), (1, 3)]
    with torch.no_grad(), probe.ablate(model, heads, mode="mean", means=together):
        padded = model(**batch).last_hidden_state
        single = model(**alone[2]).last_hidden_state
        with probe.trace(model, "blocks.1.attn.hook_z") as cache:
            model(**batch)
    torch.testing.assert_close(padded[2, :3], single[0], atol=1e-5, rtol=0)
    ablated = cache["blocks.1.attn.hook_z"][:, :, 3]
    torch.testing.assert_close(ablated, together[1][3].expand_as(ablated))


def head_input_hook(model, layer: int, head: int):
    """A plain PyTorch pre-hook on the output projection that zeroes one head's slice of its
    input: the ablation computed without probe (and with the model's own attention)."""
    o = blocks(model)[layer].get_submodule(architecture(model).o)
    d = head_dim(model)

    def zero(_module, args):
        x = args[0].clone()
        x[..., head * d : (head + 1) * d] = 0
        return (x, *args[1:])

    return o.register_forward_pre_hook(zero)


@pytest.mark.parametrize(
    "kind",
    [
        "bert",
        "distilbert",
        "gpt2",
        "gpt_neox",
        "llama",
        "qwen3",
        "gemma2",
        "gemma3_text",
        "phi3",
        "modernbert",
    ],
)
def test_zero_ablation_equals_a_plain_forward_hook(kind):
    model = small_model(kind)
    batch = padded_batch(kind)
    with torch.no_grad():
        with probe.ablate(model, [(1, 2)]):
            ours = model(**batch).last_hidden_state
        handle = head_input_hook(model, 1, 2)
        try:
            theirs = model(**batch).last_hidden_state
        finally:
            handle.remove()
        plain = model(**batch).last_hidden_state
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-5, rtol=0)
    assert not torch.allclose(ours[real], plain[real], atol=1e-4)


@pytest.mark.parametrize(
    ("heads", "message"),
    [
        ([(-1, 0)], r"no head \(-1, 0\)"),
        ([(2, 0)], r"layers 0…1 and heads 0…3"),
        ([(0, 4)], r"no head \(0, 4\)"),
        ([(0,)], "pairs of integers"),
        (["ab"], "pairs of integers"),
        ([(0.5, 1)], "pairs of integers"),
    ],
)
def test_heads_are_checked(heads, message):
    model = small_model("bert")
    with pytest.raises(probe.ProbeError, match=message), probe.ablate(model, heads):
        pass


def test_modes_and_means_are_checked():
    model = small_model("bert")
    with (
        pytest.raises(probe.ProbeError, match="'zero' or 'mean'"),
        probe.ablate(model, [(0, 1)], "max"),
    ):
        pass
    with pytest.raises(probe.ProbeError, match="head_means"), probe.ablate(model, [(0, 1)], "mean"):
        pass


def test_ablation_of_a_multihead_attention():
    """probe's own module: zero ablation removes the head's term; mean ablation uses means
    over the keys the padding mask keeps."""
    torch.manual_seed(0)
    mha = probe.MultiHeadAttention(D, H).eval()
    x = torch.randn(2, 5, D)
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    with torch.no_grad():
        with probe.trace(mha, ["hook_result", "hook_z"]) as cache:
            full = mha(x, key_padding_mask=padding)
        with probe.ablate(mha, [(0, 1)]):
            zeroed = mha(x, key_padding_mask=padding)
        means = probe.head_means(mha, [{"query": x, "key_padding_mask": padding}])
        with probe.ablate(mha, [(0, 1)], mode="mean", means=means):
            meaned = mha(x, key_padding_mask=padding)
    torch.testing.assert_close(zeroed, full - cache["hook_result"][:, :, 1], atol=1e-5, rtol=0)
    torch.testing.assert_close(means[0], cache["hook_z"][~padding].mean(0))
    swapped = (means[0][1] - cache["hook_z"][:, :, 1]) @ mha.W_O[1].detach()
    torch.testing.assert_close(meaned, full + swapped, atol=1e-5, rtol=0)
    with pytest.raises(probe.ProbeError, match=r"no head \(1, 0\)"), probe.ablate(mha, [(1, 0)]):
        pass


def test_patching_where_the_answer_is_known():
    """One attention layer: the output is Σ_i z_i W_i^O + b, linear in each head's z. So patching
    head i from clean into corrupted moves the metric by exactly (z_i - z'_i) W_i^O · w; the
    heads' recoveries sum to 1; and per position, only the position the metric reads moves."""
    torch.manual_seed(0)
    mha = probe.MultiHeadAttention(D, H).eval()
    clean, corrupted = {"query": torch.randn(1, 6, D)}, {"query": torch.randn(1, 6, D)}
    w = torch.randn(D)
    metric = lambda out: out[0, -1] @ w  # noqa: E731
    with torch.no_grad(), probe.trace(mha, "hook_z") as a:
        mha(**clean)
    with torch.no_grad(), probe.trace(mha, "hook_z") as b:
        mha(**corrupted)
    table = probe.patch(mha, clean, corrupted, metric)
    assert list(table.columns) == [
        "layer", "head", "metric", "recovered", "effect", "effect_low", "effect_high"
    ]  # fmt: skip
    W_O = mha.W_O.detach()
    expected = [
        float(metric(mha(**corrupted).detach()))
        + float((a["hook_z"][0, -1, i] - b["hook_z"][0, -1, i]) @ W_O[i] @ w)
        for i in range(H)
    ]
    torch.testing.assert_close(
        torch.tensor(table.metric.tolist()), torch.tensor(expected), atol=1e-4, rtol=0
    )
    assert abs(table.recovered.sum() - 1) < 1e-4
    assert table.attrs["clean"] == pytest.approx(float(metric(mha(**clean).detach())), abs=1e-5)

    by_position = probe.patch(mha, clean, corrupted, metric, per_position=True)
    assert len(by_position) == H * 6
    last = by_position[by_position.position == 5].set_index("head").metric
    torch.testing.assert_close(
        torch.tensor(last.tolist()), torch.tensor(expected), atol=1e-4, rtol=0
    )
    others = by_position[by_position.position < 5]
    assert (others.recovered.abs() < 1e-5).all()


def test_patching_a_hugging_face_model():
    """Patching every head's pattern of a GPT-2 model (the query's position): each row is one
    forward pass, and a mismatched length is a clear error."""
    model = small_model("gpt2")
    clean = {"input_ids": torch.tensor([[5, 6, 7, 8]])}
    corrupted = {"input_ids": torch.tensor([[9, 10, 11, 8]])}
    w = torch.randn(model.config.hidden_size)  # not the sum: LayerNorm keeps that near-fixed
    metric = lambda out: out.last_hidden_state[0, -1] @ w  # noqa: E731
    table = probe.patch(model, clean, corrupted, metric, hook="hook_pattern", per_position=True)
    assert len(table) == 2 * 4 * 4 and table.position.max() == 3
    # Position 0 only sees itself, where both inputs' patterns are 1: patching it changes nothing.
    assert (table[table.position == 0].recovered.abs() < 1e-4).all()
    assert abs(table.attrs["clean"] - table.attrs["corrupted"]) > 1e-3
    assert (table[table.position == 3].recovered.abs() > 1e-3).any()
    with pytest.raises(probe.ProbeError, match="same length"):
        probe.patch(model, clean, {"input_ids": torch.tensor([[9, 6, 7]])}, metric)
    with pytest.raises(probe.ProbeError, match="cannot patch"):
        probe.patch(model, clean, corrupted, metric, hook="hook_resid_pre")
