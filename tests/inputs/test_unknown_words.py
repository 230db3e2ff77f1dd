"""An input the tokenizer mostly cannot read (probe.inputs.unknown): the share of its words that
become the unknown token, measured by hand on the induction model's 64-symbol vocabulary; a run
records it, skips the analyses that read only that input (saying so), and refuses where none
is left."""

import json

import pytest
import transformers as tf
from induction import MODEL
from typer.testing import CliRunner

from probe.app.cli import app
from probe.inputs.unknown import MOSTLY_UNKNOWN, SAMPLE_WORDS, unknown_words


def test_the_share_of_unknown_words_by_hand():
    tokenizer = tf.AutoTokenizer.from_pretrained(MODEL)  # "t0".."t63"; anything else is t0
    assert unknown_words(tokenizer, ["The", "cat", "sat"]) == {
        "words": 3, "unknown": 3, "share": 1.0,
    }  # fmt: skip
    assert unknown_words(tokenizer, ["t5", "t6", "cat", "t7"]) == {
        "words": 4, "unknown": 1, "share": 0.25,
    }  # fmt: skip
    assert unknown_words(tokenizer, []) == {"words": 0, "unknown": 0, "share": 0.0}
    assert unknown_words(tokenizer, ["x"] * (SAMPLE_WORDS + 5))["words"] == SAMPLE_WORDS
    assert 0 < MOSTLY_UNKNOWN < 1


@pytest.mark.slow
def test_a_run_skips_what_reads_an_unreadable_treebank(tmp_path):
    """Syntax reads only the treebank: skipped, said in run.json, the page and one warning;
    spectra reads the weights and runs. Syntax alone is one line of error, no report."""
    out = tmp_path / "r"
    args = ["analyze", "-m", str(MODEL), "-t", "sample", "-a", "syntax,spectra", "-o", str(out)]
    result = CliRunner().invoke(app, [*args, "-q"])
    assert result.exit_code == 0, result.output
    run = json.loads((out / "run.json").read_text())
    assert run["analyses"] == ["spectra"] and list(run["skipped"]) == ["syntax"]
    assert run["unknown_words"]["treebank"] == {"words": 711, "unknown": 711, "share": 1.0}
    warned = [line for line in result.output.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and "skipped syntax" in warned[0]
    html = (out / "index.html").read_text()
    assert "syntax skipped: 100% of the treebank&#39;s words" in html
    assert html.count('class="card warning"') == 1
    assert "Preliminary" not in html  # no sentence was analysed: none to call too few
    alone = CliRunner().invoke(app, ["analyze", "-m", str(MODEL), "-t", "sample", "-a", "syntax",
                                     "-o", str(tmp_path / "none"), "-q"])  # fmt: skip
    assert alone.exit_code != 0 and "every analysis of this run reads the treebank" in alone.output
    assert "Traceback" not in alone.output and not (tmp_path / "none").exists()
