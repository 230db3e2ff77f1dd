"""``probe analyze -a circuit`` says how far to trust its circuit (issue #63): the trust's tables,
``run.json``'s summary, the page's sentence, the graph's dashed unstable edges and the two
figures in ``probe.plot``; a task of random answers is called unstable; the options' errors are
one line."""

import html as html_lib
import json
import re

import pandas as pd
import pytest
import torch
from induction import MODEL, PREVIOUS_TOKEN, fresh, repeated
from typer.testing import CliRunner

from analyses.circuit import Circuit
from analyses.circuit import trust as trust_io
from probe.app.cli import app
from probe.interventions.faithfulness import ABLATIONS

runner = CliRunner()
MISSING = "/nonexistent/model-folder"  # a check after loading would report this instead


def analyze(*args: str):
    return runner.invoke(app, ["analyze", "-t", "sample", "-q", *args])


def overview(folder) -> str:
    page = (folder / "index.html").read_text()
    part = page[page.index('<section id="overview">') :]
    part = part[: part.index("</section>")]
    return html_lib.unescape(" ".join(re.sub(r"<[^>]+>", " ", part).split()))


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("circuit") / "r"
    result = analyze("--model", str(MODEL), "-a", "circuit", "--lm-head", "--out", str(out))
    assert result.exit_code == 0, result.output
    return out


def task_file(path, answers, wrong, pairs=16, n=20, seed=1):
    """The induction model's repeats prompts as a task file (its tokenizer adds BOS), those of
    tests/interventions/test_patching.py's ``pairs``: clean A + A and corrupted A' + A, each less
    its last token, ``answers[p]`` against ``wrong[p]``."""
    clean = repeated(pairs, n, seed=seed)
    other = fresh(pairs, n, seed=seed + 100)[:, 1 + n :]
    lines = []
    for p in range(pairs):
        a, b = clean[p, 1:-1].tolist(), other[p].tolist() + clean[p, 1 + n : -1].tolist()
        words = [" ".join(f"t{i}" for i in ids) for ids in (a, b)]
        lines.append(json.dumps({"clean": words[0], "corrupted": words[1],
                                 "answer": f"t{answers[p]}", "wrong": f"t{wrong[p]}"}))  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_trust_tables_and_run_json(report):
    for name in trust_io.SCHEMAS:
        table = pd.read_csv(report / f"{name}.csv", keep_default_na=False)
        assert list(table.columns) == list(Circuit.tables[name]), name
    stability = pd.read_csv(report / "circuit_stability.csv", keep_default_na=False)
    edges = pd.read_csv(report / "circuit_edges.csv", keep_default_na=False)
    key = ["sender", "receiver", "input"]
    assert stability[key].equals(edges[key])  # an edge per row, in the same order
    previous = "{}-{}".format(*PREVIOUS_TOKEN)
    keys = stability[(stability.sender == previous) & (stability.input == "k")
                     & stability.receiver.str.startswith("1-")]  # fmt: skip
    assert len(keys) == 4 and (keys.inclusion >= 0.9).all() and keys.stable.all()
    curves = pd.read_csv(report / "circuit_ablations.csv")
    assert list(dict.fromkeys(curves.ablation)) == list(ABLATIONS)
    scores = pd.read_csv(report / "circuit_scores.csv")
    assert scores.chose.tolist() == [True, False, False, False]
    pairs = pd.read_csv(report / "circuit_pairs.csv", keep_default_na=False)
    assert len(pairs) == 16 and list(pairs.pair) == list(range(16))
    run = json.loads((report / "run.json").read_text())["circuit"]
    row = pd.read_csv(report / "circuit_run.csv", keep_default_na=False).iloc[0]
    for name in ("cpr", "cmd", "jaccard", "jaccard_low", "jaccard_high"):
        assert run[name] == pytest.approx(float(row[name])), name
    assert run["cpr"] == pytest.approx(scores.cpr[0]) and run["ablation"] == "corrupted"
    assert run["stable_edges"] == int(stability.stable[stability.in_circuit].sum())
    assert run["pairs_below_half"] == int((pairs.faithfulness < 0.5).sum())


def test_the_page_says_how_far_to_trust_it(report):
    text = overview(report)
    row = pd.read_csv(report / "circuit_run.csv", keep_default_na=False).iloc[0]
    scores = pd.read_csv(report / "circuit_scores.csv").set_index("ablation")
    print(text)
    stable = int(row.stable_edges)
    assert f"Stable: {stable} of {int(row.chosen_edges)} edges in ≥ 90% of resamples" in text
    c = scores.loc["corrupted"]
    assert f"faithfulness {c.faithfulness:.2f} [{c.low:.2f}, {c.high:.2f}] by corrupted" in text
    assert f"{scores.loc['mean'].faithfulness:.2f} by mean ablation" in text
    assert f"{int(row.pairs_below_half)} of 16 pairs below 0.5" in text
    page = (report / "index.html").read_text()
    assert "Faithfulness under each ablation" in page and "Each pair&#39;s faithfulness" in page
    assert "unstable" not in text


def test_the_trust_figures_in_probe_plot(report):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from probe import plot

    tables = plot.tables(report)
    ax = plot.circuit_ablations(tables)
    assert len(ax.get_lines()) >= 4
    plot.circuit_pairs(tables)
    plt.close("all")


