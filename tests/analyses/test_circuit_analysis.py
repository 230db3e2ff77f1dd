"""``probe analyze -a circuit`` on the induction model (tests/support/induction.py): the induction
heads rank high by attribution and by exact patching, the previous-token head feeds their keys and
composes with them most, a quarter of the edges keep 80% of the behaviour; a task file's metric
against one computed here; and the one-line errors."""

import json
import math
import re

import numpy as np
import pandas as pd
import pytest
import torch
from induction import INDUCTION, MODEL, PREVIOUS_TOKEN
from typer.testing import CliRunner

from analyses.circuit import Circuit
from analyses.circuit.task import file_task, repeats_task
from probe.app.cli import app

runner = CliRunner()
# all four layer-1 heads do it (tests/support/induction.py)
INDUCTION_HEADS = {(1, h) for h in range(4)}
MISSING = "/nonexistent/model-folder"  # a check after loading would report this instead


def analyze(*args: str):
    return runner.invoke(app, ["analyze", "-t", "sample", "-q", *args])


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("circuit") / "r"
    result = analyze("--model", str(MODEL), "-a", "circuit", "--lm-head", "--out", str(out))
    assert result.exit_code == 0, result.output
    return out


def test_tables_have_their_columns(report):
    for name, schema in Circuit.tables.items():
        table = pd.read_csv(report / f"{name}.csv", keep_default_na=False)
        assert list(table.columns) == list(schema), name
        assert len(table), name
    heads = pd.read_csv(report / "heads.csv")
    assert {"circuit_attribution", "circuit_effect"} <= set(heads.columns)
    html = (report / "index.html").read_text()
    assert 'id="circuit' in html or "Circuit" in html
    assert html.count("<svg") >= 2 and "Faithfulness curve" in html


def test_induction_heads_rank_high(report):
    heads = pd.read_csv(report / "circuit_heads.csv").set_index(["layer", "head"])
    assert heads.patched.all()  # 8 heads, at most 24 patched: every one
    by_patching = set(heads.effect.nlargest(4).index)
    by_attribution = set(heads.attribution.abs().nlargest(4).index)
    print(heads[["attribution", "effect", "effect_low", "effect_high"]].round(3).to_string())
    assert by_patching == INDUCTION_HEADS and by_attribution == INDUCTION_HEADS
    assert (heads.loc[list(INDUCTION_HEADS), "effect_low"] > 0).all()
    assert heads.loc[INDUCTION, "in_circuit"]
    # The attribution's ranking against exact patching, on the same pairs.
    run = pd.read_csv(report / "circuit_run.csv").iloc[0]
    ranks = [heads[c].rank() for c in ("attribution", "effect")]
    assert run.spearman == pytest.approx(ranks[0].corr(ranks[1]))
    assert run.spearman > 0.5


def test_the_page_names_the_heads_attribution_misses(report):
    """The previous-token head acts through the induction heads' attention: its attribution
    (AtP) is near 0 where exact patching's effect is about −2, outside the interval by more than
    half the effect, and the page names it, with the sentence that says why; the induction
    heads, where AtP is close, are not named."""
    from analyses.circuit import missed

    heads = pd.read_csv(report / "circuit_heads.csv")
    named = set(zip(*[missed(heads)[c] for c in ("layer", "head")], strict=True))
    print(heads[["layer", "head", "attribution", "effect", "effect_low", "effect_high"]])
    assert PREVIOUS_TOKEN in named and not named & INDUCTION_HEADS
    html = (report / "index.html").read_text()
    said = re.search(r"Attribution misses (.*?): outside exact patching's interval by more "
                     r"than 50\.0% of the effect\.", html)  # fmt: skip
    assert said and ">{}-{}</a>".format(*PREVIOUS_TOKEN) in said.group(1)
    assert "A linear estimate such as attribution misses effects that act through later" in html


def test_a_miss_is_outside_the_interval_by_more_than_half_the_effect():
    from analyses.circuit import missed

    heads = pd.DataFrame({
        "layer": [0, 0, 1, 1], "head": [0, 1, 0, 1], "patched": [True, True, True, False],
        "attribution": [-0.08, -1.0, 0.9, 5.0], "effect": [-1.95, -2.0, 1.0, math.nan],
        "effect_low": [-2.3, -2.4, 0.8, math.nan], "effect_high": [-1.6, -1.6, 1.2, math.nan],
    })  # fmt: skip
    # 1.52 outside for a −1.95 effect: named; 0.6 outside for −2.0: not; inside: not; unpatched
    assert missed(heads)[["layer", "head"]].values.tolist() == [[0, 0]]


