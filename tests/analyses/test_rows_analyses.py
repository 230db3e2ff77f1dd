"""The analyses that take rows give the same tables whether the pattern comes whole (the
mirror's eager attention) or in blocks of query rows beside the model's sdpa kernel
(``probe.pipeline.runner.stream_rows``): on EWT dev sentences, for MiniLM, and for random Llama
(GQA,
RoPE, causal) and Mistral (a sliding window of 4) models that read MiniLM's tokens."""

import json

import numpy as np
import pandas as pd
import pytest
import torch
import transformers as tf
from streams import context
from treebanks import EWT, needs_ewt

import analyses
from analyses.roles import Roles
from analyses.taxonomy import Taxonomy
from probe.inputs.corpus import max_tokens
from probe.inputs.texts import corpus_spec
from probe.inputs.units import Source
from probe.inputs.units.repeats import RepeatedSequences
from probe.inputs.units.sentences import Sentences
from probe.inputs.units.texts import Texts
from probe.pipeline.runner import stream, stream_rows

pytestmark = pytest.mark.slow  # runs real models or the whole command line

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


@needs_ewt()
@pytest.mark.parametrize(("kind", "rows"), [("minilm", False), ("llama", True)])
def test_roles_sums_a_batchs_layers_at_once_or_one_by_one_alike(kind, rows, minilm, monkeypatch):
    """Roles keeps a batch's per-query values of every layer and sums them at its last layer,
    unless they would take more than STACKED_BYTES (a long input): the same tables, number for
    number, either way."""
    import analyses.roles

    model, tokenizer = minilm
    if kind != "minilm":
        model = decoder(kind, tokenizer)
    at_once = tables(model, tokenizer, rows)
    monkeypatch.setattr(analyses.roles, "STACKED_BYTES", 0)
    one_by_one = tables(model, tokenizer, rows)
    for name in ("head_stats", "head_similarity", "taxonomy"):
        pd.testing.assert_frame_equal(at_once[name], one_by_one[name], check_exact=True)


def test_only_analyses_of_sums_take_rows():
    takes = {name for name in analyses.REGISTRY if analyses.get(name).rows}
    assert takes == {"roles", "taxonomy"}


