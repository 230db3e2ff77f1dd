"""docs/extending.md's worked examples, run as written: a new analysis with an option, and a new
input unit, registered from outside the package and run by the ``probe`` command."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import transformers as tf
from models import saved_bert

import probe
from probe.inputs.corpus import Corpus
from probe.inputs.treebank import SAMPLE, read_conllu

pytestmark = pytest.mark.slow  # runs real models or the whole command line

DOC = Path(__file__).resolve().parents[2] / "docs" / "extending.md"
N_SENTENCES = 12


def blocks(text: str) -> dict[str, str]:
    """The documentation's code: ``file=NAME`` blocks by name, and the registration blocks."""
    found = {}
    for header, code in re.findall(r"```python([^\n]*)\n(.*?)```", text, re.S):
        name = header.strip().removeprefix("file=") or f"register{len(found)}.py"
        found[name] = code
    return found


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The examples' files written out, and ``probe analyze -a local,local_shuffled
    --local-width 3`` run on a small BERT, with the registrations the page shows."""
    tmp = tmp_path_factory.mktemp("extending")
    code = blocks(DOC.read_text())
    assert {"local_attention.py", "shuffled.py"} <= set(code)
    for name, text in code.items():
        (tmp / name).write_text(text)
    registrations = "".join(text for name, text in code.items() if name.startswith("register"))
    assert 'UNITS["shuffled"]' in registrations and 'REGISTRY["local"]' in registrations
    folder = saved_bert(tmp / "bert")
    out = tmp / "report"
    command = registrations + "from probe.app.cli import main\nmain()\n"
    args = ["analyze", "-m", str(folder), "-t", "sample", "-n", str(N_SENTENCES), "-a",
            "local,local_shuffled,spectra", "--local-width", "3", "-o", str(out), "-q"]  # fmt: skip
    done = subprocess.run([sys.executable, "-c", command, *args], cwd=tmp, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(tmp)})  # fmt: skip
    assert done.returncode == 0, done.stderr
    return folder, out, done


def test_the_new_analysis_counts_what_the_model_attends_to(run):
    """local.csv equals the share recomputed from the model's own patterns (probe.trace), and
    its option reached it: the width is 3, not the default 2."""
    folder, out, _ = run
    table = pd.read_csv(out / "local.csv")
    model = tf.BertModel.from_pretrained(folder).eval()
    corpus = Corpus(read_conllu(SAMPLE), tf.AutoTokenizer.from_pretrained(folder), 512,
                    max_sentences=N_SENTENCES)  # fmt: skip
    sums, queries = np.zeros((2, 4)), 0
    for batch in corpus.batches():
        with probe.trace(model, "hook_pattern") as cache:
            model(**batch.inputs)
        p = cache.stack("hook_pattern", dim=1).double()  # [B, layer, head, q, k]
        T = p.shape[-1]
        near = (np.abs(np.subtract.outer(np.arange(T), np.arange(T))) <= 3).astype(float)
        real = batch.attention_mask.numpy().astype(float)
        sums += np.einsum("blhqk,qk,bq->lh", p.numpy(), near, real)
        queries += int(real.sum())
    np.testing.assert_allclose(table.share, (sums / queries).ravel(), rtol=1e-5)
    assert (table.queries == queries).all()
    heads = pd.read_csv(out / "heads.csv", keep_default_na=False)
    assert {"local_share", "local_shuffled_share", "qk_effective_rank"} <= set(heads.columns)
    runcard = json.loads((out / "run.json").read_text())
    assert runcard["options"] == {"local_width": 3, "shuffle_seed": 0}
    assert runcard["analyses"] == ["local", "local_shuffled", "spectra"]  # the order given


def test_the_new_unit_streams_shuffled_sentences(run):
    """Both units were read, each counted in run.json; the shuffled sentences are the same
    sentences (same tokens, same count), so only where the heads look can differ."""
    _, out, _ = run
    inputs = json.loads((out / "run.json").read_text())["inputs"]
    assert inputs["sentence"]["analysed"] == inputs["shuffled"]["analysed"] == N_SENTENCES
    assert inputs["sentence"]["words"] == inputs["shuffled"]["words"]
    local = pd.read_csv(out / "local.csv")
    shuffled = pd.read_csv(out / "local_shuffled.csv")
    assert (local.queries == shuffled.queries).all()
    assert not np.allclose(local.share, shuffled.share)  # other words next to each query


def test_shuffling_keeps_each_word_with_its_head(run):
    """The example's permutation carries the tree: every arc joins the same two words."""
    sys.path.insert(0, str(run[1].parent))
    try:
        from shuffled import shuffled
    finally:
        sys.path.pop(0)
    sentence = read_conllu(SAMPLE)[3]
    mixed = shuffled(sentence, np.random.default_rng(0))
    arcs = lambda s: sorted(  # noqa: E731
        (s.words[i], s.relations[i], s.words[h] if h >= 0 else None) for i, h in enumerate(s.heads)
    )
    assert arcs(mixed) == arcs(sentence) and mixed.words != sentence.words


def test_the_report_shows_the_new_analysis(run):
    """The default template: a section per analysis, and each head card lists its measure."""
    _, out, _ = run
    html = (out / "index.html").read_text()
    assert 'id="local"' in html and 'id="local_shuffled"' in html
    assert html.count("<dt>attention within the window</dt>") == 2 * 4
