"""The report opens with its answer: the overview first, the run card after it (collapsed),
saying what each analysis read and where the time went; the legend marks the roles the run did
not test; a head's line claims only what the page claims."""

import json
import re

import pytest

from analyses.vocabulary import Role
from probe.app.findings import describe


def visible(html: str) -> str:
    """The page's text, without its style, scripts and drawings."""
    for pattern in (r"<style>.*?</style>", r"<script.*?</script>", r"<svg.*?</svg>"):
        html = re.sub(pattern, "", html, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


@pytest.mark.slow
def test_the_overview_comes_first_and_the_run_card_follows_collapsed(tiny_report):
    html = (tiny_report / "index.html").read_text()
    main = html[html.index("<main>") :]
    assert main.index('<section id="overview">') < main.index('<section id="syntax">')
    assert main.index('<section id="heads">') < main.index('<section id="run">')
    run = main[main.index('<section id="run">') :]
    assert run.index("<details") < run.index("<dl")  # collapsed
    nav = html[html.index("<nav") : html.index("</nav>")]
    assert nav.index("#overview") < nav.index("#run")


@pytest.mark.slow
def test_the_run_card_says_what_each_analysis_read(tiny_report):
    html = (tiny_report / "index.html").read_text()
    text = visible(html[html.index('<section id="run">') :])
    assert "syntax: sentences" in text and "coref: coreference windows" in text
    assert "spectra: the weights" in text
    assert "analyses 0.0 s" not in text and "finishing the analyses" in text
    run = json.loads((tiny_report / "run.json").read_text())
    assert set(run["finish_s"]) == set(run["analyses"])
    assert sum(run["finish_s"].values()) <= run["timings_s"]["tables"]


@pytest.mark.slow
def test_the_legend_marks_the_roles_the_run_did_not_test(tiny_report):
    """The default analyses test the roles analysis's roles and the syntactic and coreference
    roles; the head types and retrieval did not run, so their roles are listed as not tested,
    and the legend's coloured keys are the tested roles only."""
    html = (tiny_report / "index.html").read_text()
    overview = html[html.index('<section id="overview">') :]
    overview = overview[: overview.index("</section>")]
    legend = overview[overview.index('<span class="legend">') :]
    legend = legend[: legend.index("</span></span>")]
    untested = visible(overview[overview.index('class="untested"') :]).split(".")[0]
    for role in (Role.INDUCTION, Role.DUPLICATE_TOKEN, Role.COPYING, Role.RETRIEVAL):
        assert str(role) in untested and f"role-{role}" not in legend
    for role in (Role.PREVIOUS_TOKEN, Role.SINK, Role.SYNTACTIC, Role.COREFERENCE):
        assert str(role) not in untested and f"role-{role}" in legend


def test_a_head_line_claims_no_relation_the_page_does_not():
    """A best relation named without the syntactic role (a margin under its threshold) is a
    number on the line, said to be under the threshold, never "tracks"."""
    row = {"roles": "", "best_relation": "aux", "best_relation_direction": "head_to_dependent",
           "best_relation_accuracy": 0.57, "best_relation_margin": 0.031, "self": 0.4,
           "previous": 0.3}  # fmt: skip
    line = describe(row)
    assert "tracks" not in line and line.startswith("no role: attention spread over itself 40%")
    assert "best relation aux (head to dependent) 57%, +3.1 points" in line
    assert "under the syntactic role's threshold" in line
    held = describe(row | {"roles": "syntactic", "best_relation_margin": 0.2})
    assert held.startswith("syntactic: aux (head to dependent) 57%")
    # a previous-token head found on repeats alone is described by its score there
    assert describe({"roles": "previous-token", "previous_token_score": 0.86}) == (
        "previous-token: previous-token score 0.86 on repeated sequences"
    )


@pytest.mark.slow
def test_a_readable_treebank_is_recorded_and_not_warned_of(tiny_report):
    from probe.inputs.unknown import MOSTLY_UNKNOWN

    run = json.loads((tiny_report / "run.json").read_text())
    measured = run["unknown_words"]["treebank"]
    assert measured["words"] == 711 and measured["share"] < MOSTLY_UNKNOWN
    assert run["warnings"] == [] and run["skipped"] == {}


def summary_of(report) -> str:
    """The command line's summary of the report folder, as printed."""
    from rich.console import Console

    from probe.app.console import summary

    console = Console(record=True, width=400, color_system=None)
    summary(console, report)
    return console.export_text()


def test_the_overview_marks_the_heads_confirmed_by_ablation(sample_report):
    """ "k of n tested confirmed by ablation" is followed by the role's heads, the k confirmed
    marked ✓, as claims.csv has them."""
    import pandas as pd

    html = (sample_report / "index.html").read_text()
    claims = pd.read_csv(sample_report / "claims.csv")
    lines = re.findall(r"<li><span class=\"role-[\w-]+\">.*?</li>", html)
    counted = 0
    for line in lines:
        said = re.search(r"\((\d+) of (\d+) tested confirmed by ablation", line)
        if not said:
            continue
        role = re.search(r"<b>\d+ ([\w-]+)</b>", line).group(1)
        marked = re.findall(r">(\d+-\d+)</a><span class=\"confirmed\"", line)
        own = claims[(claims.claim == role) & claims.confirmed.astype(bool)]
        assert sorted(marked) == sorted(
            f"{a}-{b}" for a, b in zip(own.layer, own["head"], strict=True)
        )
        assert len(marked) == int(said.group(1))
        counted += 1
    assert counted, "no role of the sample's report was tested by ablation"


def test_the_claims_summary_gives_its_unit(sample_report):
    """MiniLM without its LM head: the claims' best head's effect is a relative change."""
    text = summary_of(sample_report)
    said = (
        r"claims: ablation effect of the claim: best head \d+-\d+ "
        r"\(\d\.\d{3} relative change of the last hidden state\)"
    )
    assert re.search(said, text), text
    assert re.search(r": \d+ sentences, ", text.splitlines()[0])  # a treebank was read
