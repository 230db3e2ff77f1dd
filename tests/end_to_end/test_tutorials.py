"""The tutorials (``docs/tutorials/*.py``, notebooks kept as jupytext percent scripts) run as
notebooks, offline, on the CPU, in a kernel of this Python: each asserts what it shows (a
tutorial whose induction head is not found, or whose rows differ from the full pattern, fails
here). The docs site executes them again to render their outputs (``mkdocs.yml``). They are
Python too: ``python docs/tutorials/first_report.py`` runs it, no shell magic (a ``!probe`` cell
is a comment to Python), its command line run by this Python."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parents[2]
TUTORIALS = sorted((ROOT / "docs" / "tutorials").glob("*.py"))
NAV = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")


# Run first in each tutorial's kernel: every value a tutorial compares with
# torch.testing.assert_close moves by up to 1e-6 of the largest magnitude compared (a keyed random
# sign each), as another processor's float32 rounding would move it. A tolerance that does not
# scale with the values (allclose's atol=1e-8 on small effects) fails here, not on CI's machine.
PERTURB = """
import torch as _torch

_assert_close = _torch.testing.assert_close


def _perturbed(actual, expected, *args, **kwargs):
    actual, expected = _torch.as_tensor(actual), _torch.as_tensor(expected)
    if actual.is_floating_point() and actual.numel():
        signs = _torch.randint(0, 2, actual.shape, generator=_torch.Generator().manual_seed(0))
        scale = expected.abs().max().to(actual.dtype)
        actual = actual + 1e-6 * scale * (2 * signs - 1).to(actual.dtype)
    return _assert_close(actual, expected, *args, **kwargs)


_torch.testing.assert_close = _perturbed
"""


def run(path: Path, folder: Path, perturb: bool = True) -> None:
    """Execute the tutorial at ``path`` as a notebook, in ``folder``, its compared values
    perturbed (``PERTURB``) unless ``perturb`` is False; raises the failing cell's error
    (``CellExecutionError``, with its traceback)."""
    notebook = jupytext.read(path)
    if perturb:
        notebook.cells.insert(0, nbformat.v4.new_code_cell(PERTURB))
    client = NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": folder}}
    )
    client.execute()


def test_there_are_tutorials_and_the_site_lists_each():
    assert len(TUTORIALS) >= 5
    for path in TUTORIALS:
        assert f"tutorials/{path.name}" in NAV, f"mkdocs.yml's nav lacks {path.name}"


@pytest.mark.slow
@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.stem)
def test_the_tutorial_runs_and_its_asserts_hold(path, tmp_path, monkeypatch):
    if "transformer_lens" in path.read_text(encoding="utf-8"):
        pytest.importorskip(
            "transformer_lens",
            reason=f"{path.name} runs TransformerLens, which is not installed "
            "(pip install -e '.[parity]')",
        )
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the kernel inherits it: nothing downloaded
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    run(path, tmp_path)


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.stem)
def test_no_tutorial_needs_jupyter_to_run(path):
    """No shell or magic cell (``!cmd``, ``%cmd``, which jupytext keeps as comments in the
    script): the notebook and ``python FILE`` run the same code."""
    notebook = jupytext.read(path)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            lines = cell.source.splitlines()
            assert not any(line.lstrip().startswith(("!", "%")) for line in lines), cell.source
    assert not [line for line in path.read_text().splitlines() if line.startswith(("# !", "# %"))
                and not line.startswith("# %%")]  # fmt: skip


@pytest.mark.slow
def test_the_first_tutorial_runs_as_a_python_script(tmp_path):
    """As a reader without Jupyter runs it: ``python docs/tutorials/first_report.py``."""
    path = ROOT / "docs" / "tutorials" / "first_report.py"
    environment = os.environ | {"HF_HUB_OFFLINE": "1", "MPLBACKEND": "Agg"}
    environment["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
    )
    done = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=environment,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "det: head" in done.stdout  # it ran to its last printed line


@pytest.mark.slow
def test_a_failing_assert_in_a_tutorial_fails_the_run(tmp_path):
    """The check can fail: a tutorial whose assert does not hold raises."""
    broken = tmp_path / "broken.py"
    broken.write_text("# %%\nfound = 2\n\n# %%\nassert found == 3, 'no induction head'\n")
    with pytest.raises(CellExecutionError, match="no induction head"):
        run(broken, tmp_path)


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.stem)
def test_tutorials_compare_floats_with_tolerances_scaled_to_the_values(path):
    """No ``allclose`` (its default atol of 1e-8 does not scale with the values: a float32 sum's
    rounding follows its largest term, not each small one), no ``==`` against a float, and every
    ``assert_close`` names both its rtol and its atol; explicit bounds (``difference < 1e-5``)
    stay, exact checks (``torch.equal``, a masked weight ``== 0``) too."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        where = f"{path.name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Call):
            name = (
                node.func.attr
                if isinstance(node.func, ast.Attribute)
                else getattr(node.func, "id", "")
            )
            assert name != "allclose", f"{where}: allclose; use assert_close with rtol and atol"
            if name == "assert_close":
                given = {keyword.arg for keyword in node.keywords}
                assert {"rtol", "atol"} <= given, f"{where}: assert_close without rtol and atol"
        if isinstance(node, ast.Compare) and any(isinstance(op, ast.Eq) for op in node.ops):
            sides = [node.left, *node.comparators]
            floats = [
                s for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, float)
            ]
            assert not floats, f"{where}: == against a float; compare with a tolerance"


def test_the_transformerlens_tutorial_names_its_extra_and_stops_in_one_line_without_it():
    """The tutorial that runs TransformerLens says in its first cell that it needs the ``parity``
    extra, as the README does, and without TransformerLens stops in one line saying so, not in a
    traceback."""
    path = ROOT / "docs" / "tutorials" / "from_transformerlens.py"
    first_cell = path.read_text(encoding="utf-8").split("# %%\n")[0]
    assert "`parity` extra" in first_cell and "pip install -e '.[parity]'" in first_cell
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert re.search(r"`parity` for [^.]*from_transformerlens\.py", readme)
    hidden = (  # None in sys.modules: an import of it fails, as where it is not installed
        "import runpy, sys; sys.modules['transformer_lens'] = None; "
        f"runpy.run_path({str(path)!r}, run_name='__main__')"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", hidden], capture_output=True, text=True, env=env)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "pip install -e '.[parity]'" in lines[0]
