"""The analysis protocol end to end: a tiny analysis defined here goes through the registry, the
runner, merging, the tables, the command line and the report; the real analyses merge exactly and
do not depend on the batch size; a run does only the work its analyses need; the command starts
without torch; and imports point one way (library <- analyses <- app)."""

import ast
import json
import pickle
import re
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import numpy as np
import pandas as pd
import pytest
import torch
import transformers as tf
from models import SMALL, saved_bert
from streams import context, feed
from tokenizers_util import wordpiece
from typer.testing import CliRunner

import analyses
import probe
from analyses import Analysis, Schema
from analyses.probing import AttentionProbe
from analyses.roles import Roles
from analyses.syntax import Syntax
from probe.app.cli import app
from probe.inputs.corpus import Corpus
from probe.inputs.treebank import SAMPLE, Sentence, read_conllu
from probe.pipeline.runner import stream

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()
N_LAYERS, N_HEADS = SMALL["num_hidden_layers"], SMALL["num_attention_heads"]

# -- a tiny analysis, defined here ----------------------------------------------------------


class Diagonal(Analysis):
    """Per head, the mean attention a query token pays to itself."""

    name = "diagonal"
    title = "Self-attention"
    captures = ("hook_pattern",)
    tables: ClassVar[dict[str, Schema]] = {
        "diagonal": {"layer": "int", "head": "int", "self_attention": "float", "queries": "int"}
    }
    head_columns: ClassVar[Schema] = {"diagonal_self_attention": "float"}

    def __init__(self, context):
        super().__init__(context)
        self.sums = torch.zeros(context.n_layers, context.n_heads, dtype=torch.float64)
        self.queries = 0

    def begin_batch(self, batch):
        self.queries += int(batch.attention_mask.sum())

    def update(self, batch, layer, capture):
        diagonal = torch.diagonal(capture.pattern, dim1=-2, dim2=-1).double()  # [B, H, T]
        real = batch.attention_mask[:, None, :].double()  # padding queries do not count
        self.sums[layer] += (diagonal * real).sum((0, 2)).cpu()

    def merge(self, other):
        self._check_mergeable(other)
        self.sums += other.sums
        self.queries += other.queries

    def _tables(self):
        L, H = self.sums.shape
        layer, head = np.divmod(np.arange(L * H), H)
        mean = (self.sums.flatten() / max(self.queries, 1)).numpy()
        table = {"layer": layer, "head": head, "self_attention": mean, "queries": self.queries}
        return {"diagonal": pd.DataFrame(table)}

    @classmethod
    def heads(cls, tables, thresholds):
        table = tables["diagonal"]
        return pd.DataFrame(
            {
                "layer": table.layer,
                "head": table["head"],
                "diagonal_self_attention": table.self_attention,
            }
        )

    @classmethod
    def section(cls, tables, run):
        table = tables["diagonal"]
        best = table.loc[table.self_attention.idxmax()]
        return {
            "queries": int(table.queries.iloc[0]),
            "best": {"layer": int(best.layer), "head": int(best["head"])},
        }

    @classmethod
    def template(cls):
        return TEMPLATE


TEMPLATE = """\
{% macro section(s, run) %}
<p>Mean attention of a token to itself, over {{ s.data.queries }} query tokens; most: layer \
{{ s.data.best.layer }}, head {{ s.data.best.head }}.</p>
{% endmacro %}
{% macro card(r) %}
<dt>self-attention</dt><dd>{{ r.diagonal_self_attention | num(3) }}</dd>
{% endmacro %}
"""


@pytest.fixture
def registered(monkeypatch):
    """``diagonal`` in the registry: one line, as for an analysis of the package."""
    monkeypatch.setitem(analyses.REGISTRY, "diagonal", f"{__name__}:Diagonal")


# -- data -----------------------------------------------------------------------------------