@pytest.mark.slow
def test_a_task_of_random_answers_is_called_unstable(tmp_path):
    """The same prompts with a random answer per pair (against the same random wrong token)
    give a circuit whose Jaccard is below the real answers' interval, which the page calls
    unstable, its unstable edges dashed in the graph."""
    g = torch.Generator().manual_seed(5)
    wrong = torch.randint(1, 64, (16,), generator=g).tolist()
    noise = torch.randint(1, 64, (16,), generator=g).tolist()
    found = {}
    for name in ("real", "noise"):
        path = tmp_path / f"{name}.jsonl"
        real = repeated(16, 20, seed=1)[:, -1].tolist()  # each pair's true next token
        path = task_file(path, real if name == "real" else noise, wrong)
        out = tmp_path / name
        result = analyze("--model", str(MODEL), "-a", "circuit", "--lm-head", "--task",
                         str(path), "--out", str(out))  # fmt: skip
        assert result.exit_code == 0, result.output
        found[name] = pd.read_csv(out / "circuit_run.csv", keep_default_na=False).iloc[0]
        print(name, found[name][["chosen_edges", "jaccard", "jaccard_low", "jaccard_high"]])
    assert found["noise"].jaccard < found["real"].jaccard_low
    assert "Unstable: 0 of 4 edges" in overview(tmp_path / "noise")
    assert "Stable: " in overview(tmp_path / "real")
    graph = (tmp_path / "noise" / "index.html").read_text()
    graph = graph[graph.index("A graph of the circuit") :]
    assert "stroke-dasharray" in graph[: graph.index("</svg>")]
    pairs = pd.read_csv(tmp_path / "noise" / "circuit_pairs.csv", keep_default_na=False)
    assert pairs.clean_text[0].startswith("t") and pairs.answer[0] == f"t{noise[0]}"


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--circuit-resamples", "1"], "--circuit-resamples must be ≥ 2"),
        (["--circuit-ablation", "half"], "unknown --circuit-ablation 'half'"),
    ],
)
def test_bad_options_are_one_line_before_the_model_loads(tmp_path, flags, said):
    result = analyze("--model", MISSING, "-a", "circuit", "--lm-head", *flags,
                     "--out", str(tmp_path / "r"))  # fmt: skip
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], lines


def test_resamples_not_an_integer_is_refused_by_the_command_line(tmp_path):
    """The command line's integer type refuses 2.5 as it does for every whole-number option:
    click's usage error (status 2), in one line naming the flag; probe.circuit's own one line
    is tested in tests/interventions/test_circuit_trust.py."""
    result = analyze("--model", MISSING, "-a", "circuit", "--lm-head", "--circuit-resamples",
                     "2.5", "--out", str(tmp_path / "r"))  # fmt: skip
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: Invalid value for "
                                                   "'--circuit-resamples'"), lines  # fmt: skip


def test_resample_with_one_pair_and_no_difference_are_one_line(tmp_path):
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"clean": "t1 t2 t3 t1", "corrupted": "t5 t2 t3 t1",
                               "answer": "t2"}) + "\n")  # fmt: skip
    result = analyze("--model", str(MODEL), "-a", "circuit", "--lm-head", "--task", str(one),
                     "--circuit-ablation", "resample", "--out", str(tmp_path / "r"))  # fmt: skip
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1 and "gives 1 pair" in lines[0], lines
    alike = tmp_path / "alike.jsonl"
    alike.write_text((json.dumps({"clean": "t1 t2 t3 t1", "corrupted": "t1 t2 t3 t1",
                                  "answer": "t2"}) + "\n") * 3)  # fmt: skip
    result = analyze("--model", str(MODEL), "-a", "circuit", "--lm-head", "--task", str(alike),
                     "--out", str(tmp_path / "r2"))  # fmt: skip
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1 and "score alike" in lines[0], lines
    assert not (tmp_path / "r2").exists()


def test_the_ablations_declared_are_the_librarys():
    assert trust_io.ABLATIONS == ABLATIONS


def test_a_circuit_report_of_the_layout_before_renders(report, tmp_path):
    """A folder written before the trust (layout 2: no trust tables, no trust columns in
    circuit_run.csv) renders, stating no trust; its files are not changed."""
    import shutil

    from probe.app.report import read_report

    folder = tmp_path / "old"
    shutil.copytree(report, folder)
    for name in trust_io.SCHEMAS:
        (folder / f"{name}.csv").unlink()
    run = pd.read_csv(folder / "circuit_run.csv", keep_default_na=False)
    run.drop(columns=list(trust_io.RUN)).to_csv(folder / "circuit_run.csv", index=False)
    card = json.loads((folder / "run.json").read_text())
    card["schema"] = 2
    card.pop("circuit")
    (folder / "run.json").write_text(json.dumps(card))
    _, tables, _ = read_report(folder)
    assert tables["circuit_stability"].empty and int(tables["circuit_run"].resamples[0]) == 0
    result = runner.invoke(app, ["report", str(folder)])
    assert result.exit_code == 0, result.output
    text = overview(folder)
    assert "Circuit of the repeats task" in text and "resamples" not in text
    assert not (folder / "circuit_stability.csv").exists()
