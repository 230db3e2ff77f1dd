"""The analysis contract (``analyses.check_analysis``), checked over every registry entry, as
scikit-learn's ``check_estimator`` checks estimators; and each way of breaking it fails before
any model is loaded, in one line that names the analysis."""

from typing import ClassVar

import pandas as pd
import pytest
from typer.testing import CliRunner

import analyses
import analyses.contract
from analyses import Analysis, ContractError, Measure, Schema, check_analysis
from analyses.figures import Figure
from probe.app.cli import app
from probe.options import Option

runner = CliRunner()
# A model that does not exist: a check that ran after loading would report it instead.
MISSING = "/nonexistent/model-folder"


@pytest.mark.parametrize("name", list(analyses.REGISTRY))
def test_every_registered_analysis_keeps_the_contract(name):
    check_analysis(analyses.get(name), name)


class Weights(Analysis):
    """A well-formed analysis of the weights alone (no input, no forward pass)."""

    name = "weights"
    title = "Weights"
    unit = None
    tables: ClassVar[dict[str, Schema]] = {"weights": {"layer": "int", "head": "int", "w": "float"}}
    head_columns: ClassVar[Schema] = {"weights_w": "float"}
    measures = (Measure("weights_w", "w", "num", "higher"),)

    def merge(self, other):
        self._check_mergeable(other)

    def _tables(self):
        L, H = self.context.n_layers, self.context.n_heads
        rows = [(layer, head, 0.0) for layer in range(L) for head in range(H)]
        return {"weights": pd.DataFrame(rows, columns=["layer", "head", "w"])}

    @classmethod
    def heads(cls, tables, thresholds):
        return tables["weights"].rename(columns={"w": "weights_w"})


class Misnamed(Weights):
    name = "misnamed"


class NoCard(Weights):
    @classmethod
    def template(cls):
        return "{% macro section(s, run) %}{% endmacro %}"


class Misspelt(Weights):
    head_columns: ClassVar[Schema] = {"weights_v": "float"}  # heads() gives weights_w
    measures = ()


class Extra(Weights):
    @classmethod
    def heads(cls, tables, thresholds):
        return super().heads(tables, thresholds).assign(weights_extra=1.0)


class Other(Weights):
    """Another well-formed one, with a table and a head column of its own."""

    name = "other"
    tables: ClassVar[dict[str, Schema]] = {"other": {"layer": "int", "head": "int", "w": "float"}}
    head_columns: ClassVar[Schema] = {"other_w": "float"}
    measures = ()

    def _tables(self):
        return {"other": super()._tables()["weights"]}

    @classmethod
    def heads(cls, tables, thresholds):
        return tables["other"].rename(columns={"w": "other_w"})


class SameTable(Other):
    tables: ClassVar[dict[str, Schema]] = {"weights": Weights.tables["weights"]}

    @classmethod
    def heads(cls, tables, thresholds):
        return tables["weights"].rename(columns={"w": "other_w"})


class HeadsTable(Weights):
    tables: ClassVar[dict[str, Schema]] = {"heads": {"layer": "int", "head": "int"}}


class WindowOption(Weights):
    options = (Option("window", 3, "A window."),)


class OtherWindowOption(Other):
    options = (Option("window", 5, "Another window."),)


class SeedOption(Weights):
    options = (Option("seed", 1, "A seed of its own."),)


class UnknownUnit(Weights):
    unit = "paragraph"


class BadType(Weights):
    tables: ClassVar[dict[str, Schema]] = {"weights": {"layer": "int", "head": "int", "w": "real"}}


class HeadSaidAsText(Weights):
    lm_head = "yes"