# word/UPOS/0-based head/relation
TREES = [
    "The/DET/1/det cat/NOUN/2/nsubj sat/VERB/-1/root on/ADP/5/case the/DET/5/det "
    "mat/NOUN/2/obl ./PUNCT/2/punct",
    "She/PRON/1/nsubj gave/VERB/-1/root her/PRON/3/nmod brother/NOUN/1/iobj a/DET/6/det "
    "wonderful/ADJ/6/amod book/NOUN/1/obj yesterday/NOUN/1/obl ./PUNCT/1/punct",
    "The/DET/1/det dogs/NOUN/3/nsubj were/AUX/3/aux barking/VERB/-1/root at/ADP/5/case "
    "strangers/NOUN/3/obl ./PUNCT/3/punct",
    "Tokenization/NOUN/1/nsubj splits/VERB/-1/root rare/ADJ/3/amod words/NOUN/1/obj "
    "into/ADP/5/case pieces/NOUN/1/obl ./PUNCT/1/punct",
    "Unbelievably/ADV/5/advmod ,/PUNCT/5/punct the/DET/3/det dogs/NOUN/5/nsubj "
    "were/AUX/5/aux barking/VERB/-1/root",
    "The/DET/1/det cat/NOUN/2/nsubj sat/VERB/-1/root ./PUNCT/2/punct",
]


def sentence(tree: str) -> Sentence:
    words, upos, heads, relations = zip(*(w.rsplit("/", 3) for w in tree.split()), strict=True)
    return Sentence(list(words), [int(h) for h in heads], list(relations), list(upos))


SENTENCES = [sentence(t) for t in TREES] * 4  # 24 sentences, each its own index


@pytest.fixture(scope="module")
def tokenizer():
    return wordpiece()


@pytest.fixture(scope="module")
def bert():
    """A small random BERT whose vocabulary fits the test's WordPiece tokenizer (120 pieces)."""
    torch.manual_seed(0)
    config = tf.BertConfig(**SMALL | {"vocab_size": 200}, intermediate_size=64)
    return tf.BertModel(config).eval()


@pytest.fixture(scope="module")
def batches(tokenizer):
    return list(Corpus(SENTENCES, tokenizer, max_length=64).batches(batch_size=3))


def random_patterns(batch, seed: int) -> torch.Tensor:
    """Attention ``[batch, layer, head, q_pos, k_pos]``: rows sum to 1 over the real keys."""
    B, T = batch.input_ids.shape
    g = torch.Generator().manual_seed(seed)
    scores = 3 * torch.randn(B, N_LAYERS, N_HEADS, T, T, generator=g)
    real = batch.attention_mask.bool()[:, None, None, None, :]
    return scores.masked_fill(~real, -torch.inf).softmax(-1)


def split_and_merge(make, batches, patterns):
    """One instance fed every batch, and two fed the even and odd batches, merged; the odd one
    is pickled on the way, as it travels between processes (``probe.distributed``)."""
    whole, even, odd = make(), make(), make()
    for i, (batch, p) in enumerate(zip(batches, patterns, strict=True)):
        feed(whole, batch, p)
        feed(odd if i % 2 else even, batch, p)
    even.merge(pickle.loads(pickle.dumps(odd)))
    return whole, even


# -- 1. the tiny analysis through the whole protocol ----------------------------------------


def test_registered_analysis_streams_like_trace(registered, bert, batches):
    """``analyses.get`` finds the test's class; streamed over a model, its table equals the
    diagonal of the patterns ``probe.trace`` captures on the same batches."""
    cls = analyses.get("diagonal")
    assert cls is Diagonal
    analysis = cls(context(N_LAYERS, N_HEADS))
    stream(bert, batches, [analysis], cls.captures)
    table = analysis.finish()["diagonal"]

    sums, queries = torch.zeros(N_LAYERS, N_HEADS, dtype=torch.float64), 0
    for batch in batches:
        with torch.no_grad(), probe.trace(bert, "hook_pattern") as cache:
            bert(**batch.inputs)
        p = cache.stack("hook_pattern", dim=1)  # [B, layer, head, q, k]
        real = batch.attention_mask.bool()
        diagonal = torch.diagonal(p, dim1=-2, dim2=-1).permute(0, 3, 1, 2)[real]  # [query, L, H]
        sums += diagonal.double().sum(0)
        queries += int(real.sum())

    assert list(table.columns) == list(Diagonal.tables["diagonal"])
    assert (table.queries == queries).all()
    assert table.self_attention.nunique() == N_LAYERS * N_HEADS  # heads differ: a real check
    expected = (sums / queries).flatten().numpy()
    # The stream mixes a layer's output from its pattern (p·V) where the trace runs sdpa: the
    # later layers' patterns agree to float32 rounding (1.2e-9 relative here, averaged).
    np.testing.assert_allclose(table.self_attention.to_numpy(), expected, rtol=1e-7, atol=0)


