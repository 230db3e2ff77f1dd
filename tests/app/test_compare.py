"""`probe compare A B`: same-shape reports head by head, different shapes by relative depth."""

import json
import math
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
from browser import check_html, chromium, console_messages, needs_chromium
from matplotlib import image as plt_image
from models import saved_bert
from typer.testing import CliRunner

from probe.app import examples as examples_io
from probe.app.cli import app
from probe.app.compare import _word_distributions, matched_layers, nearest_heads
from probe.numerics import pairwise_js

pytestmark = pytest.mark.slow  # runs real models or the whole command line

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
    drawn = relations.ci_low_a.notna()  # too few sentences: no interval to overlap
    assert len(relations) > 5 and relations[drawn].intervals_overlap.all()
    assert not relations.change_called.any() and relations[~drawn].change_p.isna().all()
    assert (relations.accuracy_change == 0).all()
    html = (out / "index.html").read_text()
    assert "Every head holds the same roles" in html and check_html(out / "index.html")
    assert (heads.attention_js.abs() < 1e-9).all()  # each head attends as itself…
    pairs = pd.read_csv(out / "compare_attention.csv")
    assert len(pairs) == 72 * 72 and pairs.sentences.eq(examples_io.N_CANDIDATES).all()
    nearest = nearest_heads(pairs)
    assert (nearest.layer_a == nearest.layer_b).all() and (nearest.head_a == nearest.head_b).all()
    others = pairs[(pairs.layer_a != pairs.layer_b) | (pairs.head_a != pairs.head_b)]
    assert others.js.min() > 1e-4  # …and unlike any other head
    assert "Attention on common sentences" in html and "compare_attention.csv" in html


def test_a_heads_syntax_change_is_called_only_outside_the_intervals(reports, tmp_path):
    """B is A with one head made wrong on its best relation (its interval Wilson's for 0 of
    its words): only that head's change is called; a report against itself calls none, and a
    degenerate interval (a bootstrap collapsed to a point) calls nothing either."""
    edited = tmp_path / "edited"
    shutil.copytree(reports["minilm"], edited)
    heads = pd.read_csv(edited / "heads.csv", keep_default_na=False)
    target = heads[heads.best_relation != ""].iloc[0]
    syntax = pd.read_csv(edited / "syntax.csv")  # intervals not drawn are NaN
    row = ((syntax.relation == target.best_relation)
           & (syntax.direction == target.best_relation_direction)
           & (syntax.layer == target.layer) & (syntax["head"] == target["head"]))  # fmt: skip
    assert row.sum() == 1
    z2 = 1.959963984540054**2  # Wilson's upper end at 0 of n is z² / (n + z²)
    wilson_high = z2 / (int(syntax.loc[row, "total"].item()) + z2)
    syntax.loc[row, ["correct", "accuracy", "ci_low", "ci_high"]] = [0, 0.0, 0.0, wilson_high]
    syntax.to_csv(edited / "syntax.csv", index=False)
    out = tmp_path / "cmp"
    result = runner.invoke(app, ["compare", str(reports["minilm"]), str(edited), "-o", str(out)])
    assert result.exit_code == 0, result.output
    table = pd.read_csv(out / "compare_heads.csv", keep_default_na=False)
    called = table[table.relation_change_called.astype(str) == "True"]
    assert called[["layer", "head"]].values.tolist() == [[target.layer, target["head"]]]
    change = float(called.relation_accuracy_change.item())  # CSVs keep 6 digits
    assert change == pytest.approx(-float(target.best_relation_accuracy), abs=1e-6)
    assert (table.relation != "").sum() == (heads.best_relation != "").sum()
    assert "Syntax per head" in (out / "index.html").read_text()
    same = tmp_path / "same"
    runner.invoke(app, ["compare", str(reports["minilm"]), str(reports["minilm"]), "-o", str(same)])
    table = pd.read_csv(same / "compare_heads.csv", keep_default_na=False)
    assert (table.relation_change_called.astype(str) != "True").all()
    syntax.loc[row, "ci_high"] = 0.0  # 0.0–0.0: no interval, nothing to call
    syntax.to_csv(edited / "syntax.csv", index=False)
    degenerate = tmp_path / "degenerate"
    result = runner.invoke(app, ["compare", str(reports["minilm"]), str(edited), "-o",
                                 str(degenerate)])  # fmt: skip
    assert result.exit_code == 0, result.output
    table = pd.read_csv(degenerate / "compare_heads.csv", keep_default_na=False)
    assert (table.relation_change_called.astype(str) != "True").all()


def test_a_relation_is_called_only_on_enough_words_and_real_intervals():
    """The issue's case: B 100% (100–100) on 2 words against A's 50% is no change called;
    nor 0% (0–0); a real difference on many words is, after the correction."""
    from scipy import stats

    from probe.app.compare import called_changes

    table = pd.DataFrame({
        "accuracy_a": [0.5, 0.5, 0.5, 0.50, 0.50], "accuracy_b": [1.0, 0.0, 0.9, 0.51, 0.9],
        "ci_low_a": [0.3, 0.3, 0.45, 0.45, 0.45], "ci_high_a": [0.7, 0.7, 0.55, 0.55, 0.55],
        "ci_low_b": [1.0, 0.0, 0.85, 0.46, np.nan], "ci_high_b": [1.0, 0.0, 0.95, 0.56, np.nan],
    })  # fmt: skip
    p, called = called_changes(table, "accuracy", pd.Series([False, True, True, True, True]))
    assert np.isnan(p[[0, 1, 4]]).all()  # too few words, a collapsed interval, none at all
    assert called.tolist() == [False, False, True, False, False]
    se = np.hypot(0.1, 0.1) / (2 * 1.959963984540054)
    assert p[2] == pytest.approx(2 * stats.norm.sf(0.4 / se))


