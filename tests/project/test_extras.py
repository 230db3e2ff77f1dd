"""TransformerLens (which pulls in wandb) is the ``parity`` extra's, not ``dev``'s: the README's
set-up does not install it, CI does, and every test that needs it skips, saying why, where it
is absent."""

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NEEDING = [
    "tests/capture/test_tl_names.py",
    "tests/capture/test_tl_parity.py",
    "tests/weights/test_composition.py::test_equals_transformer_lens_on_the_same_weights",
    "tests/end_to_end/test_tutorials.py::test_the_tutorial_runs_and_its_asserts_hold[from_transformerlens]",
]


def test_transformer_lens_is_its_own_extra_which_ci_installs():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = extras["optional-dependencies"]
    lens = lambda extra: any(r.startswith("transformer-lens") for r in extras[extra])  # noqa: E731
    assert not lens("dev") and lens("parity")
    assert re.search(
        r"pip install -q -e '\.\[[a-z,]*parity[a-z,]*\]'", (ROOT / ".ci/run").read_text()
    )
    readme = (ROOT / "README.md").read_text()
    assert "pip install torch==2.13.0 && pip install -e '.[dev,demo]'" in readme


def test_every_test_that_imports_it_is_listed_here():
    """Each file that names transformer_lens is one NEEDING runs (a new one must skip too)."""
    naming = {
        str(p.relative_to(ROOT))
        for p in [*(ROOT / "tests").rglob("test_*.py"), *(ROOT / "docs/tutorials").glob("*.py")]
        if re.search(r"^\s*(from|import) transformer_lens", p.read_text(), re.MULTILINE)
    }
    tutorials = {"docs/tutorials/from_transformerlens.py": "tests/end_to_end/test_tutorials.py"}
    listed = {n.partition("::")[0] for n in NEEDING}
    assert {tutorials.get(n, n) for n in naming} == listed


@pytest.mark.slow
def test_without_transformer_lens_its_tests_skip_saying_why(tmp_path):
    """With a transformer_lens that cannot be imported first on the path, the tests that need
    it are skipped, each with the extra to install, and none fails."""
    blocked = tmp_path / "transformer_lens"
    blocked.mkdir()
    (blocked / "__init__.py").write_text(  # what an import of a missing module raises
        "raise ModuleNotFoundError(\"No module named 'transformer_lens'\", name=__name__)\n"
    )
    path = os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-rs", "-p", "no:cacheprovider",
         *NEEDING],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
        env=os.environ | {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    skipped = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    assert done.returncode == 0 and re.search(r"^\d+ skipped in", done.stdout, re.M), done.stdout
    assert all(".[parity]" in line and "not installed" in line for line in skipped), skipped
    files = {n.partition("::")[0] for n in NEEDING}  # each one's skip, at its line
    assert {f for f in files if any(f in line for line in skipped)} == files, skipped