@pytest.mark.slow
def test_tiny_analysis_merges_exactly(bert, batches):
    """Two instances streamed over disjoint halves of the batches, merged, give the table of one
    instance streamed over all of them (floats up to the order of float64 additions)."""
    ctx = context(N_LAYERS, N_HEADS)
    whole, first, second = Diagonal(ctx), Diagonal(ctx), Diagonal(ctx)
    stream(bert, batches, [whole])
    stream(bert, batches[::2], [first])
    stream(bert, batches[1::2], [second])
    first.merge(second)
    merged, expected = first.finish()["diagonal"], whole.finish()["diagonal"]
    pd.testing.assert_frame_equal(merged[["layer", "head", "queries"]],
                                  expected[["layer", "head", "queries"]])  # fmt: skip
    np.testing.assert_allclose(merged.self_attention, expected.self_attention, rtol=1e-12)


def test_finish_only_once(batches):
    """``finish`` a second time raises, and a finished analysis cannot merge either way."""
    ctx = context(N_LAYERS, N_HEADS)
    analysis, other = Diagonal(ctx), Diagonal(ctx)
    for i, batch in enumerate(batches):
        feed(analysis, batch, random_patterns(batch, i))
    assert len(analysis.finish()["diagonal"]) == N_LAYERS * N_HEADS
    with pytest.raises(RuntimeError, match="already finished"):
        analysis.finish()
    with pytest.raises(RuntimeError, match="finished cannot merge"):
        other.merge(analysis)
    with pytest.raises(RuntimeError, match="finished cannot merge"):
        analysis.merge(other)


def test_tiny_analysis_in_a_cli_run_and_its_report(registered, tmp_path):
    """``probe analyze --analyses diagonal,spectra``: diagonal.csv has its declared columns and
    types and counts every token, heads.csv carries its head column, index.html its section and
    a card entry per head; ``probe report`` draws the same page again from the tables."""
    folder = saved_bert(tmp_path / "bert")
    out = tmp_path / "report"
    args = ["analyze", "-m", str(folder), "-a", "diagonal,spectra", "-n", "12", "-t", "sample",
            "-o", str(out)]  # fmt: skip
    result = runner.invoke(app, [*args, "-q"])
    assert result.exit_code == 0, result.output

    run = json.loads((out / "run.json").read_text())
    assert run["analyses"] == ["diagonal", "spectra"]  # the order given
    diagonal = pd.read_csv(out / "diagonal.csv")
    dtypes = {"int": "int64", "float": "float64"}
    schema = Diagonal.tables["diagonal"]
    assert diagonal.dtypes.astype(str).to_dict() == {c: dtypes[k] for c, k in schema.items()}
    assert list(diagonal.columns) == list(schema)
    assert len(diagonal) == N_LAYERS * N_HEADS
    corpus = Corpus(read_conllu(SAMPLE), tf.AutoTokenizer.from_pretrained(folder), 512,
                    max_sentences=12)  # fmt: skip
    tokens = sum(int(b.attention_mask.sum()) for b in corpus.batches())
    assert (diagonal.queries == tokens).all() and run["sentences_analysed"] == 12

    heads = pd.read_csv(out / "heads.csv", keep_default_na=False)
    assert {"diagonal_self_attention", "qk_effective_rank", "roles"} <= set(heads.columns)
    joined = heads.merge(diagonal, on=["layer", "head"])
    assert len(joined) == N_LAYERS * N_HEADS
    assert (joined.diagonal_self_attention == joined.self_attention).all()

    index = out / "index.html"
    html = index.read_text()
    assert 'id="diagonal"' in html and 'href="#diagonal"' in html
    assert f"over {tokens} query tokens" in html
    assert html.count("<dt>self-attention</dt>") == N_LAYERS * N_HEADS
    index.unlink()
    result = runner.invoke(app, ["report", str(out)])
    assert result.exit_code == 0, result.output
    assert index.read_text() == html


# -- 2. the real analyses merge exactly -----------------------------------------------------