def test_previous_token_head_feeds_the_induction_keys(report):
    edges = pd.read_csv(report / "circuit_edges.csv", keep_default_na=False)
    keys = edges[(edges.input == "k") & edges.sender.str.startswith("0-")]
    previous = "{}-{}".format(*PREVIOUS_TOKEN)
    for receiver in sorted({f"1-{h}" for _, h in INDUCTION_HEADS}):
        into = keys[keys.receiver == receiver]
        assert into.loc[into.score.idxmax()].sender == previous, receiver
    composition = pd.read_csv(report / "circuit_composition.csv")
    k = composition[(composition.kind == "K") & (composition.layer_from == 0)]
    for (_, head), into in k.groupby(["layer_to", "head_to"]):
        best = into.loc[into.score.idxmax()]
        assert (best.layer_from, best.head_from) == PREVIOUS_TOKEN, head
        assert best.score > best.baseline


def test_circuit_reaches_faithfulness_with_a_quarter_of_the_edges(report):
    curve = pd.read_csv(report / "circuit_faithfulness.csv").set_index("edges")
    run = pd.read_csv(report / "circuit_run.csv").iloc[0]
    total = int(curve.total_edges.iloc[0])
    chosen = int(run.chosen_edges)
    assert curve.faithfulness[chosen] >= 0.8 > curve.faithfulness[chosen - 1]
    assert chosen <= total / 4
    assert curve.faithfulness[0] == pytest.approx(0, abs=1e-6)
    assert curve.faithfulness[total] == pytest.approx(1, abs=1e-6)
    edges = pd.read_csv(report / "circuit_edges.csv", keep_default_na=False)
    assert edges.in_circuit.sum() == chosen == run.chosen_edges


def test_repeats_task_pairs():
    """Clean BOS + A + A, corrupted BOS + A' + A; the metric reads the second copy's
    predictable tokens, computed here one position at a time."""
    from transformers import AutoTokenizer, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    clean, corrupted, metric = repeats_task(tokenizer, 0, 3, 5, 128)
    ids, other = clean["input_ids"], corrupted["input_ids"]
    assert ids.shape == other.shape == (3, 11)
    assert (ids[:, 0] == 0).all() and torch.equal(ids[:, 1:6], ids[:, 6:])
    assert torch.equal(other[:, 6:], ids[:, 6:]) and not torch.equal(other[:, 1:6], ids[:, 1:6])
    model = GPT2LMHeadModel.from_pretrained(MODEL).eval()
    with torch.no_grad():
        logits = model(**clean).logits
    expected = [
        sum(torch.log_softmax(logits[b, i], -1)[ids[b, i + 1]] for i in range(6, 10)) / 4
        for b in range(3)
    ]
    torch.testing.assert_close(metric(model(**clean).logits), torch.stack(expected))


def test_task_file_metric(tmp_path):
    """A logit difference at each pair's last real position, pairs of different lengths padded
    alike; without ``wrong``, the answer's log-probability."""
    from transformers import AutoTokenizer, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = GPT2LMHeadModel.from_pretrained(MODEL).eval()
    lines = [
        {"clean": "t5 t6 t7 t5 t6", "corrupted": "t9 t6 t7 t5 t6", "answer": "t7", "wrong": "t9"},
        {"clean": "t3 t4 t3", "corrupted": "t8 t4 t3", "answer": "t4", "wrong": "t8"},
    ]
    path = tmp_path / "task.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in lines) + "\n")
    clean, corrupted, metric, kind = file_task(path, tokenizer, 16, 128)
    assert "logit difference" in kind
    assert torch.equal(clean["attention_mask"], corrupted["attention_mask"])
    with torch.no_grad():
        values = metric(model(**clean).logits)
        for b, (row, last, answer, wrong) in enumerate([(lines[0], 5, 7, 9), (lines[1], 3, 4, 8)]):
            alone = model(**tokenizer(row["clean"], return_tensors="pt")).logits[0, last]
            assert math.isclose(float(values[b]), float(alone[answer] - alone[wrong]), abs_tol=1e-4)
    for row in lines:
        del row["wrong"]
    path.write_text("\n".join(json.dumps(row) for row in lines))
    _, _, metric, kind = file_task(path, tokenizer, 1, 128)
    assert "log-probability" in kind
    with torch.no_grad():
        logp = torch.log_softmax(model(**tokenizer(lines[0]["clean"], return_tensors="pt"))
                                 .logits[0, 5], -1)  # fmt: skip
        one = {k: v[:1] for k, v in clean.items()}
        value = metric(model(**one).logits, pairs=slice(0, 1))[0]  # the pair the logits hold
        assert math.isclose(float(value), float(logp[7]), abs_tol=1e-4)


