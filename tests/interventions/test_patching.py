"""Batched patching: many heads to a forward pass, over a batch of pairs, equals patching one head
of one pair at a time with a plain hook, and its intervals are the t-intervals worked here."""

import math

import pytest
import torch
from induction import BOS, MODEL, fresh, repeated
from models import padded_batch, small_model

import probe

N = 6


@pytest.fixture(scope="module")
def model():
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(MODEL, dtype=torch.float32).eval()


def repeats_metric(ids: torch.Tensor, n: int):
    """Per pair: mean log-probability of the clean second copy's predictable tokens (of the
    ``pairs`` its logits hold, where probe runs them a chunk at a time)."""

    def metric(logits, pairs=slice(None)):
        logp = torch.log_softmax(logits.float(), dim=-1)
        rows = ids[pairs]
        picked = logp[:, n + 1 : 2 * n].gather(-1, rows[:, n + 2 : 2 * n + 1, None])[..., 0]
        return picked.mean(-1)

    return metric


def pairs(batch: int, n: int = N, seed: int = 0):
    clean = repeated(batch, n, seed=seed)
    corrupted = fresh(batch, n, seed=seed + 100)
    corrupted = torch.cat([corrupted[:, :1], corrupted[:, 1 + n :], clean[:, 1 + n :]], dim=1)
    assert (corrupted[:, 0] == BOS).all()
    return {"input_ids": clean}, {"input_ids": corrupted}


def one_at_a_time(model, clean, corrupted, metric_of, name, head, where):
    """Every pair alone, the head's slice copied in by a hook written here."""
    values = []
    for i in range(clean["input_ids"].shape[0]):
        one_clean = {k: v[i : i + 1] for k, v in clean.items()}
        one_corrupted = {k: v[i : i + 1] for k, v in corrupted.items()}
        with torch.no_grad(), probe.trace(model, name) as cache:
            model(**one_clean)
        source = cache[name]

        def put(x, hook, source=source):
            x = x.clone()
            x[where(head)] = source[where(head)]
            return x

        with torch.no_grad(), probe.hooks(model, {name: put}):
            out = model(**one_corrupted)
        values.append(float(metric_of(one_clean["input_ids"])(out.logits)))
    return values


@pytest.mark.parametrize("hook", ["hook_z", "hook_pattern", "hook_v"])
@pytest.mark.slow
def test_batched_equals_one_head_at_a_time(model, hook):
    clean, corrupted = pairs(5)
    ids = clean["input_ids"]
    table = probe.patch(model, clean, corrupted, repeats_metric(ids, N), hook=hook, max_rows=12)
    assert len(table) == 8 and table.attrs["pairs"] == 5
    head_dim = 1 if hook == "hook_pattern" else 2

    def where(head):
        index = [slice(None)] * 4
        index[head_dim] = head
        return tuple(index)

    def metric_of(one_ids):
        return repeats_metric(one_ids, N)

    with torch.no_grad():
        base = [
            float(metric_of(ids[i : i + 1])(model(input_ids=one).logits))
            for i, one in enumerate(corrupted["input_ids"].split(1))
        ]
    for row in table.itertuples():
        name = f"blocks.{row.layer}.attn.{hook}"
        values = one_at_a_time(model, clean, corrupted, metric_of, name, row.head, where)
        effects = torch.tensor(values, dtype=torch.float64) - torch.tensor(
            base, dtype=torch.float64
        )
        assert row.metric == pytest.approx(sum(values) / 5, abs=1e-5)
        assert row.effect == pytest.approx(float(effects.mean()), abs=1e-5)
        # t(0.975) with 4 degrees of freedom
        half = 2.7764451051977987 * float(effects.std()) / math.sqrt(5)
        assert row.effect_low == pytest.approx(float(effects.mean()) - half, abs=1e-5)
        assert row.effect_high == pytest.approx(float(effects.mean()) + half, abs=1e-5)
    assert table.attrs["corrupted"] == pytest.approx(sum(base) / 5, abs=1e-5)


@pytest.mark.slow
def test_stacking_does_not_change_the_numbers(model):
    """One copy a pass, or all of them in one: the same table to float error."""
    clean, corrupted = pairs(3, seed=4)
    metric = repeats_metric(clean["input_ids"], N)
    wide = probe.patch(model, clean, corrupted, metric, per_position=True, max_rows=10_000)
    narrow = probe.patch(model, clean, corrupted, metric, per_position=True, max_rows=1)
    assert len(wide) == 8 * (1 + 2 * N)
    for column in ("metric", "effect", "effect_low", "effect_high"):
        torch.testing.assert_close(
            torch.tensor(wide[column].values), torch.tensor(narrow[column].values),
            atol=1e-5, rtol=0,
        )  # fmt: skip
    # The induction heads' effect is at the second copy's positions, not before it.
    early = wide[(wide.layer == 1) & (wide.position <= N)]
    assert early.effect.abs().max() < 1e-5


def test_chosen_heads_and_padded_pairs():
    """Only the chosen heads are patched; padding is allowed when both sides have the same."""
    model = small_model("gpt2")
    batch = padded_batch("gpt2")
    corrupted = dict(batch, input_ids=batch["input_ids"].flip(1))
    w = torch.randn(model.config.hidden_size)

    def metric(out):
        return out.last_hidden_state[:, 0] @ w

    table = probe.patch(model, batch, corrupted, metric, heads=[(1, 2), (0, 1)])
    assert table[["layer", "head"]].values.tolist() == [[0, 1], [1, 2]]
    whole = probe.patch(model, batch, corrupted, metric).set_index(["layer", "head"])
    for row in table.itertuples():
        assert row.effect == pytest.approx(whole.effect[(row.layer, row.head)], abs=1e-6)
    other = dict(corrupted, attention_mask=torch.ones_like(batch["attention_mask"]))
    with pytest.raises(probe.ProbeError, match="pad each pair alike"):
        probe.patch(model, batch, other, metric)
    with pytest.raises(probe.ProbeError, match="one value per pair"):
        probe.patch(model, batch, corrupted, lambda out: out.last_hidden_state.sum(-1))
