"""Right by default: the numbers a user reads without asking for anything are the right ones, or
say what stood in for what was missing."""

import json

import numpy as np
import pandas as pd
import pytest
import torch
import transformers as tf
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from typer.testing import CliRunner

from probe.app.cli import app

# A vocabulary without "a", whose unknown token is also its BOS: tokenizing "a" gives the BOS
# twice, the first added, the second standing for the text.
WORDS = [
    *("the", "cat", "sat", "on", "mat", "dogs", "were", "barking"),
    *("at", "strangers", "she", "gave", "her", "brother", "book"),
]
BOS = "<s>"


def no_a_tokenizer() -> tf.PreTrainedTokenizerFast:
    vocab = {BOS: 0, "</s>": 1, ".": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=BOS))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, 0)]
    )
    return tf.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, unk_token=BOS, eos_token="</s>", pad_token="</s>"
    )


@pytest.fixture(scope="module")
def untied_llama(tmp_path_factory):
    """A small random Llama whose unembedding is its own (untied), saved as a checkpoint."""
    torch.manual_seed(0)
    tokenizer = no_a_tokenizer()
    config = tf.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )  # fmt: skip
    model = tf.LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("untied-llama")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model


def dense_copying(W_E, W_U, W_V, W_O) -> float:
    """Σ Re λ / Σ |λ| of the vocab x vocab circuit W_E W_V W_O W_U, formed and decomposed."""
    circuit = (W_E @ W_V @ W_O @ W_U).double()
    eigenvalues = torch.linalg.eigvals(circuit)
    return float(eigenvalues.real.sum() / eigenvalues.abs().sum())