def test_jensen_shannon_by_hand():
    p = torch.tensor([[[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]], dtype=torch.float64)  # 1 head, 2 words
    q = torch.tensor([[[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]], [[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]],
                     dtype=torch.float64)  # fmt: skip
    js = pairwise_js(p, q)
    # word 0 against [0, .5, .5]: m = [.25, .5, .25], H(m) = 1.5 ln 2, H(p) = H(q) = ln 2
    assert js[0, 0].item() == pytest.approx(0.5 * math.log(2))
    assert js[0, 1].item() == pytest.approx(math.log(2))  # word 1: disjoint, ln 2
    assert pairwise_js(q, q).diagonal().abs().max() < 1e-12


def test_word_distributions_by_hand():
    """[CLS] a ##b c [SEP]: words 0 = (a, ##b), 1 = c; attention to a word sums its tokens,
    from a word averages them, and the special tokens' share is the last outcome."""
    pattern = np.array(
        [[0.2, 0.2, 0.2, 0.2, 0.2], [0.1, 0.3, 0.2, 0.4, 0.0], [0.0, 0.5, 0.5, 0.0, 0.0],
         [0.5, 0.0, 0.0, 0.25, 0.25], [1.0, 0.0, 0.0, 0.0, 0.0]], dtype=np.float32,
    )[None, None]  # fmt: skip
    sentence = {"pattern": pattern, "words": ["ab", "c"], "word_of_token": [-1, 0, 0, 1, -1]}
    got = _word_distributions(sentence)[0].numpy()
    expected = [[(0.5 + 1.0) / 2, (0.4 + 0.0) / 2, (0.1 + 0.0) / 2], [0.0, 0.25, 0.75]]
    np.testing.assert_allclose(got, expected, atol=1e-6)


def test_a_head_whose_attention_moved_is_found(reports, tmp_path):
    """B is A with heads 2-5 and 3-7 swapped in the kept attention: those two heads, and only
    they, change, and each finds the other as its nearest head."""
    edited = tmp_path / "swapped"
    shutil.copytree(reports["minilm"], edited)
    with np.load(edited / "attention.npz") as saved:
        patterns = {name: saved[name].copy() for name in saved.files}
    for p in patterns.values():
        p[[2, 3], [5, 7]] = p[[3, 2], [7, 5]]
    with open(edited / "attention.npz", "wb") as f:
        np.savez_compressed(f, **patterns)
    out = tmp_path / "cmp"
    result = runner.invoke(app, ["compare", str(reports["minilm"]), str(edited), "-o", str(out)])
    assert result.exit_code == 0, result.output
    heads = pd.read_csv(out / "compare_heads.csv")
    moved = heads[heads.attention_js > 1e-9][["layer", "head"]].values.tolist()
    assert moved == [[2, 5], [3, 7]]
    nearest = nearest_heads(pd.read_csv(out / "compare_attention.csv")).set_index(
        ["layer_a", "head_a"]
    )
    assert tuple(nearest.loc[(2, 5), ["layer_b", "head_b"]]) == (3, 7)
    assert tuple(nearest.loc[(3, 7), ["layer_b", "head_b"]]) == (2, 5)
    assert nearest.loc[(2, 5), "js"] < 1e-9
    html = (out / "index.html").read_text()
    assert "changed most" in html and "3-7" in html


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
    # two tokenizers, the same sentences: heads are matched on their word-level attention
    pairs = pd.read_csv(out / "compare_attention.csv")
    kept_a, kept_b = (examples_io.read(reports[n])["sentences"] for n in ("minilm", "bert"))
    common = {s["index"] for s in kept_a} & {s["index"] for s in kept_b}
    assert len(pairs) == 72 * 8 and pairs.sentences.eq(len(common)).all() and common
    assert pairs.js.between(0, math.log(2) + 1e-9).all()
    assert "Which layers of B attend like which layers of A" in (out / "index.html").read_text()
    assert json.loads((out / "compare.json").read_text())["shape_b"] == [2, 4]
    assert "relative depth" in (out / "index.html").read_text()
    check_html(out / "index.html")


def test_a_report_without_attention_is_compared_without_it(reports, tmp_path):
    spectra = tmp_path / "spectra"
    args = ["analyze", "-m", "minilm", "--analyses", "spectra", "-o", str(spectra), "-q"]
    assert runner.invoke(app, args).exit_code == 0
    out = tmp_path / "cmp"
    result = runner.invoke(app, ["compare", str(reports["minilm"]), str(spectra), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert not (out / "compare_attention.csv").exists()
    assert "Not compared: the two reports kept no attention" in (out / "index.html").read_text()


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