@pytest.mark.parametrize("model", [str(MODEL), MISSING])
def test_without_the_lm_head_one_line_says_to_add_it(tmp_path, model):
    """Said when the run is planned: for a model that does not exist, a check after loading
    would report that instead."""
    result = analyze("--model", model, "-a", "circuit", "--out", str(tmp_path / "r"))
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "--lm-head" in lines[0] and "circuit" in lines[0], lines
    assert not (tmp_path / "r").exists()


@pytest.fixture(scope="module")
def base_only(tmp_path_factory):
    """The induction model saved without its head (``GPT2Model``): loaded with one, GPT-2 ties
    it to the embeddings, a head the checkpoint never held."""
    from transformers import AutoTokenizer, GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("base") / "gpt2-base"
    GPT2LMHeadModel.from_pretrained(MODEL).transformer.save_pretrained(folder)
    AutoTokenizer.from_pretrained(MODEL).save_pretrained(folder)
    return folder


def test_a_checkpoint_without_a_head_is_refused_before_it_loads(tmp_path, base_only):
    """One line naming the classes config.json names, before the model loads: with its weights
    cut, the load would report a damaged file instead."""
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "config.json").write_text((base_only / "config.json").read_text())
    (damaged / "model.safetensors").write_bytes(b"\x08not a safetensors file")
    for model in (base_only, damaged, "minilm"):
        result = analyze("--model", str(model), "-a", "circuit", "--lm-head", "--out",
                         str(tmp_path / "r"))  # fmt: skip
        assert result.exit_code == 1, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1, lines
        said = "BertModel" if model == "minilm" else "GPT2Model"
        assert "no language-model head" in lines[0] and said in lines[0], lines
        assert "circuit" in lines[0] and not (tmp_path / "r").exists()


PLANNED = """
import sys
from probe.app.plan import Settings, plan
from probe.errors import ProbeError
for model, lm_head in (({model!r}, True), ({good!r}, False)):
    try:
        plan(Settings(model, treebank=["sample"], analyses=["circuit"], lm_head=lm_head,
                       out={out!r}))
    except ProbeError as e:
        print(e)
    else:
        raise AssertionError(model)
assert "torch" not in sys.modules, "torch imported at plan time"
"""


