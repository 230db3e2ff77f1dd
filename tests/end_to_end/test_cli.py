"""`probe analyze` and `probe report` end to end on MiniLM, and their errors on bad input."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import matplotlib.image as plt_image
import pandas as pd
import pytest
from browser import check_html, chromium, console_messages, needs_chromium
from treebanks import EWT, needs_ewt
from typer.testing import CliRunner

from probe.app.cli import app

FILES = {
    "index.html", "run.json", "examples.json", "attention.npz", "heads.csv", "head_stats.csv",
    "head_similarity.csv", "spectra.csv", "syntax.csv", "syntax_baselines.csv", "syntax_best.csv",
    "probe.csv", "coref.csv", "coref_baselines.csv", "coref_example.csv", "claims.csv",
    "claims_run.csv",
    ".probe-report",  # the marker: what --overwrite may replace
}  # fmt: skip
runner = CliRunner()


def analyze(*args: str):
    """``probe analyze`` on MiniLM, on the hand-written sample unless a treebank is given."""
    sample = [] if {"-t", "--treebank"} & set(args) else ["-t", "sample"]
    return runner.invoke(app, ["analyze", "--model", "minilm", "-q", *sample, *args])


def test_default_sample_writes_every_file(sample_report):
    assert {p.name for p in sample_report.iterdir()} == FILES
    run = json.loads((sample_report / "run.json").read_text())
    assert run["sentences_analysed"] == run["sentences_read"] == 76
    assert run["treebank"][0].endswith("sample.conllu")
    assert run["analyses"] == ["syntax", "roles", "spectra", "probe", "coref", "claims"]
    # the sample's three documents with coreference, each one window
    assert run["coref"] == {"window": 128, "documents": 4, "windows": 3, "mentions": 33,
                            "sentences_skipped": 0, "windows_skipped": {}}  # fmt: skip
    assert (
        pd.read_csv(sample_report / "coref_baselines.csv")
        .query("mention_type == 'all'")
        .total.tolist()
        == [16] * 3
    )
    uas = pd.read_csv(sample_report / "probe.csv").set_index("parser").uas
    assert uas["attention_probe"] > uas["right_branching"]
    assert set(run["timings_s"]) == {"start", "load", "analyses", "tables", "render", "total"}
    assert {"torch", "transformers", "probe"} <= set(run["packages"])
    checker = check_html(sample_report / "index.html")
    assert checker.scripts == 2  # the sorting script and the cards' viewer, nothing else
    assert (sample_report / "index.html").stat().st_size < 10_000_000
    html = (sample_report / "index.html").read_text()
    for section in ("run", "overview", "syntax", "roles", "spectra", "probe", "coref", "heads",
                    "methods"):  # fmt: skip
        assert f'id="{section}"' in html
    assert html.count('class="head"') == 72 and 'id="head-5-11"' in html
    assert "0-based" in html or "numbered from 0" in html
    assert '<svg class="coref"' in html and "An example window read by head" in html
    assert "<b>Preliminary:</b> 76 sentences" in html  # a sample this small says so at the top
    similarity = html[html.index('<svg class="similarity"') :]
    similarity = similarity[: similarity.index("</svg>")]
    assert similarity.count("<title>") == 72  # every head names itself on hover


def test_report_re_renders_from_tables(sample_report):
    index = sample_report / "index.html"
    before = index.read_text()
    index.unlink()
    result = runner.invoke(app, ["report", str(sample_report)])
    assert result.exit_code == 0, result.output
    assert index.read_text() == before


def test_best_relations_beat_their_baseline_and_rare_relations_wait_behind_a_click(
    sample_report,
):
    """A best relation is named only where its margin is called after the correction and is
    at least 2 points (checked against syntax.csv); relations of too few words or sentences
    are listed as too few, never ranked."""
    heads = pd.read_csv(sample_report / "heads.csv", keep_default_na=False)
    named = heads[heads.best_relation != ""]
    assert len(named) and (named.best_relation_margin.astype(float) >= 0.02).all()
    assert (heads[heads.best_relation == ""].best_relation_margin == "").all()
    syntax = pd.read_csv(sample_report / "syntax.csv")
    keys = ["best_relation", "best_relation_direction", "layer", "head"]
    found = named.merge(syntax, left_on=keys, right_on=["relation", "direction", "layer", "head"])
    assert len(found) == len(named) and found.margin_called.all()
    assert (found.sentences >= 10).all() and (found.total >= 20).all()
    best = pd.read_csv(sample_report / "syntax_best.csv")
    rare = set(best[(best.total < 20) | (best.sentences < 10)].relation) - {"all"}
    html = (sample_report / "index.html").read_text()
    main, _, hidden = html.partition('<details class="rare">')
    main = main[main.index('id="syntax"') :]
    assert rare and hidden
    for relation in rare:
        assert f"{relation} (" in hidden and f"<td>{relation}</td>" not in main
    called = syntax[syntax.margin_called]
    assert (called.sentences >= 10).all() and not called.relation.isin(rare).any()


def test_enough_sentences_are_not_preliminary(sample_report, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(sample_report, folder)
    run = json.loads((folder / "run.json").read_text())
    (folder / "run.json").write_text(json.dumps(run | {"sentences_analysed": 500}))
    assert runner.invoke(app, ["report", str(folder)]).exit_code == 0
    assert "Preliminary" not in (folder / "index.html").read_text()


@needs_ewt()
@pytest.mark.slow
def test_ewt_dev_hundred_sentences(tmp_path, minilm):
    out = tmp_path / "ewt"
    dev = EWT / "en_ewt-ud-dev.conllu"
    result = analyze("--treebank", str(dev), "--max-sentences", "100", "--out", str(out))
    assert result.exit_code == 0, result.output
    run = json.loads((out / "run.json").read_text())
    assert run["sentences_read"] == 100  # reading stops at --max-sentences
    assert {p.name for p in out.iterdir()} == FILES
    check_html(out / "index.html")


@pytest.mark.slow
def test_thresholds_can_be_overridden(tmp_path, minilm):
    out = tmp_path / "lenient"
    result = analyze("--out", str(out), "--threshold", "sink=0.01", "--threshold", "broad=0")
    assert result.exit_code == 0, result.output
    run = json.loads((out / "run.json").read_text())
    assert run["thresholds"]["sink"] == 0.01 and run["thresholds"]["broad"] == 0
    heads = (out / "heads.csv").read_text().splitlines()[1:]
    assert all("sink" in row and "broad" in row for row in heads)  # every head passes now
    assert "≥ 1% of attention on special tokens" in (out / "index.html").read_text()


def test_only_some_analyses(tmp_path, minilm):
    out = tmp_path / "spectra-only"
    result = analyze("--analyses", "spectra", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert not (out / "syntax.csv").exists() and (out / "spectra.csv").exists()
    html = check_html(out / "index.html")
    assert html.scripts == 1


INJECTION = """# text = hostile words
1\t<script>alert(1)</script>\t_\tX\t_\t_\t3\tnsubj\t_\tEntity=(1-x)
2\t</w>\t_\tX\t_\t_\t3\tdet\t_\t_
3\truns\t_\tVERB\t_\t_\t0\troot\t_\t_
4\t"quoted"&amp;\t_\tX\t_\t_\t3\tobj\t_\t_
5\tend\t_\tX\t_\t_\t3\tobl\t_\t_
6\t.\t_\tPUNCT\t_\t_\t3\tpunct\t_\t_

