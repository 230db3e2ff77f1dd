"""Bad input, from a careful user or a hostile one: one line saying what is wrong and what to
do, never a traceback, never a wrong answer."""

import json
import shutil
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from commands import fails_in_one_line
from typer.testing import CliRunner

import probe
from probe.app.cli import app
from probe.app.plan import Settings, plan
from probe.errors import ProbeError
from probe.inputs.corpus import UNKNOWN_MAX_TOKENS, max_tokens
from probe.inputs.treebank import SAMPLE, read_conllu

runner = CliRunner()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--threshold", "sink=2"], "threshold sink must be between 0 and 1, not 2.0"),
        (["--threshold", "broad=-1"], "threshold broad must be between 0 and 1"),
        (["--threshold", "sink=nan"], "threshold sink must be between 0 and 1, not nan"),
        (["--threshold", "relation_min_words=0.5"], "must be a whole number ≥ 1, not 0.5"),
        (["--analyses", ","], "unknown analysis (none)"),
        (["--analyses", "taxonmy"], "unknown analysis taxonmy; did you mean 'taxonomy'?"),
        (["--device", "tpu"], "unknown --device 'tpu'"),
        (
            ["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "cuda:99"],
            "--device cuda",
        ),
        (["--revision", "main"], "--revision main is for hub models"),
    ],
)
def test_bad_options(tmp_path, minilm, options, message):
    fails_in_one_line(
        ["analyze", "-m", "minilm", "-a", "spectra", "-o", str(tmp_path / "r"), *options], message
    )
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    ("options", "given"),
    [
        (["--dtype", "float8"], {"dtype": "float8"}),
        (["--device-map", "everywhere"], {"device_map": "everywhere"}),
        (["--max-memory", "cpu=1GiB"], {"max_memory": {"cpu": "1GiB"}}),
        (["--offload-folder", "off"], {"offload_folder": Path("off")}),
        (["--device-map", "auto", "--max-memory", "gpu=1GiB"],
         {"device_map": "auto", "max_memory": {"gpu": "1GiB"}}),
        (["--device-map", "auto", "--max-memory", "0=lots"],
         {"device_map": "auto", "max_memory": {0: "lots"}}),
        (["--device-map", "auto", "--max-memory", "0=lots"],
         {"device_map": "auto", "max_memory": "0=lots"}),  # as the flag gives it
    ],
)  # fmt: skip
def test_settings_made_in_python_are_checked_as_flags_are(tmp_path, options, given):
    """Settings built in Python (``probe.app.plan.plan``) get the checks and the one-line
    error that the same values get as flags."""
    out = tmp_path / "r"
    result = runner.invoke(app, ["analyze", "-m", "minilm", "-o", str(out), *options])
    assert result.exit_code == 1, result.output
    with pytest.raises(ProbeError) as raised:
        plan(Settings("minilm", out=out, **given))
    assert result.output == f"error: {raised.value}\n"
    assert not out.exists()


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (lambda p: p.mkdir(), "is a folder; give its .conllu file"),
        (
            lambda p: p.write_text("# sent_id = 1\n1\tHi\thi\tINTJ\t_\t_\t1\troot\t_\t_\n\n"),
            "word 1 is its own head",
        ),
    ],
)
def test_bad_treebanks(tmp_path, minilm, write, message):
    path = tmp_path / "t.conllu"
    write(path)
    fails_in_one_line(
        ["analyze", "-m", "minilm", "-t", str(path), "-o", str(tmp_path / "r")], message
    )


def test_a_byte_order_mark_is_not_a_column(tmp_path):
    path = tmp_path / "bom.conllu"
    path.write_bytes(b"\xef\xbb\xbf" + SAMPLE.read_bytes())
    strip = lambda sentences: [replace(s, source="") for s in sentences]  # noqa: E731
    assert strip(read_conllu(path)) == strip(read_conllu(SAMPLE))


def test_one_word_sentences_give_a_report(tmp_path, minilm):
    """No word but the root to score: every analysis still finishes, with empty counts."""
    path = tmp_path / "one.conllu"
    path.write_text(
        "".join(f"# sent_id = {i}\n1\tHi\thi\tINTJ\t_\t_\t0\troot\t_\t_\n\n" for i in range(3))
    )
    result = runner.invoke(
        app, ["analyze", "-m", "minilm", "-t", str(path), "-o", str(tmp_path / "r"), "-q"]
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "r" / "index.html").exists()


