"""probe.attention_rows and probe.head_statistics against the whole patterns of probe.trace."""

import pytest
import torch
from models import padded_batch, small_model
from references import expected_statistics, whole

import probe


@pytest.mark.parametrize("kind", ["llama", "mistral", "bert"])
def test_rows_of_one_layer(kind):
    model = small_model(kind)
    ids = torch.randint(3, 99, (1, 30), generator=torch.Generator().manual_seed(2))
    reference = whole(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    for layer, rows in ((0, slice(0, 1)), (1, slice(11, 30)), (1, slice(25, None))):
        got = probe.attention_rows(model, ids[0], layer, rows)
        torch.testing.assert_close(got, reference[layer][:, :, rows], atol=2e-7, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "mistral", "gpt2"])
def test_head_statistics_equal_the_whole_patterns(kind):
    inputs = padded_batch(kind)
    model = small_model(kind)
    reference = expected_statistics(whole(model, inputs), inputs["attention_mask"].bool())
    for budget in ("1GiB", "900B"):  # one block per layer; blocks of one or two rows
        table = probe.head_statistics(model, inputs["input_ids"], inputs["attention_mask"],
                                      budget=budget)  # fmt: skip
        assert table[["layer", "head"]].values.tolist() == [[0, h] for h in range(4)] + [
            [1, h] for h in range(4)]  # fmt: skip
        got = torch.tensor(table[list(probe.patterns.long_context.STATISTICS)].to_numpy())
        torch.testing.assert_close(got.float(), reference.flatten(0, 1), atol=2e-6, rtol=1e-5)
        assert (table.queries == 15).all()


def test_bad_rows_are_one_line():
    model = small_model("llama")
    with pytest.raises(probe.ProbeError, match="a layer in 0…1 and a slice of rows"):
        probe.attention_rows(model, torch.arange(3, 13), 2, slice(0, 4))
    with pytest.raises(probe.ProbeError, match="step 1"):
        probe.attention_rows(model, torch.arange(3, 13), 0, slice(0, 4, 2))