def test_the_refusal_is_planned_without_torch(tmp_path, base_only):
    import subprocess
    import sys

    code = PLANNED.format(model=str(base_only), good=str(MODEL), out=str(tmp_path / "r"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    head, flag = done.stdout.strip().splitlines()
    assert "no language-model head" in head and "--lm-head" in flag


def test_a_head_tied_to_the_embeddings_is_refused_after_loading_too(base_only):
    """Where the plan could not read the config (a hub model not yet downloaded), the loaded
    model's config says the same."""
    from probe.pipeline.loading import load

    model, _ = load(str(base_only), lm_head=True)
    assert model.get_output_embeddings() is not None  # tied: the load itself accepts it
    reason = Circuit.unsupported(model)
    assert reason is not None and "GPT2Model" in reason and "no language-model head" in reason


@pytest.mark.parametrize(
    ("content", "said"),
    [
        ('{"clean": "t1 t2", "corrupted": "t3 t2"}\n', "line 1: no field 'answer'"),
        ('{"clean": "t1", "corrupted": "t3", "answer": "t2"}\n{"clean": ', "line 2: not JSON"),
        ('{"clean": "t1", "corrupted": "t3", "answer": 2}\n', "line 1: field 'answer' must be"),
        ('{"clean": "a", "corrupted": "b", "answer": "c", "wrong": "d"}\n'
         '{"clean": "a", "corrupted": "b", "answer": "c"}\n', "line 2: field 'wrong'"),
        ("[" * 100_000 + "\n", "line 1: not JSON that can be read (maximum recursion"),
        ('{"clean": "a", "corrupted": "b", "answer": "c", "n": ' + "9" * 5000 + "}\n",
         "line 1: not JSON that can be read (Exceeds the limit"),
        (bytes(range(256)), "cannot read it ('utf-8' codec"),
        ("", "no pairs"),
        ("[1, 2]\n", "line 1: not a JSON object"),
        ('{"clean": null, "corrupted": "b", "answer": "c"}\n', "field 'clean' must be"),
        # U+2028 is a line separator to str.splitlines, not to JSON: line 2 is the one at fault
        ('{"clean": "a\u2028b", "corrupted": "b", "answer": "c"}\n{"x": 1}\n',
         "line 2: no field 'clean'"),
    ],
)  # fmt: skip
def test_a_bad_task_file_is_one_line_before_the_model_loads(tmp_path, content, said):
    path = tmp_path / "task.jsonl"
    path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    result = analyze("--model", MISSING, "-a", "circuit", "--lm-head", "--task", str(path),
                     "--out", str(tmp_path / "r"))  # fmt: skip
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and said in lines[0], lines


def test_the_section_is_drawn_again_from_the_tables(report):
    """``probe report`` draws the same section from the CSV files (the edges' empty ``input``
    of an MLP or the logits included)."""

    def section(html: str) -> str:
        start = html.index('<section id="circuit"')
        return html[start : html.index("</section>", start)]

    before = section((report / "index.html").read_text())
    result = runner.invoke(app, ["report", str(report)])
    assert result.exit_code == 0, result.output
    assert section((report / "index.html").read_text()) == before


def test_probe_figures_and_probe_plot_draw_the_graph_and_the_curve(report, tmp_path):
    """``probe figures`` writes both figures; ``probe.plot`` draws the tables' values: one line
    per edge drawn, between the places of its sender and receiver, and the faithfulness curve's
    points."""
    import matplotlib.pyplot as plt
    import numpy as np

    from analyses.circuit.figures import DRAWN_EDGES, place
    from probe import plot

    result = runner.invoke(app, ["figures", str(report), "-f", "svg", "-o", str(tmp_path / "f")])
    assert result.exit_code == 0, result.output
    files = {p.name for p in (tmp_path / "f").iterdir() if not p.name.startswith(".")}
    # the qk analysis follows the circuit: its heads' splits
    assert files == {"circuit-graph.svg", "circuit-faithfulness.svg", "circuit-ablations.svg",
                     "circuit-pairs.svg", "qk-sources.svg"}  # fmt: skip

    edges = pd.read_csv(report / "circuit_edges.csv", keep_default_na=False)
    kept = edges[edges.in_circuit]
    drawn = kept.loc[kept.score.abs().sort_values(ascending=False).index[:DRAWN_EDGES]]
    ax = plot.circuit_graph(report)
    lines = {tuple(np.round(np.r_[line.get_xdata(), line.get_ydata()], 6))
             for line in ax.get_lines() if len(line.get_xdata()) == 2}  # fmt: skip
    expected = set()
    for row in drawn.itertuples():
        (x1, y1), (x2, y2) = place(row.sender, 2, 4), place(row.receiver, 2, 4)
        expected.add(tuple(np.round([x1, x2, y1, y2], 6)))
    assert lines == expected and len(drawn) == min(len(kept), DRAWN_EDGES)

    curve = pd.read_csv(report / "circuit_faithfulness.csv")
    ax = plot.circuit_faithfulness(plot.tables(report))
    (points, *_) = ax.get_lines()
    np.testing.assert_array_equal(points.get_xdata(), curve.edges)
    np.testing.assert_array_equal(points.get_ydata(), curve.faithfulness)
    plt.close("all")


def test_the_page_opens_with_the_circuit(report):
    """The overview states the circuit (edges kept of all, the faithfulness reached, its heads)
    from the tables; no grid of roles the run did not test; the run card says the circuit read
    its task's pairs, and accounts its time where it was spent (finishing)."""
    html = (report / "index.html").read_text()
    info = pd.read_csv(report / "circuit_run.csv").iloc[0]
    heads = pd.read_csv(report / "circuit_heads.csv")
    inside = heads[heads.in_circuit].sort_values("attribution_rank")
    overview = html[html.index('<section id="overview">') :]
    overview = overview[: overview.index("</section>")]
    text = re.sub(r" ([,.;)])", r"\1", " ".join(re.sub(r"<[^>]+>", " ", overview).split()))
    kept, total = int(info.chosen_edges), int(info.total_edges)
    assert f"{kept} of {total} edges" in text
    assert f"faithfulness {info.faithfulness:.2f}, reaching the {info.target:.2f}" in text
    named = ", ".join(f"{r.layer}-{r.head}" for r in inside.itertuples())
    assert f"{len(inside)} heads are in it: {named}." in text
    assert set(inside.itertuples(index=False, name=None)) and INDUCTION in {
        (r.layer, r.head) for r in inside.itertuples()
    }
    assert 'class="grid"' not in overview and "tests a head for a role" in text
    assert html.index('<section id="overview">') < html.index('<section id="run">')
    card = html[html.index('<section id="run">') :]
    card = " ".join(re.sub(r"<[^>]+>", " ", card).split())
    assert f"circuit: {int(info.pairs)} prompt pairs of the repeats task" in card
    assert "weights only" not in card and "circuit" in card.split("finishing the analyses")[1]
    run = json.loads((report / "run.json").read_text())
    assert (
        run["finish_s"]["circuit"] > 0 and run["timings_s"]["analyses"] < run["finish_s"]["circuit"]
    )


def test_a_task_file_with_a_byte_order_mark_or_windows_lines_is_read(tmp_path):
    from analyses.circuit.task import read_task

    path = tmp_path / "task.jsonl"
    path.write_bytes('\ufeff{"clean": "a", "corrupted": "b", "answer": "c"}\r\n\r\n'.encode())
    assert [(p.line, p.clean, p.answer) for p in read_task(path)] == [(1, "a", "c")]


@pytest.mark.parametrize("kind", ["folder", "pipe"])
def test_a_task_that_is_not_a_file_is_one_line_and_does_not_wait(tmp_path, kind):
    """A named pipe would block the run until something wrote to it."""
    import os

    path = tmp_path / "task.jsonl"
    path.mkdir() if kind == "folder" else os.mkfifo(path)
    result = analyze("--model", MISSING, "-a", "circuit", "--lm-head", "--task", str(path),
                     "--out", str(tmp_path / "r"))  # fmt: skip
    assert result.exit_code == 1 and "not a regular file" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1


def test_too_few_pairs_is_one_line_before_the_model_loads(tmp_path):
    """No most: the runs take the pairs a chunk at a time within probe's budget
    (tests/interventions/test_budget.py); fewer than two pairs give no interval."""
    result = analyze("--model", MISSING, "-a", "circuit", "--lm-head", "--circuit-pairs",
                     "1", "--out", str(tmp_path / "r"))  # fmt: skip
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "--circuit-pairs" in lines[0] and "2" in lines[0], lines


@pytest.mark.slow
def test_a_task_file_of_twenty_thousand_pairs_reads_its_first_ones(tmp_path):
    """The file is checked whole, line by line; the analysis tokenizes and runs only the first
    --circuit-pairs, so what it holds does not grow with the file."""
    line = json.dumps({"clean": "t1 t2 t3 t4", "corrupted": "t5 t2 t3 t4", "answer": " t2"})
    path = tmp_path / "task.jsonl"
    path.write_text((line + "\n") * 20_000)
    out = tmp_path / "r"
    result = analyze("--model", str(MODEL), "-a", "circuit", "--lm-head", "--task", str(path),
                     "--circuit-pairs", "4", "--out", str(out))  # fmt: skip
    assert result.exit_code == 0, result.output
    assert int(pd.read_csv(out / "circuit_run.csv").pairs[0]) == 4


@pytest.mark.parametrize(
    ("pair", "said"),
    [
        ({"clean": "t1 t2 t3", "corrupted": "t4 t2", "answer": "t3"}, "clean is 4 tokens"),
        ({"clean": "t1 t2", "corrupted": "t4 t2", "answer": "t3 t5"}, "answer 't3 t5' is 2"),
        ({"clean": " ".join(["t1"] * 200), "corrupted": " ".join(["t2"] * 200), "answer": "t3"},
         "201 tokens, more than the model's 128"),
    ],
)  # fmt: skip
def test_what_the_tokenizer_shows_is_refused_before_the_weights_load(
    tmp_path, monkeypatch, pair, said
):
    """A task file's pairs are tokenized as soon as the tokenizer is loaded, before the weights:
    here loading them would fail the test."""
    import probe.pipeline.loading

    def weights(*args, **kwargs):
        raise AssertionError("the weights were loaded before the task was checked")

    monkeypatch.setattr(probe.pipeline.loading, "_with_lm_head", weights)
    path = tmp_path / "task.jsonl"
    path.write_text(json.dumps(pair) + "\n")
    result = analyze("--model", str(MODEL), "-a", "circuit", "--lm-head", "--task", str(path),
                     "--out", str(tmp_path / "r"))  # fmt: skip
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and said in lines[0], lines
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_more_pairs_than_memory_holds_give_the_same_tables(tmp_path):
    """1100 pairs (more than the cap the analysis once had) run a few at a time within
    --circuit-max-bytes 2 MiB, and give the tables that every pair at once gives (the default
    budget), to float32 rounding."""
    rows = [json.dumps({"clean": f"t{a} t2 t3 t{a} t2", "corrupted": f"t{63 - a} t2 t3 t{a} t2",
                        "answer": "t3"}) for a in range(4, 60)]  # fmt: skip
    path = tmp_path / "task.jsonl"
    path.write_text("".join(rows[i % len(rows)] + "\n" for i in range(1100)))
    tables = {}
    for budget in ("2097152", str(1 << 30)):
        out = tmp_path / budget
        result = analyze("--model", str(MODEL), "-a", "circuit", "--lm-head", "--task", str(path),
                         "--circuit-pairs", "1100", "--circuit-max-bytes", budget,
                         "--out", str(out))  # fmt: skip
        assert result.exit_code == 0, result.output
        tables[budget] = {n: pd.read_csv(out / f"{n}.csv")
                          for n in ("circuit_heads", "circuit_edges", "circuit_run")}  # fmt: skip
    small, whole = tables.values()
    assert int(small["circuit_run"].pairs[0]) == 1100
    for name, table in whole.items():
        for column in table.columns:
            if table[column].dtype.kind == "f":
                scale = max(1.0, float(table[column].abs().max()))
                np.testing.assert_allclose(small[name][column], table[column], rtol=1e-4,
                                           atol=1e-5 * scale)  # fmt: skip
            elif column != "in_circuit":
                assert small[name][column].tolist() == table[column].tolist(), (name, column)


def test_a_run_without_a_treebank_says_nothing_of_one(report):
    """The circuit reads its own pairs, no treebank, and tests no role: the page says nothing of
    treebank sentences, gold arcs or the syntax correction, gives each layer its heads, not
    "4 no role", and the command line does not print "0 sentences"."""
    from rich.console import Console

    from probe.app.console import summary

    html = (report / "index.html").read_text()
    for text in ("gold arcs", "sentences of the treebank", "Benjamini", "no role"):
        assert text not in html, text
    assert re.search(r"<b>Layer 0</b>: 4 heads</summary>", html)
    console = Console(record=True, width=400, color_system=None)
    summary(console, report)
    first = console.export_text().splitlines()[0]
    assert "sentences" not in first and "2 layers x 4 heads" in first, first


def test_the_figures_axis_ends_at_the_total_with_the_target_drawn_and_labels_fit(report):
    """The faithfulness curve's x axis ends at the total of edges (not a round number past it)
    with the target dashed across it; each node's label, measured in a wide sans-serif
    (matplotlib's DejaVu Sans), fits inside its circle."""
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import TextPath

    from analyses.circuit.figures import RADIUS, faithfulness_figure, graph_figure

    tables = {name: pd.read_csv(report / f"{name}.csv", keep_default_na=False)
              for name in ("circuit_faithfulness", "circuit_run", "circuit_edges",
                           "circuit_heads")}  # fmt: skip
    total = int(tables["circuit_faithfulness"].total_edges.iloc[0])
    chart = faithfulness_figure(tables).figure
    ticks = [int(t) for t in re.findall(r'text-anchor="middle"[^>]*>(\d+)</text>', chart)]
    assert ticks[-1] == total and max(ticks) == total, ticks
    assert "stroke-dasharray" in chart and "<title>target 0.80</title>" in chart
    graph = graph_figure(tables).figure
    labels = re.findall(r'font-size="([\d.]+)"[^>]*>([\w-]+)</text></g>', graph)
    assert {"embed", "logits"} <= {label for _, label in labels}
    sans = FontProperties(family="DejaVu Sans")
    for size, label in labels:
        width = TextPath((0, 0), label, size=float(size), prop=sans).get_extents().width
        assert width < 2 * RADIUS - 2, (label, size, width)