def test_the_run_reads_rows_where_every_reader_takes_them(tmp_path, monkeypatch):
    """``probe analyze -a taxonomy`` on the trained GPT-2: the repeated sequences (read by the
    taxonomy alone) stream in row blocks beside sdpa; the sentences, whose head cards' examples
    need whole patterns, stream whole."""
    from induction import MODEL, symbols_treebank
    from typer.testing import CliRunner

    import probe.capture.rows
    import probe.pipeline.runner
    from probe.app.cli import app

    seen = []
    for name in ("stream", "stream_rows"):
        real = getattr(probe.pipeline.runner, name)

        def spy(model, batches, consumers, *args, real=real, name=name):
            batches = list(batches)
            seen.append((name, batches[0].unit, model.config._attn_implementation))
            return real(model, batches, consumers, *args)

        monkeypatch.setattr(probe.pipeline.runner, name, spy)
    implementations = []
    original = probe.capture.rows.sdpa_attention_forward
    monkeypatch.setattr(probe.capture.rows, "sdpa_attention_forward",
                        lambda *a, **k: implementations.append(1) or original(*a, **k))  # fmt: skip
    out = tmp_path / "r"
    treebank = symbols_treebank(tmp_path / "symbols.conllu")  # English: unknown tokens
    args = ["analyze", "-m", str(MODEL), "-t", str(treebank), "-n", "8", "-a", "taxonomy",
            "--repeat-sequences", "6", "--repeat-length", "10", "-o", str(out), "-q",
            "--attention-budget", "2KiB"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert ("stream_rows", "repeats", "sdpa") in seen and ("stream", "sentence", "sdpa") in seen
    # Every layer's output was mixed from its blocks (p·V): sdpa never computed the scores again.
    assert not implementations


def corpus(folder, texts: int = 12, symbols: bool = False) -> str:
    """A plain-text corpus of ``texts`` lines of random words and punctuation, most of them
    longer than a window; with ``symbols``, each word the induction model's symbol for it (its
    vocabulary reads no English)."""
    rng = np.random.default_rng(3)
    words = ["the", "cat", "sat", "on", "a", "mat", "dogs", "bark", "at", "night", "she",
             "said", "it", "rains", ",", ".", "!", "(", ")", "and", "then", "quietly"]  # fmt: skip
    if symbols:
        from induction import symbol

        words = [w if w in ",.!()" else symbol(w) for w in words]
    lines = [" ".join(rng.choice(words, rng.integers(3, 60))) for _ in range(texts)]
    path = folder / "corpus.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def corpus_tables(model, tokenizer, path: str, rows: bool) -> dict[str, pd.DataFrame]:
    """roles and taxonomy (sink α) on the corpus's windows of 24 tokens, 5 to a batch."""
    base = model.base_model
    made = context(base.config.num_hidden_layers, base.config.num_attention_heads,
                   causal=model.config.model_type != "bert", model=model,
                   tokenizer=tokenizer)  # fmt: skip
    readers = [Roles(made, js_query_share=0.25), Taxonomy(made)]
    unit = Texts(Source(corpus=corpus_spec(path), context=24), tokenizer, 512)
    batches = list(unit.batches(20))
    assert unit.windows > unit.texts > 8 and len(batches) > 1  # texts cut, windows padded
    if rows:
        stream_rows(base, batches, readers, BUDGET)
    else:
        stream(base, batches, readers)
    return readers[0].finish() | readers[1].finish()


@pytest.mark.parametrize("kind", ["minilm", "llama", "mistral"])
def test_row_blocks_give_the_whole_patterns_tables_on_a_corpus(kind, minilm, tmp_path):
    """Every analysis that reads a corpus and takes rows (roles, taxonomy's sink α) gives the
    same tables on a corpus's windows, cut from longer texts and padded in batches."""
    model, tokenizer = minilm
    if kind != "minilm":
        model = decoder(kind, tokenizer)
    path = corpus(tmp_path)
    whole = corpus_tables(model, tokenizer, path, False)
    blocks = corpus_tables(model, tokenizer, path, True)
    for name in whole:
        pd.testing.assert_frame_equal(blocks[name], whole[name], check_exact=False,
                                      rtol=1e-5, atol=2e-6)  # fmt: skip
    assert whole["head_similarity"].js_divergence.gt(0).any()
    assert whole["taxonomy"].sink_queries.iloc[0] > 20
    assert whole["taxonomy"].sink_alpha.notna().all()


def test_a_corpus_streams_in_rows(tmp_path, monkeypatch):
    """``probe analyze -a roles,taxonomy,importance --corpus`` on the trained GPT-2: the
    corpus's windows, which show no example sentences and are read by analyses that take rows
    or read no captures (importance keeps the windows' tokens), stream in row blocks beside
    sdpa, as the repeats do; no pattern is captured whole."""
    from induction import MODEL
    from typer.testing import CliRunner

    import probe.pipeline.runner
    from probe.app.cli import app

    seen = []
    for name in ("stream", "stream_rows"):
        real = getattr(probe.pipeline.runner, name)

        def spy(model, batches, consumers, *args, real=real, name=name):
            batches = list(batches)
            seen.append((name, batches[0].unit, model.config._attn_implementation))
            return real(model, batches, consumers, *args)

        monkeypatch.setattr(probe.pipeline.runner, name, spy)
    out = tmp_path / "r"
    args = ["analyze", "-m", str(MODEL), "-a", "roles,taxonomy,importance", "--corpus",
            corpus(tmp_path, symbols=True), "--context", "24", "--importance-sentences", "4",
            "--repeat-sequences", "6", "--repeat-length", "10", "-o", str(out), "-q",
            "--attention-budget", "2KiB"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert sorted(seen) == [("stream_rows", "repeats", "sdpa"), ("stream_rows", "text", "sdpa")]
    run = json.loads((out / "run.json").read_text())
    # qk follows the taxonomy: it splits the scores on sequences of its own, streaming no unit
    assert run["reads"] == {"roles": ["text"], "taxonomy": ["repeats", "text"],
                            "importance": ["text"], "qk": []}  # fmt: skip
    assert run["inputs"]["text"]["windows"] > 12
