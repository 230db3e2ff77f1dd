"""``--overwrite`` replaces only what the same command wrote: a report for ``analyze``, figures
for ``figures``, a comparison for ``compare``, an experiment's report for ``experiment``. Every
command is run against every other's folder (and its own input): each is refused in one line
and left as it was; only the same kind is replaced."""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from probe.app.cli import app
from probe.app.output import MARKER, check_free, kind_of
from probe.errors import ProbeError

pytestmark = pytest.mark.slow  # runs real models or the whole command line

KINDS = ("report", "figures", "comparison", "experiment")


def invoke(*args) -> object:
    return CliRunner().invoke(app, [str(a) for a in args])


def contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}  # fmt: skip


@pytest.fixture(scope="module")
def written(tiny_report, tmp_path_factory) -> dict[str, Path]:
    """One folder of each kind, as each command writes it (the experiment's by hand: training
    takes minutes, and only its marker and card matter here)."""
    root = tmp_path_factory.mktemp("kinds")
    report = root / "report"
    shutil.copytree(tiny_report, report)
    shutil.rmtree(report / "figures", ignore_errors=True)
    assert invoke("figures", report, "-f", "svg", "-o", root / "figures").exit_code == 0
    assert invoke("compare", report, tiny_report, "-o", root / "comparison").exit_code == 0
    experiment = root / "experiment"
    experiment.mkdir()
    (experiment / "run.json").write_text(json.dumps({"experiment": "heads"}))
    (experiment / MARKER).write_text(json.dumps({"probe": "x", "kind": "experiment"}))
    folders = {"report": report, "figures": root / "figures", "comparison": root / "comparison",
               "experiment": experiment}  # fmt: skip
    assert {kind: kind_of(folder) for kind, folder in folders.items()} == {k: k for k in KINDS}
    return folders


def command(kind: str, out: Path, written: dict[str, Path], tiny_model: Path) -> list:
    """The command that writes ``kind``, into ``out``, with --overwrite."""
    report = written["report"]
    return {
        "report": ["analyze", "-m", tiny_model, "-t", "sample", "-n", "5", "-a", "spectra", "-q"],
        "figures": ["figures", report, "-f", "svg"],
        "comparison": ["compare", report, report],
        "experiment": ["experiment", "heads", "--steps", "1", "--seeds", "1", "-q"],
    }[kind] + ["--out", out, "--overwrite"]


@pytest.mark.parametrize("target", KINDS)
@pytest.mark.parametrize("writer", KINDS)
def test_overwrite_replaces_only_the_same_kind(writer, target, written, tiny_model, tmp_path):
    folder = tmp_path / target
    shutil.copytree(written[target], folder)
    before = contents(folder)
    if writer == target == "experiment":  # training takes minutes: the check it makes first
        check_free(folder, overwrite=True, kind="experiment")
        return
    result = invoke(*command(writer, folder, written, tiny_model))
    if writer == target:
        assert result.exit_code == 0, result.output
        assert kind_of(folder) == writer and contents(folder) != before
    else:
        assert result.exit_code == 1, result.output
        line = result.output.strip()
        assert line.startswith("error:") and "\n" not in line and "Traceback" not in line, line
        assert "--overwrite replaces only what the same command wrote" in line, line
        assert contents(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [target]  # no staging folder, no lock


def test_figures_never_replace_their_own_report(written, tmp_path):
    report = tmp_path / "report"
    shutil.copytree(written["report"], report)
    before = contents(report)
    for out in (report, tmp_path):
        result = invoke("figures", report, "-f", "svg", "--out", out, "--overwrite")
        assert result.exit_code == 1 and "an input of this command" in result.output, result.output
        assert contents(report) == before
    other = tmp_path / "other"  # another report: refused, as not figures
    shutil.copytree(written["report"], other)
    result = invoke("figures", report, "-f", "svg", "--out", other, "--overwrite")
    assert result.exit_code == 1 and "holds a report (probe analyze), not figures" in result.output
    assert contents(other) == before


@pytest.mark.parametrize(
    ("files", "kind"),
    [({"run.json": "{}"}, "report"), ({"run.json": '{"experiment": "heads"}'}, "experiment"),
     ({"compare.json": "{}"}, "comparison"), ({"roles-heads.pdf": "%PDF"}, "figures"),
     ({"notes.txt": "mine"}, None), ({}, None)],
)  # fmt: skip
def test_folders_from_before_the_kind_was_recorded_are_told_by_their_files(tmp_path, files, kind):
    (tmp_path / MARKER).write_text("{}")
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert kind_of(tmp_path) == kind
    for other in KINDS:
        if other != kind:
            with pytest.raises(ProbeError, match="replaces only what the same command wrote"):
                check_free(tmp_path, overwrite=True, kind=other)


def test_figures_wait_for_no_run_replacing_their_report(written, tmp_path):
    """While ``analyze --overwrite`` replaces the report (it holds the report's lock), figures
    fail at once in one line and draw nothing from the tables being replaced."""
    from probe.app.output import reserved

    report = tmp_path / "report"
    shutil.copytree(written["report"], report)
    with pytest.raises(InterruptedError), reserved(report, overwrite=True):  # a run, stopped
        result = invoke("figures", report, "-f", "svg", "-o", tmp_path / "figures")
        assert result.exit_code == 1 and "another probe run is writing" in result.output
        assert not (tmp_path / "figures").exists()
        raise InterruptedError
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]


# ``probe figures`` with each figure drawn half a second late, so that a signal sent once its
# staging folder exists arrives while it draws, however fast the machine (a quiet one drew all
# seven figures between the folder's appearance and the signal).
SLOW_FIGURES = (
    "import sys, time\n"
    "import analyses.paper as paper\n"
    "draw = paper.draw_figure\n"
    "paper.draw_figure = lambda *a, **k: (time.sleep(0.5), draw(*a, **k))[1]\n"
    "from probe.app.cli import main\n"
    "sys.argv = ['probe', *sys.argv[1:]]\n"
    "main()\n"
)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_during_figures_leaves_nothing_behind(written, tmp_path, stop):
    """Stopped while it draws, ``probe figures`` removes its staging folder and both locks (its
    output's and the report's), and says so in one line."""
    report = tmp_path / "report"
    shutil.copytree(written["report"], report)
    before = contents(report)
    args = ["figures", str(report), "-f", "png", "-o", str(tmp_path / "figures")]
    child = subprocess.Popen([sys.executable, "-c", SLOW_FIGURES, *args],
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not any(p.name.startswith(".figures.probe-") and p.is_dir() for p in tmp_path.iterdir()):
        assert time.monotonic() < deadline and child.poll() is None, child.stderr.read()
        time.sleep(0.01)
    child.send_signal(stop)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 128 + stop, err  # the shell's status: SIGINT 130, SIGTERM 143
    assert err.startswith("error: stopped") and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]
    assert contents(report) == before
