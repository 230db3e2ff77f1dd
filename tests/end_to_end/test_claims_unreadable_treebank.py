"""Claims run wherever their inputs exist (issue #66): on the induction model, whose word-level
vocabulary reads none of the default treebank's words, the vocabulary warning skips only what
reads the treebank; the repeated-sequence claims (previous-token, induction) read none, and are
tested and confirmed."""

import json

import pandas as pd
import pytest
from induction import INDUCTION, MODEL, PREVIOUS_TOKEN
from treebanks import needs_ewt
from typer.testing import CliRunner

from probe.app.cli import app


@pytest.mark.slow
@needs_ewt()
def test_the_induction_models_claims_run_beside_an_unreadable_treebank(tmp_path):
    out = tmp_path / "r"
    args = ["analyze", "-m", str(MODEL), "-a", "taxonomy,claims", "--lm-head", "-o", str(out)]
    result = CliRunner().invoke(app, args)  # the default treebank: EWT
    assert result.exit_code == 0, result.output
    warned = [line for line in result.output.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and "treebank's words" in warned[0] and "skipped" not in warned[0]
    run = json.loads((out / "run.json").read_text())
    # qk follows the taxonomy (its splits of the roles' scores)
    assert run["analyses"] == ["taxonomy", "claims", "qk"] and not run["skipped"]
    claims = pd.read_csv(out / "claims.csv").set_index(["layer", "head"])
    assert claims.loc[PREVIOUS_TOKEN, "claim"] == "previous-token"
    assert claims.loc[PREVIOUS_TOKEN, "confirmed"]
    assert claims.loc[INDUCTION, "claim"] == "induction" and claims.loc[INDUCTION, "confirmed"]
    assert set(claims.inputs) == {"repeats"}
    assert "confirmed by ablation" in (out / "index.html").read_text()