@pytest.fixture
def good_report(sample_report):
    """MiniLM's report of the sample (the session's, conftest.py): each test copies it."""
    return sample_report


def _threshold(folder, **change):
    run = json.loads((folder / "run.json").read_text())
    run["thresholds"] |= change
    (folder / "run.json").write_text(json.dumps(run))


def _example_out_of_range(folder):
    examples = json.loads((folder / "examples.json").read_text())
    first = next(iter(examples["heads"]))
    examples["heads"][first]["shown"][0]["sentence"] = 999
    (folder / "examples.json").write_text(json.dumps(examples))


def _index_is_a_folder(folder):
    (folder / "index.html").unlink()
    (folder / "index.html").mkdir()


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda f: (f / "run.json").write_text("[1, 2]"), "no readable run.json"),
        (lambda f: (f / "run.json").write_text("{}"), "no readable run.json"),
        (
            lambda f: (f / "run.json").write_text((f / "run.json").read_text()[:80]),
            "no readable run.json",
        ),
        (lambda f: _threshold(f, zzz=1), "run.json: bad thresholds"),
        (lambda f: _threshold(f, sink=5), "run.json: bad thresholds"),
        (
            lambda f: (f / "heads.csv").write_text((f / "heads.csv").read_text()[:300]),
            "heads.csv cannot be read",
        ),
        (lambda f: (f / "syntax.csv").write_text(""), "syntax.csv cannot be read"),
        (lambda f: (f / "head_stats.csv").unlink(), "head_stats.csv cannot be read"),
        (_example_out_of_range, "examples.json is malformed"),
        (lambda f: (f / "examples.json").write_text("{not json"), "examples.json is malformed"),
        (
            lambda f: (f / "attention.npz").write_bytes(b"PK"),
            "attention.npz is missing or malformed",
        ),
        (lambda f: (f / "attention.npz").unlink(), "attention.npz is missing or malformed"),
        (_index_is_a_folder, "cannot write"),
    ],
)
def test_report_of_a_malformed_folder(good_report, tmp_path, corrupt, message):
    folder = tmp_path / "copy"
    shutil.copytree(good_report, folder)
    corrupt(folder)
    fails_in_one_line(["report", str(folder)], message)


def test_report_of_a_good_folder_still_renders(good_report, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(good_report, folder)
    result = runner.invoke(app, ["report", str(folder)])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(("d_model", "n_heads"), [(8, 0), (0, 2), (-8, 2), (8, 3), (8.0, 2)])
def test_multihead_attention_sizes(d_model, n_heads):
    with pytest.raises(ValueError, match=r"d_model|n_heads"):
        probe.MultiHeadAttention(d_model, n_heads)


def test_a_hook_returning_no_tensor_is_told_so():
    mha = probe.MultiHeadAttention(8, 2)
    with (
        pytest.raises(TypeError, match="returned a str; return None to only read"),
        probe.hooks(mha, {"hook_z": lambda z, hook: "oops"}),
    ):
        mha(torch.randn(1, 3, 8))


def test_max_tokens_without_a_stated_limit():
    config = types.SimpleNamespace()  # no max_position_embeddings
    tokenizer = types.SimpleNamespace(model_max_length=int(1e30))
    assert max_tokens(config, tokenizer) == UNKNOWN_MAX_TOKENS
    assert max_tokens(types.SimpleNamespace(max_position_embeddings=64), tokenizer) == 64


def test_an_interrupted_download_is_one_line_and_caches_nothing(tmp_path, monkeypatch):
    import http.client

    from probe.inputs.treebank import download_ud

    class CutShort:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read1(self, size):  # the connection closes mid-body
            raise http.client.IncompleteRead(b"# sent_id = 1\n1\tHal")

    monkeypatch.setenv("PROBE_CACHE", str(tmp_path))
    monkeypatch.setattr("urllib.request.urlopen", lambda url, timeout: CutShort())
    with pytest.raises(probe.ProbeError, match="cannot download ud:en_ewt-dev"):
        download_ud("ud:en_ewt")
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_markup_in_an_output_path_is_text(tmp_path, minilm, monkeypatch):
    """A finished run whose folder name looks like rich markup still ends well."""
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["analyze", "-m", "minilm", "-a", "spectra", "-o", "o/weird[/]"])
    assert result.exit_code == 0, result.output
    assert "o/weird[/]/index.html" in result.output