# text = It </w> again.
1\tIt\t_\tPRON\t_\t_\t2\tnsubj\t_\tEntity=(1-x)
2\truns\t_\tVERB\t_\t_\t0\troot\t_\t_
3\t</w>\t_\tX\t_\t_\t2\tobj\t_\tEntity=(1-x)
4\tagain\t_\tADV\t_\t_\t2\tadvmod\t_\t_
"""


@pytest.mark.slow
def test_text_from_the_treebank_is_escaped(tmp_path, minilm):
    treebank = tmp_path / "hostile.conllu"
    treebank.write_text(INJECTION)
    out = tmp_path / "hostile"
    result = analyze("--treebank", str(treebank), "--out", str(out))
    assert result.exit_code == 0, result.output
    html = (out / "index.html").read_text()
    checker = check_html(out / "index.html")
    assert checker.scripts == 2  # the sorting script and the cards' viewer
    assert "<script>alert(1)</script>" not in html and "</w>" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html  # shown as text
    assert "\\u003cscript\\u003ealert(1)\\u003c/script\\u003e" in html  # a card's data
    assert "&lt;/w&gt;" in html
    assert "&#34;quoted&#34;&amp;amp;" in html
    # the coreference example draws the hostile words too, as text
    svg = html[html.index('<svg class="coref"') :]
    svg = svg[: svg.index("</svg>")]
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in svg and "&lt;/w&gt;" in svg


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "no-such-model-xyz"], "cannot load 'no-such-model-xyz'"),
        (["--model", "/no/such/folder"], "no such model folder: /no/such/folder"),
        (
            ["--model", "minilm", "--treebank", "missing.conllu"],
            "treebank missing.conllu does not exist",
        ),
        (["--model", "minilm", "--analyses", "syntax,magic"], "unknown analysis magic"),
        (["--model", "minilm", "--dtype", "float8"], "unknown --dtype"),
        (["--model", "minilm", "--threshold", "sink=high"], "is not NAME=NUMBER"),
        (["--model", "minilm", "--threshold", "sinks=0.5"], "unknown threshold sinks"),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path, args, message):
    result = runner.invoke(app, ["analyze", *args, "--out", str(tmp_path / "x")])
    assert result.exit_code == 1
    assert message in result.output
    assert "Traceback" not in result.output
    assert result.output.startswith("error: ") and result.output.count("\n") == 1
    assert not (tmp_path / "x").exists()


def test_unsupported_architecture_is_one_clear_line(tmp_path):
    import transformers as tf
    from tokenizers_util import wordpiece

    folder = tmp_path / "deberta"
    config = tf.DebertaV2Config(hidden_size=32, num_attention_heads=4, num_hidden_layers=1)
    tf.AutoModel.from_config(config).save_pretrained(folder)
    wordpiece().save_pretrained(folder)
    result = runner.invoke(app, ["analyze", "--model", str(folder), "--out", str(tmp_path / "x")])
    assert result.exit_code == 1 and result.output.count("\n") == 1
    assert "architecture 'deberta-v2' is not supported" in result.output
    assert "supported: albert, bart, bert, distilbert" in result.output


def test_malformed_conllu_names_file_and_line(tmp_path, minilm):
    bad = tmp_path / "bad.conllu"
    bad.write_text("1\tA\t_\tX\t_\t_\t0\troot\t_\t_\n2\tb\t_\tX\t_\t_\t9\tdep\t_\t_\n")
    result = analyze("--treebank", str(bad), "--out", str(tmp_path / "x"))
    assert result.exit_code == 1
    assert f"{bad}:2: head 9 out of range" in result.output.replace("\n", "")


def test_existing_output_folder(tmp_path, minilm):
    """An existing folder is refused; --overwrite replaces a probe report, never anything else
    (tests/app/test_output.py has the rest)."""
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = analyze("--out", str(out))
    assert result.exit_code == 1 and "already exists; use --overwrite" in result.output
    result = analyze("--out", str(out), "--overwrite", "--analyses", "spectra")
    assert result.exit_code == 1 and "is not a probe report" in result.output
    assert (out / "keep.txt").read_text() == "mine"
    report = tmp_path / "report"
    assert analyze("--out", str(report), "--analyses", "spectra").exit_code == 0
    (report / "index.html").write_text("old")
    result = analyze("--out", str(report), "--overwrite", "--analyses", "spectra")
    assert result.exit_code == 0, result.output
    assert (report / "index.html").read_text() != "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report", "taken"]  # nothing else


@pytest.mark.slow
def test_console_script_in_a_subprocess(tmp_path):
    exe = Path(sys.executable).with_name("probe")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True)
    assert version.stdout.startswith("probe ")
    bad = subprocess.run([exe, "report", str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode == 1
    assert "not a probe report folder" in bad.stderr and "Traceback" not in bad.stderr
    helped = subprocess.run([exe, "analyze", "--help"], capture_output=True, text=True)
    assert "--max-sentences" in helped.stdout and "--overwrite" in helped.stdout


@pytest.mark.slow
def test_the_console_script_ends_with_its_output_and_its_helper(tmp_path):
    """The installed command skips the interpreter's teardown (``cli.command``): what it printed
    still reaches a pipe, its status is the run's, and its helper process has ended with it."""
    exe = Path(sys.executable).with_name("probe")
    out = tmp_path / "report"
    command = [exe, "analyze", "--model", "minilm", "-t", "sample", "-a", "probe", "-q",
               "--out", str(out)]  # fmt: skip
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)  # fmt: skip
    stdout, stderr = child.communicate(timeout=300)
    assert child.returncode == 0, stderr
    assert stdout == f"report: {out / 'index.html'}\n"
    assert json.loads((out / "run.json").read_text())["analyses"] == ["probe"]
    with pytest.raises(ProcessLookupError):  # nothing of the run's process group is left
        os.killpg(child.pid, 0)
    again = subprocess.run(command, capture_output=True, text=True)
    assert again.returncode == 1 and "already exists" in again.stderr and not again.stdout


