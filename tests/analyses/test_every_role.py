"""Every role an analysis can give is known to the report (its letter, colour, rule and place in
the order of description), and a report of heads holding any of them renders: the run that
finds a retrieval head writes its report."""

import shutil

import pandas as pd
import pytest
from induction import MODEL, symbols_treebank
from typer.testing import CliRunner

import analyses
from analyses import ContractError, check_analysis
from analyses import vocabulary as vocabulary_module
from analyses.vocabulary import Role, unknown_to_report
from probe.app.cli import app
from probe.app.findings import describe


def invoke(*args) -> object:
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("role", list(Role))
def test_every_role_is_known_to_the_report(role):
    assert unknown_to_report(role) == []
    assert describe({"roles": str(role)})  # a head holding it is described (its line or none)


def test_every_role_renders_in_a_report(tiny_report, tmp_path):
    folder = tmp_path / "report"
    shutil.copytree(tiny_report, folder)
    heads = pd.read_csv(folder / "heads.csv", keep_default_na=False)
    every = list(map(str, Role))
    heads["roles"] = [";".join(every) if i == 0 else every[i % len(every)]
                      for i in range(len(heads))]  # fmt: skip
    heads.to_csv(folder / "heads.csv", index=False)
    result = invoke("report", folder)
    assert result.exit_code == 0, result.output
    page = (folder / "index.html").read_text()
    for role in Role:
        assert f'class="role-{role}"' in page, role


def test_a_role_the_report_cannot_show_fails_the_contract(monkeypatch):
    """An analysis that grants a role the report has no place for is refused before any
    compute, naming the analysis and the role."""
    order = tuple(r for r in vocabulary_module.DESCRIBED_FIRST if r != Role.RETRIEVAL)
    monkeypatch.setattr(vocabulary_module, "DESCRIBED_FIRST", order)
    monkeypatch.setattr(analyses, "_PASSED", set())
    with pytest.raises(ContractError, match=r"'retrieval'.*gives the role 'retrieval'.*lacks"):
        check_analysis(analyses.get("retrieval"), "retrieval")


def test_a_run_that_finds_retrieval_heads_writes_its_report(tmp_path):
    """Every head with any retrieval score holds the role at threshold 0: the report is
    written, and names the role with the statistic behind it."""
    out = tmp_path / "report"
    # a haystack the model's 64-symbol vocabulary reads: English would be its unknown token
    # throughout, and the run would skip the analysis (probe.inputs.unknown)
    treebank = symbols_treebank(tmp_path / "symbols.conllu")
    result = invoke("analyze", "-m", MODEL, "-t", treebank, "-a", "retrieval", "--threshold",
                    "retrieval=0", "-o", out, "-q")  # fmt: skip
    assert result.exit_code == 0, result.output
    heads = pd.read_csv(out / "heads.csv", keep_default_na=False)
    held = heads[heads.roles.str.contains("retrieval")]
    assert len(held) and (held.retrieval_score > 0).all()
    assert "retrieval: retrieval score" in (out / "index.html").read_text()
