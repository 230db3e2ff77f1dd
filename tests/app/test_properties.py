"""Property-based tests: the next failure found by a machine, not a user.

Random valid trees read back identical; random corruptions of a valid file are read or refused
with file:line, never another exception; hostile strings in what the report shows come out
escaped; random option values give exit 0 or one line."""

import json
import re
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from markupsafe import escape
from typer.testing import CliRunner

from probe.app.cli import app
from probe.errors import ProbeError
from probe.inputs.treebank import RELATIONS, SAMPLE, read_conllu

pytestmark = pytest.mark.slow  # runs real models or the whole command line

runner = CliRunner()
SLOW_FIXTURES = [HealthCheck.function_scoped_fixture]  # one tmp_path for all examples: fine
FAST = settings(max_examples=60, deadline=None, suppress_health_check=SLOW_FIXTURES)
WORD = st.text(
    st.characters(blacklist_categories=("Cc", "Cs", "Zs", "Zl", "Zp")), min_size=1, max_size=8
)


@st.composite
def trees(draw):
    """A sentence: words, 0-based heads (-1 the root) forming one tree, relations."""
    n = draw(st.integers(1, 12))
    order = draw(st.permutations(range(n)))
    heads = [-1] * n
    for k, word in enumerate(order[1:], start=1):
        heads[word] = order[draw(st.integers(0, k - 1))]  # an earlier word: no cycle
    relations = [
        "root" if h < 0 else draw(st.sampled_from([r for r in RELATIONS if r != "root"]))
        for h in heads
    ]
    words = draw(st.lists(WORD, min_size=n, max_size=n))
    return words, heads, relations


def conllu(sentences) -> str:
    lines = []
    for s, (words, heads, relations) in enumerate(sentences):
        lines += [f"# sent_id = s{s}", f"# text = {' '.join(words)}"]
        for i, (w, h, r) in enumerate(zip(words, heads, relations, strict=True), start=1):
            lines.append(f"{i}\t{w}\t{w}\tX\t_\t_\t{h + 1}\t{r}\t_\t_")
        lines.append("")
    return "\n".join(lines) + "\n"


@FAST
@given(st.lists(trees(), min_size=1, max_size=4))
def test_valid_trees_read_back_identical(tmp_path, sentences):
    path = tmp_path / "t.conllu"
    path.write_text(conllu(sentences), encoding="utf-8")
    got = read_conllu(path)
    assert [(s.words, s.heads, s.relations) for s in got] == [tuple(s) for s in sentences]


CORRUPTIONS = {
    "drop a column": lambda cols, text: cols[:-1],
    "head not a number": lambda cols, text: [*cols[:6], text, *cols[7:]],
    "head far away": lambda cols, text: [*cols[:6], str(len(text) + 99), *cols[7:]],
    "unknown relation": lambda cols, text: [*cols[:7], "x" + text, *cols[8:]],
    "bad id": lambda cols, text: [text + "7", *cols[1:]],
    "extra columns": lambda cols, text: [*cols, text],
    "garbage line": lambda cols, text: [text],
}


@FAST
@given(st.sampled_from(sorted(CORRUPTIONS)), st.integers(0, 10**6), st.text(max_size=6))
def test_corrupted_files_are_refused_with_file_and_line(tmp_path, corruption, where, text):
    lines = SAMPLE.read_text(encoding="utf-8").splitlines()
    rows = [i for i, line in enumerate(lines) if line and not line.startswith("#")]
    row = rows[where % len(rows)]
    text = text.replace("\n", " ").replace("\r", " ")
    lines[row] = "\t".join(CORRUPTIONS[corruption](lines[row].split("\t"), text))
    path = tmp_path / "bad.conllu"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    try:
        read_conllu(path)
    except ProbeError as e:
        assert re.match(rf"{re.escape(str(path))}:\d+: ", str(e)), str(e)


HOSTILE = st.sampled_from(["<script>alert(1)</script>", '"><img src=x onerror=alert(1)>',
                           "</title><b>", "{{ 7*7 }}", "&amp;<", "'; --"])  # fmt: skip


@pytest.fixture(scope="module")
def good_report(tmp_path_factory, minilm):
    out = tmp_path_factory.mktemp("report") / "good"
    args = ["analyze", "-m", "minilm", "-t", "sample", "-o", str(out), "-q"]
    assert runner.invoke(app, args).exit_code == 0
    return out


@settings(max_examples=6, deadline=None, suppress_health_check=SLOW_FIXTURES)
@given(HOSTILE, HOSTILE)
def test_hostile_strings_come_out_escaped(good_report, tmp_path_factory, word, model):
    """A treebank word (in the example maps) and a model name (in the run card) that are
    markup: the report shows them as text."""
    folder = tmp_path_factory.mktemp("hostile") / "r"
    shutil.copytree(good_report, folder)
    examples = json.loads((folder / "examples.json").read_text())
    examples["sentences"][0]["words"][0] = word
    examples["sentences"][0]["tokens"][1] = word
    (folder / "examples.json").write_text(json.dumps(examples))
    run = json.loads((folder / "run.json").read_text())
    run["model"] = model
    (folder / "run.json").write_text(json.dumps(run))
    assert runner.invoke(app, ["report", str(folder)]).exit_code == 0
    html = (folder / "index.html").read_text()
    for hostile in (word, model):
        assert hostile not in html or not re.search("[<>\"']", hostile), hostile
    assert str(escape(model)) in html
    assert "<script>alert" not in html and "<img src=x" not in html and "</title><b>" not in html


OPTION_VALUES = {
    "--batch-size": st.one_of(st.integers(-5, 70).map(str), st.text(max_size=4)),
    "--max-sentences": st.one_of(st.integers(-3, 5).map(str), st.text(max_size=4)),
    "--threshold": st.tuples(
        st.sampled_from(["sink", "broad", "relation_min_words", "zz"]), st.text(max_size=5)
    ).map("=".join),
    "--coref-window": st.integers(-10, 600).map(str),
    "--device": st.text(max_size=6),
    "--dtype": st.text(max_size=8),
    "--analyses": st.text(max_size=10),
    "--seed": st.text(max_size=4),
    "--importance-ablation": st.text(max_size=5),
    "--max-memory": st.text(max_size=12),
}


OPTIONS = st.lists(st.sampled_from(sorted(OPTION_VALUES)), min_size=1, max_size=3, unique=True)


@settings(max_examples=80, deadline=None, suppress_health_check=SLOW_FIXTURES)
@given(OPTIONS.flatmap(lambda keys: st.fixed_dictionaries({k: OPTION_VALUES[k] for k in keys})))
def test_random_options_give_exit_0_or_one_line(tmp_path, options):
    """Random values of every option, on a model that does not exist (so nothing heavy runs):
    never a traceback, at most one line."""
    args = ["analyze", "-m", "no-such-model-anywhere", "-o", str(tmp_path / "r")]
    for name, value in options.items():
        args += [name, value]
    if "--max-memory" in options:
        args += ["--device-map", "auto"]
    result = runner.invoke(app, args)
    assert result.exit_code in (0, 1, 2), result.output
    if result.exit_code == 1:
        assert result.output.startswith("error:"), result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