def test_copying_uses_the_checkpoints_own_unembedding(untied_llama, tmp_path):
    folder, lm = untied_llama
    out = tmp_path / "report"
    args = ["analyze", "--model", str(folder), "-a", "taxonomy", "-t", "sample", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    table = pd.read_csv(out / "taxonomy.csv")
    assert set(table.unembedding) == {"output_embedding"}
    W_E, W_U = lm.model.embed_tokens.weight.detach(), lm.lm_head.weight.detach().T
    H, KV = lm.config.num_attention_heads, lm.config.num_key_value_heads
    d_head = lm.config.hidden_size // H
    for row in table.itertuples():
        attention = lm.model.layers[row.layer].self_attn
        kv = row.head // (H // KV)
        W_V = attention.v_proj.weight.detach()[kv * d_head : (kv + 1) * d_head].T
        W_O = attention.o_proj.weight.detach()[:, row.head * d_head : (row.head + 1) * d_head].T
        assert row.copying == pytest.approx(dense_copying(W_E, W_U, W_V, W_O), abs=1e-5)
    # W_Eᵀ would have given other numbers: the stand-in is not what was measured
    W_V = lm.model.layers[0].self_attn.v_proj.weight.detach()[:d_head].T
    W_O = lm.model.layers[0].self_attn.o_proj.weight.detach()[:, :d_head].T
    assert abs(dense_copying(W_E, W_E.T, W_V, W_O) - table.copying.iloc[0]) > 1e-3


@pytest.mark.slow
def test_a_checkpoint_without_unembedding_says_so_and_gives_no_copying_role(minilm, tmp_path):
    """MiniLM's checkpoint (a sentence encoder) has no masked-LM head: W_Eᵀ stands in, the
    summary and the page say so, and no head is a copying head, whatever its score."""
    out = tmp_path / "report"
    args = ["analyze", "--model", "minilm", "-a", "taxonomy", "-t", "sample", "--out", str(out),
            "--threshold", "copying=0"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "W_Eᵀ stood in for W_U" in " ".join(result.output.split())
    table = pd.read_csv(out / "taxonomy.csv")
    assert set(table.unembedding) == {"input_embedding_transposed"}
    assert (table.copying > 0).any()  # heads the threshold alone would call copying
    heads = pd.read_csv(out / "heads.csv")
    assert not heads.roles.fillna("").str.contains("copying").any()
    assert "No unembedding:" in (out / "index.html").read_text()


def test_special_tokens_come_from_the_tokenizers_own_account():
    from probe.inputs.units.repeats import specials
    from probe.inputs.windowing import special_tokens

    tokenizer = no_a_tokenizer()
    assert tokenizer("a")["input_ids"] == [0, 0]  # the BOS, then "a" unknown: the BOS again
    assert special_tokens(tokenizer) == ([0], [])
    assert specials(tokenizer) == ([0], [])


def test_windows_and_repeats_start_with_the_bos_and_sink_alpha_is_gu_et_als(untied_llama, tmp_path):
    """A corpus read by a tokenizer without "a": every window begins with the BOS, and sink α
    is Gu et al.'s: the mean over each window's first 64 queries of the attention to the BOS,
    computed here by the model's own eager attention."""
    from probe.inputs.texts import corpus_spec, windows
    from probe.inputs.units import Source
    from probe.inputs.units.repeats import RepeatedSequences

    folder, _ = untied_llama
    tokenizer = no_a_tokenizer()
    texts = ["the cat sat on the mat .", "a dog was barking at her .", "she gave a book ."]
    corpus = tmp_path / "notes.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts * 8))
    rows = list(windows(corpus_spec(str(corpus)), tokenizer, 64))
    assert rows and all(r["input_ids"][0] == 0 for r in rows)
    repeats = RepeatedSequences(Source(seed=0), tokenizer, 128, options={"repeat_length": 5})
    assert all(seq[0] == 0 for seq in repeats.pair(0))

    out = tmp_path / "report"
    args = ["analyze", "--model", str(folder), "-a", "taxonomy", "--corpus", str(corpus),
            "-t", "sample", "--out", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    alpha = pd.read_csv(out / "taxonomy.csv").sink_alpha.to_numpy()

    model = tf.AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    total, queries = torch.zeros(2, 4, dtype=torch.float64), 0
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["input_ids"]])
            attentions = model(ids, output_attentions=True).attentions
            for layer, pattern in enumerate(attentions):  # [1, head, q, k]
                total[layer] += pattern[0, :, :64, 0].double().sum(-1)
            queries += min(ids.shape[1], 64)
    np.testing.assert_allclose(alpha, (total / queries).flatten().numpy(), atol=1e-6)


@pytest.mark.parametrize("entry", ["head_statistics", "attention_rows", "trace", "head_types"])
def test_an_input_longer_than_the_models_positions_is_one_line(minilm, entry):
    import probe

    model, _ = minilm
    ids = torch.randint(1000, 2000, (1, 4000))
    with pytest.raises(probe.ProbeError) as caught:
        if entry == "head_statistics":
            probe.head_statistics(model, ids)
        elif entry == "attention_rows":
            probe.attention_rows(model, ids, layer=0, rows=slice(0, 8))
        elif entry == "trace":
            with probe.trace(model, "hook_pattern"):
                model(input_ids=ids)
        else:  # a first token, then 999 tokens twice
            first = ids[:, 1:1000]
            probe.head_types(model, torch.cat([ids[:, :1], first, first], 1), n=999)
    message = str(caught.value)
    length = 1999 if entry == "head_types" else 4000
    assert f"input is {length} tokens long" in message and "512 positions" in message
    assert "--context" in message and "\n" not in message


@pytest.mark.slow
def test_runs_that_differ_in_input_or_analyses_get_their_own_folders(minilm, tmp_path, monkeypatch):
    """Three runs and two figure formats, none given --out: each finds its own place."""
    monkeypatch.chdir(tmp_path)
    corpus = tmp_path / "notes.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"Note {i} says little."}) + "\n"
                              for i in range(30)))  # fmt: skip
    runs = [[], ["--corpus", str(corpus), "-a", "roles"], ["-a", "taxonomy"]]
    for extra in runs:
        result = CliRunner().invoke(app, ["analyze", "--model", "minilm", "-t", "sample", "-q",
                                          *extra])  # fmt: skip
        assert result.exit_code == 0, result.output
    reports = sorted(p.name for p in (tmp_path / "reports").iterdir())
    assert reports == ["minilm-sample", "minilm-sample-notes.jsonl-roles", "minilm-sample-taxonomy"]
    report = tmp_path / "reports" / "minilm-sample"
    for format in ("pdf", "svg"):
        result = CliRunner().invoke(app, ["figures", str(report), "--format", format])
        assert result.exit_code == 0, result.output
    files = sorted(p.suffix for p in (report / "figures").iterdir() if not p.name.startswith("."))
    assert set(files) == {".pdf", ".svg"} and files.count(".pdf") == files.count(".svg")
    again = CliRunner().invoke(app, ["figures", str(report), "--format", "svg"])
    assert again.exit_code == 1 and "already exists" in again.output
    # named default analyses are the default folder's
    from probe.app.plan import Settings

    named = Settings("minilm", treebank=["sample"], analyses=["syntax", "roles"])
    assert Settings("minilm", treebank=["sample"]).output.name == "minilm-sample"
    assert named.output.name == "minilm-sample-syntax+roles"


def test_run_json_records_the_window_used(minilm, tmp_path):
    out = tmp_path / "report"
    args = ["analyze", "--model", "minilm", "-t", "sample", "-a", "coref", "--coref-window",
            "1000000", "--out", str(out), "-q"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    run = json.loads((out / "run.json").read_text())
    assert run["options"]["coref_window"] == 512 and run["coref"]["window"] == 512


def test_a_units_option_names_the_analyses_that_read_it():
    result = CliRunner().invoke(app, ["analyze", "--model", "minilm", "--coref-window", "200",
                                      "-a", "syntax"])  # fmt: skip
    assert result.exit_code == 1
    message = " ".join(result.output.split())
    assert "--coref-window says how to read the coreference windows" in message
    assert "add coref to --analyses" in message and "window to --analyses" not in message