@pytest.fixture(scope="module")
def patterns(batches):
    return [random_patterns(batch, seed=i) for i, batch in enumerate(batches)]


@pytest.mark.slow
def test_syntax_merges_exactly(batches, patterns):
    """Syntax: merged counts, best heads and bootstrap intervals equal one pass's exactly (each
    sentence's bootstrap weights are keyed to its index, and the weighted counts are integers)."""
    whole, merged = split_and_merge(lambda: Syntax(context(N_LAYERS, N_HEADS), n_boot=50),
                                    batches, patterns)  # fmt: skip
    assert merged.sentences == whole.sentences == len(SENTENCES)
    expected, got = whole.finish(), merged.finish()
    assert expected["syntax"].correct.sum() > 0
    for name in ("syntax", "syntax_baselines", "syntax_best"):
        pd.testing.assert_frame_equal(got[name], expected[name], check_exact=True)
    assert (expected["syntax_best"].ci_high > expected["syntax_best"].ci_low).any()


@pytest.mark.slow
def test_roles_merge_exactly(batches, patterns):
    """Roles: merged counters equal one pass's exactly and the statistics up to float64
    rounding; with every query sampled, head similarity does not depend on the sampling."""
    make = lambda: Roles(context(N_LAYERS, N_HEADS), js_query_share=1.0)  # noqa: E731
    whole, merged = split_and_merge(make, batches, patterns)
    for name in ("queries", "normalisable", "cls_rows", "js_queries"):
        assert getattr(merged, name) == getattr(whole, name), name
    assert whole.js_queries == whole.queries == sum(int(b.attention_mask.sum()) for b in batches)
    expected, got = whole.finish(), merged.finish()
    pd.testing.assert_frame_equal(
        got["head_stats"], expected["head_stats"], check_exact=False, rtol=1e-12, atol=1e-15
    )
    # the sampled queries come in another order: float32 sums within a batch differ in the last bit
    pd.testing.assert_frame_equal(
        got["head_similarity"], expected["head_similarity"], check_exact=False, rtol=1e-5
    )

    # Sampled: each query is drawn by its sentence and position, so the same ones either way.
    make = lambda: Roles(context(N_LAYERS, N_HEADS), js_query_share=0.25)  # noqa: E731
    whole, merged = split_and_merge(make, batches, patterns)
    assert 0 < merged.js_queries == whole.js_queries < whole.queries / 2
    expected, got = whole.finish(), merged.finish()
    pd.testing.assert_frame_equal(
        got["head_similarity"], expected["head_similarity"], check_exact=False, rtol=1e-5
    )


def make_probe():
    """A probe whose budgets are small enough that both samples evict as they fill."""
    return AttentionProbe(context(N_LAYERS, N_HEADS), held_out=0.5, max_train_pairs=60,
                          max_eval_sentences=4)  # fmt: skip


@pytest.mark.slow
def test_attention_probe_merges_exactly(batches, patterns):
    """AttentionProbe: every random choice is keyed to the sentence, so two instances fed the
    even and the odd batches, merged (either way round), give one pass's table exactly."""
    whole, merged = split_and_merge(make_probe, batches, patterns)
    assert merged.seen == whole.seen > whole.capacity == 60  # the training sample evicted
    assert len(merged.held) == len(whole.held) == 4
    expected = whole.finish()["probe"]
    assert list(expected.parser) == ["attention_probe", "right_branching", "best_single_head"]
    assert expected.words.iloc[0] > 0
    pd.testing.assert_frame_equal(merged.finish()["probe"], expected, check_exact=True)

    even, odd = make_probe(), make_probe()
    for i, (batch, p) in enumerate(zip(batches, patterns, strict=True)):
        feed(odd if i % 2 else even, batch, p)
    odd.merge(even)
    pd.testing.assert_frame_equal(odd.finish()["probe"], expected, check_exact=True)


# -- 3. the probe does not depend on the batch size -----------------------------------------