@needs_chromium
def test_console_check_sees_errors(tmp_path):
    page = tmp_path / "broken.html"
    page.write_text("<html><body><script>undefinedFunction();</script></body></html>")
    done = chromium(page.as_uri(), tmp_path, "--dump-dom")
    assert any("undefinedFunction" in m for m in console_messages(done.stderr))


@needs_chromium
@pytest.mark.slow
def test_chromium_opens_the_report_offline(sample_report, tmp_path):
    url = (sample_report / "index.html").as_uri()
    dom = chromium(url, tmp_path, "--dump-dom")
    assert console_messages(dom.stderr) == []
    assert 'aria-sort="none"' in dom.stdout  # the sorting script ran
    shot = tmp_path / "report.png"
    done = chromium(url, tmp_path, f"--screenshot={shot}")
    assert console_messages(done.stderr) == []
    pixels = plt_image.imread(shot)[..., :3]
    assert pixels.std() > 0.05  # not blank
    assert (pixels.mean(-1) < 0.9).mean() > 0.02  # text and figures cover part of the page


@pytest.mark.slow
def test_a_twelve_by_twelve_model_from_a_local_folder(tmp_path):
    """A BERT-shaped model of 12 layers x 12 heads: the report stays well under 10 MB."""
    import transformers as tf
    from tokenizers_util import wordpiece

    folder = tmp_path / "bert-12x12"
    config = tf.BertConfig(hidden_size=48, num_attention_heads=12, num_hidden_layers=12,
                           intermediate_size=96, vocab_size=200)  # fmt: skip
    tf.BertModel(config).save_pretrained(folder)
    wordpiece().save_pretrained(folder)
    out = tmp_path / "report"
    result = runner.invoke(
        app, ["analyze", "--model", str(folder), "-t", "sample", "--out", str(out), "-q"]
    )
    assert result.exit_code == 0, result.output
    html = out / "index.html"
    assert html.stat().st_size < 10_000_000
    assert html.read_text().count('class="head"') == 144
    check_html(html)


