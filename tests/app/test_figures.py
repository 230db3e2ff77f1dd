"""``probe figures`` and ``probe.plot``: the figures every analysis declares (``Plot``), drawn
with seaborn from a real report's tables, open as PDF, SVG and PNG at a paper's sizes; the
folder is written whole and never over something without --overwrite; the page keeps its
inline SVG from the same declarations."""

import inspect
import subprocess
import sys
import xml.etree.ElementTree as ET

import matplotlib.image as plt_image
import matplotlib.pyplot as plt
import pytest
from induction import MODEL, symbols_treebank
from matplotlib.axes import Axes
from typer.testing import CliRunner

import analyses
import probe
from probe import plot
from probe.app import compare
from probe.app.cli import app
from probe.app.figures import declared

pytestmark = pytest.mark.slow  # runs real models or the whole command line

ANALYSES = "syntax,roles,spectra,probe,taxonomy,importance,circuit,claims"


def run(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """A report of the tiny GPT-2 of tests/data over 20 sample sentences, with every analysis
    it supports that has figures (coref needs GUM; cross an encoder-decoder), the circuit of
    its repeats task included."""
    out = tmp_path_factory.mktemp("figures") / "tiny"
    treebank = symbols_treebank(out.parent / "symbols.conllu")  # English: unknown tokens
    result = run("analyze", "-m", MODEL, "-t", treebank, "-n", "20", "-a", ANALYSES,
                 "--lm-head", "--repeat-sequences", "20", "--repeat-length", "10",
                 "--importance-sentences", "10", "--circuit-pairs", "8", "-o", out,
                 "-q")  # fmt: skip
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def comparison(report, tmp_path_factory):
    out = tmp_path_factory.mktemp("figures") / "compare"
    result = run("compare", report, report, "--out", out)
    assert result.exit_code == 0, result.output
    return out


def expected(folder, fmt):
    plots, tables = declared(folder)
    return {f"{name}-{p.id}.{fmt}": p for name, p in plots if p.present(tables)}


@pytest.mark.parametrize("fmt", ["pdf", "svg", "png"])
def test_every_figure_opens(report, tmp_path, fmt):
    out = tmp_path / "figures"
    result = run("figures", report, "--format", fmt, "--out", out)
    assert result.exit_code == 0, result.output
    files = expected(report, fmt)
    assert len(files) >= 10  # every analysis of the report draws
    assert {p.name for p in out.iterdir() if not p.name.startswith(".")} == set(files)
    for name, declared_plot in files.items():
        data = (out / name).read_bytes()
        if fmt == "pdf":
            assert data.startswith(b"%PDF-") and b"%%EOF" in data[-32:]
        elif fmt == "svg":
            root = ET.fromstring(data)
            assert root.tag == "{http://www.w3.org/2000/svg}svg"
            assert root.iter("{http://www.w3.org/2000/svg}text") is not None
            assert float(root.get("width").removesuffix("pt")) == pytest.approx(
                {"column": 3.3, "page": 7.0}[declared_plot.width] * 72
            )  # a paper's column or page, in points
        else:
            image = plt_image.imread(out / name)
            assert image.shape[1] == round({"column": 3.3, "page": 7.0}[declared_plot.width] * 300)
            assert image[..., :3].std() > 0.05  # something is drawn


def test_the_same_tables_draw_the_same_files(report, tmp_path):
    for k in (1, 2):
        assert run("figures", report, "-f", "svg", "-o", tmp_path / str(k)).exit_code == 0
    for path in (tmp_path / "1").glob("*.svg"):
        assert path.read_bytes() == (tmp_path / "2" / path.name).read_bytes(), path.name


def test_figures_default_to_the_reports_folder_and_are_never_overwritten(report, tmp_path):
    result = run("figures", report, "-f", "png")
    assert result.exit_code == 0, result.output
    out = report / "figures"
    before = {p.name: p.read_bytes() for p in out.iterdir() if not p.name.startswith(".")}
    again = run("figures", report, "-f", "png")  # the same format again: never overwritten
    assert again.exit_code == 1
    assert "already exists; use --overwrite" in again.output and len(again.output.splitlines()) == 1
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name in before} == before
    other = run("figures", report, "-f", "pdf")  # another format joins the first, untouched
    assert other.exit_code == 0, other.output
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name in before} == before
    assert {p.suffix for p in out.iterdir() if not p.name.startswith(".")} == {".png", ".pdf"}
    assert run("figures", report, "-f", "pdf", "--overwrite").exit_code == 0
    assert {p.suffix for p in out.iterdir() if not p.name.startswith(".")} == {".pdf"}

    mine = tmp_path / "mine"  # a folder probe did not write is never replaced
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    refused = run("figures", report, "-o", mine, "--overwrite")
    assert refused.exit_code == 1 and "is not a probe report" in refused.output
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_bad_input_is_one_line(report, tmp_path):
    for args, message in [
        (["figures", report, "-f", "jpeg", "-o", tmp_path / "x"], "unknown --format 'jpeg'"),
        (["figures", tmp_path], "is not a probe report folder"),
        (["figures", tmp_path / "nowhere"], "is not a folder"),
    ]:
        result = run(*args)
        assert result.exit_code == 1 and message in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_a_comparison_has_its_figures(comparison, tmp_path):
    result = run("figures", comparison, "-f", "pdf", "-o", tmp_path / "c")
    assert result.exit_code == 0, result.output
    names = {p.name for p in (tmp_path / "c").glob("*.pdf")}
    assert {"compare-rank-changes.pdf", "compare-relations.pdf"} <= names
    assert names == set(expected(comparison, "pdf"))