@pytest.mark.slow
def test_attention_probe_does_not_depend_on_batch_size(bert, tokenizer):
    """The same corpus streamed through a model in batches of 2 and of 5 gives the same probe
    table: the same sentences held out, the same pairs sampled, the same counts and UAS."""
    corpus = Corpus(SENTENCES, tokenizer, max_length=64)
    tables = []
    for batch_size in (2, 5):
        analysis = make_probe()
        stream(bert, corpus.batches(batch_size), [analysis])
        tables.append(analysis.finish()["probe"])
    small, large = tables
    assert len(small) == 3 and small.words.iloc[0] > 0
    counts = ["parser", "layer", "head", "direction", "correct", "words", "sentences",
              "train_pairs", "train_pairs_seen"]  # fmt: skip
    pd.testing.assert_frame_equal(small[counts], large[counts], check_exact=True)
    assert small.uas.tolist() == large.uas.tolist()


# -- 4. a weights-only run ------------------------------------------------------------------


@pytest.mark.slow
def test_weights_only_run_reads_no_treebank_and_runs_no_forward(tmp_path, monkeypatch, minilm):
    """``--analyses spectra`` with a treebank that does not exist: the run succeeds, records no
    treebank, and neither reads a corpus, streams, nor calls any module of the model."""
    import probe.inputs.corpus
    import probe.inputs.treebank
    import probe.pipeline.loading
    import probe.pipeline.runner

    def forbidden(*args, **kwargs):
        raise AssertionError("a weights-only run must not get here")

    monkeypatch.setattr(probe.pipeline.runner, "stream", forbidden)
    monkeypatch.setattr(probe.inputs.corpus, "Corpus", forbidden)
    monkeypatch.setattr(probe.inputs.treebank, "treebank_paths", forbidden)
    monkeypatch.setattr(probe.inputs.treebank, "iter_treebank", forbidden)
    load, calls = probe.pipeline.loading.load, []

    def load_watched(*args, **kwargs):
        model, tokenizer = load(*args, **kwargs)
        for module in model.modules():
            module.register_forward_pre_hook(lambda module, inputs: calls.append(module))
        return model, tokenizer

    monkeypatch.setattr(probe.pipeline.loading, "load", load_watched)
    out = tmp_path / "spectra"
    args = ["--analyses", "spectra", "--treebank", "/no/such/file.conllu", "-o", str(out), "-q"]
    result = runner.invoke(app, ["analyze", "--model", "minilm", *args])
    assert result.exit_code == 0, result.output
    run = json.loads((out / "run.json").read_text())
    assert run["treebank"] == [] and run["sentences_read"] == 0
    assert run["analyses"] == ["spectra"] and run["layers"] == 6
    assert calls == []
    assert len(pd.read_csv(out / "spectra.csv")) == 2 * 6 * 12


# -- 5. a lean start-up ---------------------------------------------------------------------

HEAVY = ("torch", "transformers", "sklearn", "matplotlib", "seaborn", "pandas")
RUN_CLI = f"""
import sys
from probe.app.cli import app
import probe
try:
    app(sys.argv[1:], prog_name="probe")
    code = 0
except SystemExit as e:
    code = e.code
print("exit", code, *sorted(set({HEAVY!r}) & set(sys.modules)))
"""


def test_importing_the_command_and_the_package_loads_nothing_heavy():
    """``import probe.app.cli`` and ``import probe`` load none of torch, transformers, sklearn,
    matplotlib, seaborn or pandas."""
    code = f"import sys, probe.app.cli, probe; print(*sorted(set({HEAVY!r}) & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == ""


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--help"], 0, "analyze"),
        (["analyze", "--help"], 0, "--max-sentences"),
        (["analyze", "-m", "x", "--dtype", "float8"], 1, "unknown --dtype"),
        (["analyze", "-m", "x", "--analyses", "magic"], 1, "unknown analysis magic"),
    ],
)
@pytest.mark.slow
def test_the_command_answers_without_torch(tmp_path, args, code, message):
    """Help and options that are wrong on their face are answered before anything heavy is
    imported, in-process and by the ``probe`` console script alike."""
    done = subprocess.run([sys.executable, "-c", RUN_CLI, *args], capture_output=True,
                          text=True, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == f"exit {code}"  # exit code, no heavy module
    assert message in done.stdout + done.stderr
    script = Path(sys.executable).with_name("probe")
    done = subprocess.run([script, *args], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == code
    assert message in done.stdout + done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "reports").exists()


# -- 6. imports point one way ---------------------------------------------------------------

MODULE_NAME = re.compile(r"(analyses|probe\.app)([.:][\w.:]*)?")


def imported(path: Path, root: Path = ROOT) -> set[str]:
    """Every module ``path`` imports, anywhere in it (functions and TYPE_CHECKING blocks too,
    relative imports resolved), and strings that name a module of ours (dynamic imports)."""
    package = path.relative_to(root).parts[:-1]  # of a module and of an __init__.py alike
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names |= {module, *(f"{module}.{alias.name}" for alias in node.names)}
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and MODULE_NAME.fullmatch(node.value)
        ):
            names.add(node.value.split(":")[0])
    return names