def test_no_network_fails_fast_without_the_offline_flag(monkeypatch, tmp_path):
    import socket

    from probe.pipeline import loading

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def unreachable(*args, **kwargs):
        raise OSError("Name or service not known")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    assert not loading.hub_reachable()
    result = runner.invoke(app, ["analyze", "--model", "gpt2", "--out", str(tmp_path / "x")])
    assert result.exit_code == 1 and result.output.count("\n") == 1
    assert "cannot load 'gpt2' (openai-community/gpt2)" in result.output
    assert "hub cannot be reached" in result.output


def test_a_decoder_end_to_end(tmp_path):
    """A small random GPT-2 with a byte-level BPE tokenizer: the whole run works on a causal
    model, and its nearly uniform random attention is normalised by the keys each query sees
    (its own position and before), not by the sentence length."""
    import transformers as tf
    from tokenizers_util import FAMILIES

    folder = tmp_path / "gpt2"
    tokenizer = FAMILIES["byte_level_bpe"]()
    config = tf.GPT2Config(n_embd=32, n_head=4, n_layer=2, n_positions=128,
                           vocab_size=len(tokenizer))  # fmt: skip
    tf.GPT2Model(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "report"
    result = runner.invoke(
        app, ["analyze", "--model", str(folder), "-t", "sample", "--out", str(out), "-q"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads((out / "run.json").read_text())["causal"] is True
    heads = pd.read_csv(out / "heads.csv")
    assert heads.entropy_normalised.between(0.95, 1.0 + 1e-6).all()
    # coreference on the sample's documents: a causal head can only point back
    assert pd.read_csv(out / "coref.csv").total.max() > 0
    example = pd.read_csv(out / "coref_example.csv", keep_default_na=False)
    mentions = example[example.mention_type != ""]
    assert len(mentions) >= 3 and (mentions.predicted.astype(int) < mentions.position).all()
    check_html(out / "index.html")


def test_a_treebank_with_no_word_to_score(tmp_path, minilm):
    """One-word sentences have no dependency to score: every table is still written, with its
    columns, and the report says the probe could not be evaluated."""
    treebank = tmp_path / "one-word.conllu"
    treebank.write_text(
        "1\tHello\t_\tINTJ\t_\t_\t0\troot\t_\t_\n\n1\tYes\t_\tINTJ\t_\t_\t0\troot\t_\t_\n\n"
    )
    out = tmp_path / "report"
    result = analyze("--treebank", str(treebank), "--out", str(out))
    assert result.exit_code == 0, result.output
    assert {p.name for p in out.iterdir()} == FILES
    syntax = pd.read_csv(out / "syntax.csv")
    assert list(syntax.columns) == ["relation", "direction", "layer", "head", "correct",
                                    "total", "sentences", "accuracy", "ci_low", "ci_high",
                                    "margin", "margin_p", "margin_called"]  # fmt: skip
    assert syntax.empty
    html = (out / "index.html").read_text()
    assert "Not evaluated: too few sentences" in html
    assert "Coreference was skipped: the treebank has no <code>Entity=</code>" in html
    assert pd.read_csv(out / "coref.csv").empty
    assert json.loads((out / "run.json").read_text())["coref"]["windows"] == 0
    check_html(out / "index.html")