FUNCTIONS = {
    name: f
    for name, f in inspect.getmembers(plot, inspect.isfunction)
    if f.__module__ == "probe.plot" and not name.startswith("_") and name != "tables"
}
COMPARE = {"rank_changes", "relation_changes", "layer_roles", "layer_correspondence"}
ABSENT = {"coreference_heads", "cross_heads", "layer_roles", "layer_correspondence"}
# A timeline's figures, drawn from its folder (tests/app/test_timeline_run.py), not a report's
TIMELINE = {"timeline", "timeline_loss"}


@pytest.mark.parametrize("name", sorted(set(FUNCTIONS) - ABSENT - TIMELINE))
def test_probe_plot_returns_the_axes_it_drew_on(report, comparison, name):
    """From the folder, a new figure; from the tables, on an Axes given."""
    folder = comparison if name in COMPARE else report
    function = FUNCTIONS[name]
    ax = function(folder)
    assert isinstance(ax, Axes) and ax.has_data()
    given = plt.figure().add_subplot()
    assert function(plot.tables(folder), ax=given) is given and given.has_data()
    plt.close("all")


def test_probe_plot_is_a_module_the_front_door_does_not_import():
    """``from probe import plot`` imports the app's module; a fresh ``import probe`` neither
    imports nor names it, and says how to import it when asked for ``probe.plot``."""
    assert plot.__name__ == "probe.plot" and probe.plot is plot
    code = (
        "import sys, probe\n"
        "assert 'plot' not in dir(probe)\n"
        "try:\n    probe.plot\nexcept AttributeError as e:\n    print(e)\n"
        "above = ('probe.app', 'probe.plot', 'analyses')\n"
        "assert not [m for m in sys.modules if m.startswith(above)]\n"
        "from probe import plot\n"
        "assert probe.plot is plot\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("import the notebook figures as: from probe import plot")


def test_every_declared_figure_has_its_drawing_and_notebook_function():
    """Each Plot names a seaborn drawing that takes ``ax``, and probe.plot draws it; page
    drawings are inline SVG (the page keeps its interactive figures)."""
    declarations = [analyses.get(name).plots for name in analyses.REGISTRY] + [compare.PLOTS]
    drawn = set()
    for plots in declarations:
        for p in plots:
            module, function = p.paper.split(":")
            drawing = getattr(__import__(module, fromlist=[function]), function)
            assert "ax" in inspect.signature(drawing).parameters, p.paper
            drawn.add(function)
    assert drawn == set(FUNCTIONS) - TIMELINE


def test_the_page_keeps_its_inline_svg(report):
    """Every figure the page draws from the declarations is inline SVG in index.html."""
    plots, tables = declared(report)
    html = (report / "index.html").read_text()
    page = [f for _, p in plots if (f := p.figure(tables)) is not None]
    assert len(page) >= 8
    for figure in page:
        assert figure.figure.startswith("<svg") and figure.figure in html


def test_drawings_of_analyses_this_report_lacks_show_their_tables():
    """coref (needs GUM), cross (an encoder-decoder) and a comparison of two shapes, from
    tables of their schemas: each heatmap's cells are the table's values, layer-head in order."""
    import numpy as np
    import pandas as pd

    from analyses.vocabulary import Role

    g = np.random.default_rng(0)
    layer, head = np.divmod(np.arange(6), 3)
    coref = pd.concat([pd.DataFrame({"mention_type": kind, "layer": layer, "head": head,
                                     "accuracy": g.uniform(size=6)})
                       for kind in ("pronoun", "proper")])  # fmt: skip
    ax = plot.coreference_heads({"coref": coref})
    cells = ax.collections[0].get_array().reshape(2, 6)
    np.testing.assert_allclose(cells, coref.accuracy.to_numpy().reshape(2, 6))
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0-0", "1-0"]

    cross = pd.DataFrame({"layer": layer, "head": head, "diagonal": g.uniform(size=6)})
    ax = plot.cross_heads({"cross_attention": cross})
    np.testing.assert_allclose(ax.collections[0].get_array().reshape(2, 3),
                               cross.diagonal.to_numpy().reshape(2, 3))  # fmt: skip

    layers = pd.DataFrame({"layer_a": [0, 1], "layer_b": [0, 2]})
    for role in map(str, Role):
        layers[f"{role}_a"], layers[f"{role}_b"] = [0.0, 0.5], [0.25, 0.0]
    ax = plot.layer_roles({"compare_layers": layers})
    assert len(ax.get_lines()) == 2 * len(Role)
    pairs = pd.DataFrame({"layer_a": [0, 0, 1, 1], "head_a": 0, "layer_b": [0, 1, 0, 1],
                          "head_b": 0, "js": [0.1, 0.4, 0.3, 0.2]})  # fmt: skip
    ax = plot.layer_correspondence({"compare_attention": pairs})
    np.testing.assert_allclose(
        ax.collections[0].get_array().reshape(2, 2), [[0.1, 0.4], [0.3, 0.2]]
    )
    plt.close("all")
