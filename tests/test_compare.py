"""`probe compare A B`: same-shape reports head by head, different shapes by relative depth."""

import json
import shutil

import pandas as pd
import pytest
from matplotlib import image as plt_image
from models import saved_bert
from test_cli import check_html, chromium, console_messages, needs_chromium
from typer.testing import CliRunner

from probe.app.cli import app
from probe.app.compare import matched_layers

runner = CliRunner()


@pytest.fixture(scope="module")
def reports(tmp_path_factory, minilm):
    """MiniLM on the sample (6 x 12), and a random 2-layer BERT (2 x 4) on the same."""
    root = tmp_path_factory.mktemp("compare")
    folder = saved_bert(root / "bert")
    out = {}
    for name, model in (("minilm", "minilm"), ("bert", str(folder))):
        out[name] = root / f"report-{name}"
        args = ["analyze", "-m", model, "-t", "sample", "-o", str(out[name]), "-q"]
        assert runner.invoke(app, args).exit_code == 0
    return out


def test_a_report_against_itself_changes_nothing(reports, tmp_path):
    out = tmp_path / "same"
    result = runner.invoke(app, ["compare", str(reports["minilm"]), str(reports["minilm"]),
                                 "--out", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    heads = pd.read_csv(out / "compare_heads.csv", keep_default_na=False)
    assert len(heads) == 72
    changes = [c for c in heads.columns if c.endswith("_change")]
    assert "qk_effective_rank_change" in changes and "best_relation_accuracy_change" in changes
    assert (heads[changes].replace("", 0).astype(float) == 0).all().all()
    assert (heads.roles_gained == "").all() and (heads.roles_lost == "").all()
    relations = pd.read_csv(out / "compare_relations.csv")
    assert len(relations) > 5 and relations.intervals_overlap.all()
    assert (relations.accuracy_change == 0).all()
    html = (out / "index.html").read_text()
    assert "Every head holds the same roles" in html and check_html(out / "index.html")


def test_roles_gained_and_lost_are_named(reports, tmp_path):
    edited = tmp_path / "edited"
    shutil.copytree(reports["minilm"], edited)
    heads = pd.read_csv(edited / "heads.csv", keep_default_na=False)
    before = heads.loc[(heads.layer == 2) & (heads["head"] == 5), "roles"].item()
    heads.loc[(heads.layer == 2) & (heads["head"] == 5), "roles"] = "sink;broad"
    heads.to_csv(edited / "heads.csv", index=False)
    out = tmp_path / "cmp"
    result = runner.invoke(app, ["compare", str(reports["minilm"]), str(edited), "-o", str(out)])
    assert result.exit_code == 0, result.output
    table = pd.read_csv(out / "compare_heads.csv", keep_default_na=False)
    changed = table[(table.roles_gained != "") | (table.roles_lost != "")]
    assert changed[["layer", "head"]].values.tolist() == [[2, 5]]
    row = changed.iloc[0]
    old = {r for r in before.split(";") if r}
    assert set(filter(None, row.roles_gained.split(";"))) == {"sink", "broad"} - old
    assert set(filter(None, row.roles_lost.split(";"))) == old - {"sink", "broad"}


def test_different_shapes_are_matched_by_relative_depth(reports, tmp_path):
    assert matched_layers(6, 2).tolist() == [0, 0, 0, 1, 1, 1]
    assert matched_layers(2, 6).tolist() == [0, 5] and matched_layers(1, 4).tolist() == [0]
    out = tmp_path / "shapes"
    result = runner.invoke(app, ["compare", str(reports["minilm"]), str(reports["bert"]),
                                 "-o", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    layers = pd.read_csv(out / "compare_layers.csv")
    assert layers.layer_b.tolist() == [0, 0, 0, 1, 1, 1]
    bert = pd.read_csv(reports["bert"] / "heads.csv")
    expected = bert[bert.layer == 1].qk_effective_rank.mean()
    assert layers.qk_effective_rank_b.iloc[-1] == pytest.approx(expected, rel=1e-5)
    assert json.loads((out / "compare.json").read_text())["shape_b"] == [2, 4]
    assert "relative depth" in (out / "index.html").read_text()
    check_html(out / "index.html")


def test_bad_comparisons_are_one_line(reports, tmp_path):
    result = runner.invoke(app, ["compare", str(tmp_path), str(reports["bert"]), "-o",
                                 str(tmp_path / "x")])  # fmt: skip
    assert result.exit_code == 1 and "is not a probe report folder" in result.output
    assert not (tmp_path / "x").exists()
    taken = tmp_path / "taken"
    taken.mkdir()
    result = runner.invoke(app, ["compare", str(reports["bert"]), str(reports["bert"]), "-o",
                                 str(taken)])  # fmt: skip
    assert result.exit_code == 1 and "exists" in result.output


@needs_chromium
def test_chromium_opens_the_comparison(reports, tmp_path):
    out = tmp_path / "view"
    args = ["compare", str(reports["minilm"]), str(reports["bert"]), "-o", str(out)]
    assert runner.invoke(app, args).exit_code == 0
    shot = tmp_path / "compare.png"
    done = chromium((out / "index.html").as_uri(), tmp_path, f"--screenshot={shot}")
    assert console_messages(done.stderr) == []
    assert (plt_image.imread(shot)[..., :3].mean(-1) < 0.9).sum() > 5000  # text and figures
