"""The tutorials (``docs/tutorials/*.py``, notebooks kept as jupytext percent scripts) run as
notebooks, offline, on the CPU, in a kernel of this Python: each asserts what it shows (a
tutorial whose induction head is not found, or whose rows differ from the full pattern, fails
here). The docs site executes them again to render their outputs (``mkdocs.yml``). They are
Python too: ``python docs/tutorials/first_report.py`` runs it, no shell magic (a ``!probe`` cell
is a comment to Python), its command line run by this Python."""

import os
import subprocess
import sys
from pathlib import Path

import jupytext
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = sorted((ROOT / "docs" / "tutorials").glob("*.py"))
NAV = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")


def run(path: Path, folder: Path) -> None:
    """Execute the tutorial at ``path`` as a notebook, in ``folder``; raises the failing cell's
    error (``CellExecutionError``, with its traceback)."""
    notebook = jupytext.read(path)
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