def test_an_unwritable_cache_is_one_line(tmp_path, monkeypatch):
    from probe.inputs.treebank import download_ud

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("PROBE_CACHE", str(blocker / "cache"))
    with pytest.raises(probe.ProbeError, match="set PROBE_CACHE to a writable folder"):
        download_ud("ud:en_ewt")


def test_only_verifiable_splits_are_offered():
    """Every split probe downloads has a pinned checksum: one without is refused, saying
    which exist."""
    from probe.inputs.treebank import download_ud

    with pytest.raises(probe.ProbeError, match=r"known: ud:en_ewt\[-dev\|-test\]"):
        download_ud("ud:en_ewt-train")


INDUCTION = str(Path(__file__).parents[1] / "data" / "induction-gpt2")  # context: 128 tokens


@pytest.mark.parametrize(
    ("options", "message"),
    [
        # Work that cannot finish in a day, or fit the machine: refused before the weights load.
        (["-a", "circuit", "--circuit-pairs", "1000000000"],
         "--circuit-pairs 1,000,000,000 needs at least"),
        (["-a", "claims", "--claims-sequences", "1000000000"], "--claims-sequences 1,000,000,000"),
        (["-a", "claims", "--claims-needles", "1000000000"], "--claims-needles 1,000,000,000"),
        # Lengths beyond the model's context, named by the option that set them.
        (["-a", "claims", "--claims-repeat-length", "100"],
         "--claims-repeat-length 100 makes sequences of 201 tokens, longer than the model's 128"),
        (["-a", "circuit", "--circuit-length", "100"],
         "--circuit-length 100 makes sequences of 201 tokens, longer than the model's 128"),
        (["-a", "circuit", "--circuit-max-bytes", str(1 << 20), "--circuit-pairs", "2000"],
         "--circuit-max-bytes"),
    ],
)  # fmt: skip
def test_sizes_that_cannot_finish_or_fit_are_refused(tmp_path, options, message):
    out = tmp_path / "r"
    fails_in_one_line(["analyze", "-m", INDUCTION, "-t", "sample", "--lm-head", "-q", "-o",
                       str(out), *options], message)  # fmt: skip
    assert not out.exists()


def test_a_size_that_finishes_is_not_refused():
    """The bound is a bound: the default sizes, and a large but feasible count, pass."""
    from transformers import AutoConfig, AutoTokenizer

    from analyses.circuit import Circuit
    from analyses.claims import Claims

    config, tokenizer = (
        AutoConfig.from_pretrained(INDUCTION),
        AutoTokenizer.from_pretrained(INDUCTION),
    )
    Circuit.check_tokenizer(tokenizer, config, {"circuit_pairs": 10_000})
    Claims.check_tokenizer(tokenizer, config, {"claims_sequences": 10_000})


def test_a_circuit_on_a_model_without_a_head_says_so_before_asking_for_lm_head(tmp_path, minilm):
    fails_in_one_line(["analyze", "-m", "minilm", "-a", "circuit", "-t", "sample", "-o",
                       str(tmp_path / "r")], "minilm has no language-model head")  # fmt: skip


def _llama_checkpoint(folder: Path, kv_heads: int) -> Path:
    """A tiny Llama of 4 query heads and ``kv_heads`` key/value heads, with the GQA induction
    model's tokenizer."""
    import transformers as tf

    config = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16,
                            vocab_size=64, max_position_embeddings=128)  # fmt: skip
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config).save_pretrained(folder)
    source = Path(__file__).parents[1] / "data" / "induction-llama-gqa"
    for file in source.glob("*token*"):
        shutil.copy(file, folder)
    return folder


def test_query_heads_that_do_not_divide_among_key_value_heads_are_one_line(tmp_path):
    """Four query heads over three key/value heads: refused at load, not deep in capture."""
    model = _llama_checkpoint(tmp_path / "m", kv_heads=3)
    fails_in_one_line(["analyze", "-m", str(model), "-t", "sample", "-a", "taxonomy", "-q", "-o",
                       str(tmp_path / "r")],
                      "its 4 query heads do not divide among its 3 key/value heads")  # fmt: skip
    assert not (tmp_path / "r").exists()


def test_weights_unlike_the_config_are_one_line(tmp_path):
    model = _llama_checkpoint(tmp_path / "m", kv_heads=2)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"num_key_value_heads": 4}))
    fails_in_one_line(["analyze", "-m", str(model), "-t", "sample", "-a", "taxonomy", "-q", "-o",
                       str(tmp_path / "r")],
                      "weights' shapes do not match its config.json")  # fmt: skip