CASES = {
    "key and name differ": ({"weights": Misnamed}, "registered as 'weights' but its name is"),
    "no card macro": ({"weights": NoCard}, "has no 'card' macro"),
    "a misspelt head column": ({"weights": Misspelt}, "weights_w) or lacks declared ones"),
    "an extra head column": ({"weights": Extra}, "does not declare (weights_extra)"),
    "two analyses, one table": (
        {"weights": Weights, "other": SameTable},
        "'weights' and 'other' both declare a table",
    ),
    "a table named heads": ({"weights": HeadsTable}, "declares a table named 'heads'"),
    "one option, two meanings": (
        {"weights": WindowOption, "other": OtherWindowOption},
        "--window is declared by both 'weights' and 'other'",
    ),
    "an option of probe analyze": ({"weights": SeedOption}, "'weights' declares option --seed"),
    "an unknown unit": ({"weights": UnknownUnit}, "reads the unknown unit 'paragraph'"),
    "an unknown column type": ({"weights": BadType}, "columns of unknown types {'w': 'real'}"),
    "lm_head not a bool": ({"weights": HeadSaidAsText}, "declares lm_head = 'yes'"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_broken_contract_fails_before_the_model_loads(case, monkeypatch, tmp_path):
    classes, message = CASES[case]
    for key, cls in classes.items():
        monkeypatch.setitem(analyses.REGISTRY, key, f"{__name__}:{cls.__name__}")
    args = ["analyze", "-m", MISSING, "-a", ",".join(classes), "-o", str(tmp_path / "r"), "-q"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert "model" not in lines[0] and not (tmp_path / "r").exists()
    named = [k for k in classes if f"'{k}'" in lines[0]]
    assert named, f"the message names no analysis: {lines[0]}"


def test_looking_up_a_shipped_analysis_leaves_its_template_to_this_file(monkeypatch):
    """Each start of the command looks every analysis up: a shipped one's template is parsed
    here (``test_every_registered_analysis_keeps_the_contract``), not there; a plugin's still
    is, and a broken one is still refused at lookup."""
    parsed = []
    real = analyses.contract._macros.__wrapped__
    monkeypatch.setattr(
        analyses.contract, "_macros", lambda source: parsed.append(source) or real(source)
    )
    monkeypatch.setattr(analyses, "_PASSED", set())
    for name in analyses.REGISTRY:
        analyses.get(name)
    assert parsed == []
    check_analysis(analyses.get("syntax"), "syntax")  # in full: the template too
    assert parsed == [analyses.get("syntax").template()]
    monkeypatch.setitem(analyses.REGISTRY, "weights", f"{__name__}:NoCard")
    with pytest.raises(ContractError, match="has no 'card' macro"):
        analyses.get("weights")


def test_the_well_formed_one_passes_and_gets_the_default_template(monkeypatch):
    monkeypatch.setitem(analyses.REGISTRY, "weights", f"{__name__}:Weights")
    cls = analyses.get("weights")
    check_analysis(cls, "weights")
    assert cls.template() == analyses.DEFAULT_TEMPLATE  # no templates/weights.html.j2


def test_an_option_is_checked_where_it_is_declared(tmp_path):
    out = str(tmp_path / "r")
    zero = runner.invoke(app, ["analyze", "-m", MISSING, "-a", "importance",
                               "--importance-sentences", "0", "-o", out])  # fmt: skip
    assert zero.exit_code == 1 and "--importance-sentences must be ≥ 1, not 0" in zero.output
    stray = runner.invoke(app, ["analyze", "-m", MISSING, "-a", "spectra",
                                "--importance-sentences", "5", "-o", out])  # fmt: skip
    assert stray.exit_code == 1
    assert "--importance-sentences is an option of importance" in stray.output
    wrong = runner.invoke(app, ["analyze", "-m", MISSING, "-a", "importance",
                                "--importance-ablation", "max", "-o", out])  # fmt: skip
    assert "unknown --importance-ablation 'max'; use mean or zero" in wrong.output


def test_option_declarations():
    width = Option("width", 2, "A width.", min=1, max=8)
    assert width.check("3") == 3 and width.flag == "--width" and width.range == "between 1 and 8"
    for bad in ("x", 0, 9, 2.5):
        with pytest.raises(Exception, match="--width"):
            width.check(bad)
    share = Option("share", 0.5, "A share.", min=0, max=1)
    with pytest.raises(Exception, match="finite"):
        share.check(float("nan"))
    with pytest.raises(ValueError, match="not in its choices"):
        Option("mode", "max", "A mode.", choices=("mean", "zero"))
    with pytest.raises(ValueError, match="lower-case identifier"):
        Option("Mode", 1, "A mode.")


def test_figures_are_inline_svg_only():
    Figure("id", "title", "alt", "<svg></svg>")
    with pytest.raises(TypeError):
        Figure("id", "title", "alt", "<svg></svg>", "png")


def test_contract_errors_from_the_python_api_name_the_analysis(monkeypatch):
    monkeypatch.setitem(analyses.REGISTRY, "weights", f"{__name__}:Misspelt")
    with pytest.raises(ContractError, match=r"'weights'.*weights_w"):
        check_analysis(analyses.get("weights"), "weights")
