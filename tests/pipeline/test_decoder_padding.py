"""An encoder-decoder model's decoder reads each sentence shifted right after its start token
(``probe.pipeline.runner.decoder_inputs``): its real positions are as many as the sentence's tokens,
whether the sentence is the longest of its batch or padded, so the decoder's statistics do not
depend on the batch size."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from models import SEQ2SEQ
from typer.testing import CliRunner

from probe.app.cli import app
from probe.pipeline.runner import decoder_inputs


def test_decoder_inputs_are_the_sentence_shifted_right_whatever_the_padding():
    config = SEQ2SEQ["bart"]()
    model = type("Model", (), {"config": config})()
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    got = decoder_inputs(model, {"input_ids": ids, "attention_mask": mask})
    start = config.decoder_start_token_id
    assert got["decoder_input_ids"][:, :3].tolist() == [[start, 5, 6], [start, 9, 10]]
    assert got["decoder_attention_mask"].tolist() == mask.tolist()  # one position per token
    alone = decoder_inputs(model, {"input_ids": ids[1:, :2], "attention_mask": mask[1:, :2]})
    assert alone["decoder_input_ids"].tolist() == [[start, 9]]


@pytest.mark.parametrize("kind", ["bart", "t5"])
@pytest.mark.slow
def test_decoder_tables_do_not_depend_on_the_batch_size(tmp_path, kind):
    """Cross-attention and the decoder's sink α, over sentences of many lengths, in batches of
    1 (no padding) and of 16 (padding in almost every row)."""
    import transformers as tf
    from tokenizers_util import wordpiece

    folder = tmp_path / kind
    config = SEQ2SEQ[kind]()
    config.vocab_size = 128  # the test tokenizer's
    torch.manual_seed(0)
    tf.AutoModel.from_config(config).save_pretrained(folder)
    wordpiece().save_pretrained(folder)
    tables = {}
    for size in (1, 16):
        out = tmp_path / f"b{size}"
        args = ["analyze", "-m", str(folder), "-n", "40", "-a", "cross,taxonomy", "-q",
                "-b", str(size), "--repeat-sequences", "4", "--repeat-length", "5",
                "--out", str(out)]  # fmt: skip
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        tables[size] = [pd.read_csv(out / f"{t}.csv") for t in ("cross_attention", "taxonomy")]
    for one, many in zip(tables[1], tables[16], strict=True):
        pd.testing.assert_frame_equal(one, many, rtol=1e-5, atol=1e-6)
