"""The analyses that take rows give the same tables whether the pattern comes whole (the
mirror's eager attention) or in blocks of query rows beside the model's sdpa kernel
(``probe.runner.stream_rows``): on EWT dev sentences, for MiniLM, and for random Llama (GQA,
RoPE, causal) and Mistral (a sliding window of 4) models that read MiniLM's tokens."""

import pandas as pd
import pytest
import torch
import transformers as tf
from conftest import EWT, needs_ewt
from streams import context

import analyses
from analyses.roles import Roles
from analyses.taxonomy import Taxonomy
from probe.corpus import max_tokens
from probe.runner import stream, stream_rows
from probe.units import Source
from probe.units.repeats import RepeatedSequences
from probe.units.sentences import Sentences

SENTENCES = 40
BUDGET = 4 * 4 * 16 * 12 * 64 * 5  # blocks of about 5 rows: several per sentence


def decoder(kind: str, tokenizer):
    torch.manual_seed(0)
    small = {"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2,
             "intermediate_size": 64, "num_key_value_heads": 2,
             "vocab_size": len(tokenizer)}  # fmt: skip
    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**small)).eval()
    return tf.MistralForCausalLM(tf.MistralConfig(**small, sliding_window=4)).eval()


def tables(model, tokenizer, rows: bool) -> dict[str, pd.DataFrame]:
    base = model.base_model
    L, H = base.config.num_hidden_layers, base.config.num_attention_heads
    causal = model.config.model_type != "bert"
    made = context(L, H, causal=causal, model=model, tokenizer=tokenizer,
                   options={"repeat_length": 10})  # fmt: skip
    roles, taxonomy = Roles(made), Taxonomy(made)
    limit = max_tokens(model.config, tokenizer)
    source = Source((EWT / "en_ewt-ud-dev.conllu",), SENTENCES)
    units = [Sentences(source, tokenizer, limit),
             RepeatedSequences(source, tokenizer, limit,
                               options={"repeat_sequences": 8, "repeat_length": 10})]  # fmt: skip
    for unit, readers in zip(units, ([roles, taxonomy], [taxonomy]), strict=True):
        batches = [setattr(b, "unit", unit.name) or b for b in unit.batches(16)]
        if rows:
            stream_rows(base, batches, readers, BUDGET)
        else:
            stream(base, batches, readers)
    return roles.finish() | taxonomy.finish()


@needs_ewt()
@pytest.mark.parametrize("kind", ["minilm", "llama", "mistral"])
def test_row_blocks_give_the_whole_patterns_tables(kind, minilm):
    model, tokenizer = minilm
    if kind != "minilm":
        model = decoder(kind, tokenizer)
    whole, blocks = tables(model, tokenizer, False), tables(model, tokenizer, True)
    assert set(whole) == {"head_stats", "head_similarity", "taxonomy", "taxonomy_example"}
    for name in whole:
        pd.testing.assert_frame_equal(blocks[name], whole[name], check_exact=False,
                                      rtol=1e-5, atol=2e-6)  # fmt: skip
    assert whole["head_similarity"].js_divergence.gt(0).any()  # the sample is not empty
    assert whole["taxonomy"].sink_queries.iloc[0] > SENTENCES
    assert whole["taxonomy"].sequences.iloc[0] == 8  # and 8 nulls


def test_only_analyses_of_sums_take_rows():
    takes = {name for name in analyses.REGISTRY if analyses.get(name).rows}
    assert takes == {"roles", "taxonomy"}


def test_the_run_reads_rows_where_every_reader_takes_them(tmp_path, monkeypatch):
    """``probe analyze -a taxonomy`` on the trained GPT-2: the repeated sequences (read by the
    taxonomy alone) stream in row blocks beside sdpa; the sentences, whose head cards' examples
    need whole patterns, stream whole."""
    from induction import MODEL
    from typer.testing import CliRunner

    import probe.rows
    import probe.runner
    from probe.app.cli import app

    seen = []
    for name in ("stream", "stream_rows"):
        real = getattr(probe.runner, name)

        def spy(model, batches, consumers, *args, real=real, name=name):
            batches = list(batches)
            seen.append((name, batches[0].unit, model.config._attn_implementation))
            return real(model, batches, consumers, *args)

        monkeypatch.setattr(probe.runner, name, spy)
    implementations = []
    original = probe.rows.sdpa_attention_forward
    monkeypatch.setattr(probe.rows, "sdpa_attention_forward",
                        lambda *a, **k: implementations.append(1) or original(*a, **k))  # fmt: skip
    out = tmp_path / "r"
    args = ["analyze", "-m", str(MODEL), "-t", "sample", "-n", "8", "-a", "taxonomy",
            "--repeat-sequences", "6", "--repeat-length", "10", "-o", str(out), "-q",
            "--attention-budget", "2KiB"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert ("stream_rows", "repeats", "sdpa") in seen and ("stream", "sentence", "sdpa") in seen
    assert implementations  # the model's own sdpa computed the outputs
