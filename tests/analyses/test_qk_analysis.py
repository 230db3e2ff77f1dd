"""The QK analysis (#64): each role's head, its scores at the role's positions split into what
wrote its query and its key, in qk.csv, the page, the figures and probe.plot; it follows the
taxonomy and the circuit."""

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from commands import fails_in_one_line
from induction import MODEL, PREVIOUS_TOKEN
from typer.testing import CliRunner

import analyses
from analyses.qk import QK, chosen_heads
from analyses.vocabulary import Role
from probe import plot
from probe.app.cli import app


def test_it_follows_the_taxonomy_and_the_circuit():
    assert analyses.followers(["taxonomy"]) == ["qk"]
    assert analyses.followers(["circuit", "claims"]) == ["qk"]
    assert analyses.followers(["syntax"]) == [] and analyses.followers(["taxonomy", "qk"]) == []
    assert not QK.default


def test_the_heads_it_splits():
    """Each positional role a head holds, a row; circuit heads by |effect|, those with no such
    role only; sink and syntactic roles have no positions of their own."""
    heads = pd.DataFrame({
        "layer": [0, 1, 1, 1, 0], "head": [0, 1, 2, 3, 1],
        "roles": ["previous-token;sink", "induction;copying", "", "syntactic", ""],
        "circuit_effect": [5.0, -9.0, -3.0, 1.0, np.nan],
    })  # fmt: skip
    got = chosen_heads(heads, n_circuit=3)
    assert list(got.itertuples(index=False, name=None)) == [
        (0, 0, "previous-token"), (1, 1, "induction"), (1, 1, "copying"), (1, 2, "circuit"),
    ]  # fmt: skip
    assert chosen_heads(heads, n_circuit=0).role.tolist().count("circuit") == 0
    assert chosen_heads(None, 3).empty


@pytest.mark.slow
def test_induction_keys_come_from_the_previous_token_head(tmp_path):
    """``probe analyze -a taxonomy`` on the induction model: qk.csv names the previous-token head
    0-0 as each induction head's largest key-side source, with an interval above the next
    source's; each side's sources sum to the mean score (the split is exact); the page says so;
    the figure is drawn."""
    out = tmp_path / "r"
    args = ["analyze", "-m", str(MODEL), "-t", "sample", "-n", "20", "-a", "taxonomy",
            "--repeat-sequences", "60", "--repeat-length", "20", "--qk-sequences", "6",
            "-o", str(out), "-q"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    heads = pd.read_csv(out / "heads.csv", keep_default_na=False)
    induction = heads[heads.roles.str.contains(str(Role.INDUCTION))]
    assert len(induction) >= 1
    qk = pd.read_csv(out / "qk.csv", keep_default_na=False)
    scores = pd.read_csv(out / "qk_scores.csv")
    previous = "{}-{}".format(*PREVIOUS_TOKEN)
    for r in induction.itertuples():
        own = qk[(qk.layer == r.layer) & (qk["head"] == r.head) & (qk.role == "induction")]
        key = own[own.side == "key"].sort_values("contribution", ascending=False)
        assert key.source.iloc[0] == previous
        assert key.low.iloc[0] > key.contribution.iloc[1]
        assert (own.positions == 6 * 16).all()  # qk_repeat_length's default
        score = scores.set_index(["layer", "head", "role"]).loc[(r.layer, r.head, "induction")]
        for side in ("query", "key"):
            total = own[own.side == side].contribution.sum()
            assert abs(total - score.score) < 1e-4 * abs(score.score)
        assert score.low < score.score < score.high
        row = heads.set_index(["layer", "head"]).loc[(r.layer, r.head)]
        assert row.qk_key_top == previous
    html = (out / "index.html").read_text()
    assert 'id="qk"' in html and "<td>induction</td>" in html
    assert html.count(f"key from {previous}") >= len(induction)  # the heads' cards
    assert 'href="#qk"' in html  # the taxonomy's section links to it
    ax = plot.qk_sources(out, head="{}-{}".format(*induction[["layer", "head"]].iloc[0]))
    assert ax.has_data() and ax.get_title().endswith("(induction)")
    with pytest.raises(ValueError, match="was not split"):
        plot.qk_sources(out, head="7-7")
    plt.close("all")
    figures = tmp_path / "figures"
    assert (
        CliRunner().invoke(app, ["figures", str(out), "-f", "png", "-o", str(figures)]).exit_code
        == 0
    )
    assert (figures / "qk-sources.png").is_file()


@pytest.mark.parametrize(
    "option, value", [("--qk-sequences", "1"), ("--qk-repeat-length", "1"),
                      ("--qk-max-bytes", "10"), ("--qk-circuit-heads", "-1")]
)  # fmt: skip
def test_bad_option_values_get_one_line(tmp_path, option, value):
    args = ["analyze", "-m", str(MODEL), "-a", "taxonomy", option, value, "-o", str(tmp_path)]
    fails_in_one_line(args, option)