def imports_of(path: Path, *forbidden: str, root: Path = ROOT) -> list[str]:
    return sorted(
        name
        for name in imported(path, root)
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    )


def test_the_library_knows_no_analysis_and_no_app():
    """No module of ``probe`` outside the app (``probe/app``, ``probe/plot.py`` and
    ``probe/__main__.py``, ``python -m probe``) imports ``analyses``, ``probe.app`` or
    ``probe.plot``, and no module of ``analyses`` imports the app."""
    app = {ROOT / "probe" / "plot.py", ROOT / "probe" / "__main__.py"}
    library = [
        p for p in (ROOT / "probe").rglob("*.py") if "app" not in p.parent.parts and p not in app
    ]
    assert len(library) >= 10 and ROOT / "probe" / "pipeline" / "runner.py" in library
    wrong = {
        str(p.relative_to(ROOT)): imports_of(p, "analyses", "probe.app", "probe.plot")
        for p in library
    }
    assert {k: v for k, v in wrong.items() if v} == {}
    modules = list((ROOT / "analyses").rglob("*.py"))
    assert len(modules) >= 5
    wrong = {str(p.relative_to(ROOT)): imports_of(p, "probe.app", "probe.plot") for p in modules}
    assert {k: v for k, v in wrong.items() if v} == {}


def test_the_import_check_sees_imports(tmp_path):
    """The check above finds what it looks for: the app's imports of analyses, and a relative,
    a nested, a ``from probe import app`` and a dynamic import in a module written here."""
    assert "analyses" in imports_of(ROOT / "probe" / "app" / "plan.py", "analyses")
    module = tmp_path / "probe" / "sneaky.py"
    module.parent.mkdir()
    module.write_text(
        "from probe import app\n"
        "def f():\n"
        "    from .app import report\n"
        "    import importlib\n"
        "    return importlib.import_module('analyses.syntax')\n"
    )
    found = imports_of(module, "analyses", "probe.app", root=tmp_path)
    assert found == ["analyses.syntax", "probe.app", "probe.app.report"]


def test_two_analyses_adding_the_same_head_column_fail_before_any_compute():
    """heads.csv is a join: a column name two analyses share is refused up front."""
    from probe.app.tables import heads_schema

    class Clash(Diagonal):
        name = "clash"
        head_columns: ClassVar[Schema] = {"entropy": "float"}

    with pytest.raises(ValueError, match=r"'entropy'.*roles analysis"):
        heads_schema([Roles, Clash])


@pytest.mark.slow
def test_the_python_api_runs_the_default_analyses_and_leaves_the_collector_alone(tmp_path):
    """probe.app.analyze.analyze with the default Settings leaves out what does not apply to the
    model (cross-attention, on BERT) without complaint, and hands the garbage collector back
    as it found it."""
    import gc

    from probe.app.analyze import analyze as run_analyze
    from probe.app.plan import Settings

    folder = saved_bert(tmp_path / "bert")
    before = gc.isenabled(), gc.get_freeze_count()
    settings = Settings(model=str(folder), treebank=["sample"], out=tmp_path / "r",
                        max_sentences=8)  # fmt: skip
    path = run_analyze(settings)
    assert (gc.isenabled(), gc.get_freeze_count()) == before
    assert "cross" not in json.loads((path / "run.json").read_text())["analyses"]
    with pytest.raises(probe.ProbeError, match="--analyses cross: cross-attention needs"):
        run_analyze(Settings(model=str(folder), treebank=["sample"], out=tmp_path / "c",
                             analyses=["cross"], max_sentences=8))  # fmt: skip
