"""Report folders as someone else may hand them over: cut, edited, from an older probe, with
links in them. ``probe report`` and ``probe compare`` end in a page or in one line, never in a
traceback, and never write outside their output folder (property-based: hypothesis mutates a
small valid report, written once by a tiny model)."""

import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from probe.app.cli import app
from probe.app.folder import SCHEMA

pytestmark = pytest.mark.slow  # runs real models or the whole command line

FUZZ = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,  # the same mutations every run: a failure is reproduced, not sampled
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def ends_well(result) -> None:
    """A page, or one line that starts ``error:``; never an exception that escaped."""
    if result.exit_code == 0:
        return
    assert result.exit_code == 1, (result.output, result.exception)
    lines = result.output.strip().splitlines()
    assert lines and lines[0].startswith("error:"), result.output
    assert "Traceback" not in result.output


def snapshot(root: Path, skip: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` but those in ``skip``: its size and modification time."""
    seen = {}
    for folder, _, files in os.walk(root):
        if Path(folder) == skip or skip in Path(folder).parents:
            continue
        for name in files:
            stat = os.lstat(Path(folder) / name)
            seen[str(Path(folder) / name)] = (stat.st_size, stat.st_mtime_ns)
    return seen


# Mutations: (file, how). Each keeps the folder a folder; what is in it is anyone's guess.
FILES = ["run.json", "heads.csv", "head_stats.csv", "syntax.csv", "syntax_best.csv",
         "spectra.csv", "coref.csv", "examples.json", "attention.npz", ".probe-report"]  # fmt: skip
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)
JSON_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(),
                        TEXT, st.lists(st.integers(-3, 3), max_size=3), st.just({}))  # fmt: skip


@st.composite
def mutations(draw):
    file = draw(st.sampled_from(FILES))
    kind = draw(st.sampled_from(["cut", "delete", "empty", "bytes", "header", "cell", "column",
                                 "json"]))  # fmt: skip
    return file, kind, draw(st.floats(0, 1)), draw(TEXT), draw(JSON_VALUES)


def mutate(folder: Path, mutation) -> None:
    file, kind, where, text, value = mutation
    path = folder / file
    if not path.exists():
        return
    data = path.read_bytes()
    at = int(where * len(data))
    if kind == "cut":
        path.write_bytes(data[:at])
    elif kind == "delete":
        path.unlink()
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "bytes":
        path.write_bytes(data[:at] + text.encode() + data[at + len(text.encode()) :])
    elif kind == "header" and file.endswith(".csv"):
        path.write_bytes(data.split(b"\n", 1)[0] + b"\n")
    elif kind in ("cell", "column") and file.endswith(".csv"):
        rows = [line.split(",") for line in data.decode().split("\n")]
        column = int(where * len(rows[0])) % len(rows[0])
        for number, row in enumerate(rows):
            if column < len(row) and (kind == "column" or number == 1 + int(where * 7)):
                row[column] = "" if kind == "column" and number else text.replace(",", ";")
        path.write_text("\n".join(",".join(r) for r in rows))
    elif kind == "json" and file.endswith(".json"):
        card = json.loads(data)
        keys = sorted(card) if isinstance(card, dict) else []
        if keys:
            key = keys[int(where * len(keys)) % len(keys)]
            if where < 0.3:
                del card[key]
            else:
                card[key] = value
        path.write_text(json.dumps(card))


@FUZZ
@given(mutation=mutations())
def test_report_on_any_mutation_is_a_page_or_one_line(tiny_report, tmp_path_factory, mutation):
    root = tmp_path_factory.mktemp("fuzz")
    folder = root / "report"
    shutil.copytree(tiny_report, folder)
    (root / "thesis.tex").write_text("years of work")
    mutate(folder, mutation)
    before = snapshot(root, folder)
    ends_well(invoke("report", str(folder)))
    assert snapshot(root, folder) == before
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # no lock or staging left


@FUZZ
@given(mutation=mutations(), first=st.booleans())
def test_compare_on_any_mutation_is_a_page_or_one_line(
    tiny_report, tmp_path_factory, mutation, first
):
    root = tmp_path_factory.mktemp("fuzz")
    folder = root / "report"
    shutil.copytree(tiny_report, folder)
    mutate(folder, mutation)
    out = root / "comparison"
    before = snapshot(root, out)
    pair = (folder, tiny_report) if first else (tiny_report, folder)
    ends_well(invoke("compare", *map(str, pair), "--out", str(out)))
    assert snapshot(root, out) == before
    assert not [p for p in root.iterdir() if p.name.startswith(".")]


def copy(report: Path, root: Path) -> Path:
    folder = root / "report"
    shutil.copytree(report, folder)
    return folder


def one_line(result, *messages: str) -> str:
    assert result.exit_code == 1, (result.output, result.exception)
    line = result.output.strip()
    assert line.startswith("error:") and "Traceback" not in line, line
    assert all(m in line for m in messages), line
    return line


def edit_json(path: Path, change) -> None:
    card = json.loads(path.read_text())
    change(card)
    path.write_text(json.dumps(card))


@pytest.mark.parametrize(
    ("damage", "messages"),
    [
        (
            lambda f: (f / "heads.csv").write_text(
                (f / "heads.csv").read_text().replace("broad", "wizard", 1)
            ),
            ["unknown role 'wizard'"],
        ),
        (
            lambda f: (f / "heads.csv").write_text(
                (f / "heads.csv").read_text().split("\n")[0] + "\n"
            ),
            ["heads.csv", "one row per head"],
        ),
        (
            lambda f: (f / "attention.npz").write_bytes((f / "attention.npz").read_bytes()[:5000]),
            ["attention.npz", "malformed"],
        ),
        (
            lambda f: edit_json(f / "run.json", lambda c: c.pop("layers")),
            ["no readable run.json", "'layers'"],
        ),
        (
            lambda f: edit_json(f / "run.json", lambda c: c.update(schema=99)),
            ["newer probe", "layout version 99", "upgrade probe"],
        ),
        (
            lambda f: (f / "head_stats.csv").write_text(
                "\n".join(
                    ",".join(r.split(",")[:-2])
                    for r in (f / "head_stats.csv").read_text().split("\n")
                )
            ),
            [
                "head_stats.csv cannot be read: it lacks columns",
                f"layout version {SCHEMA}",
                "re-run probe analyze",
            ],
        ),
    ],
    ids=["unknown-role", "header-only-heads", "cut-attention", "no-layers", "newer", "older"],
)
def test_tampered_folders_are_refused_in_one_line(tiny_report, tmp_path, damage, messages):
    folder = copy(tiny_report, tmp_path)
    damage(folder)
    page = (folder / "index.html").read_bytes()
    one_line(invoke("report", str(folder)), *messages)
    one_line(invoke("compare", str(tiny_report), str(folder), "-o", str(tmp_path / "c")), *messages)
    assert (folder / "index.html").read_bytes() == page and not (tmp_path / "c").exists()


def test_report_replaces_a_link_and_never_writes_through_it(tiny_report, tmp_path):
    folder = copy(tiny_report, tmp_path)
    thesis = tmp_path / "thesis.tex"
    thesis.write_text("years of work")
    (folder / "index.html").unlink()
    (folder / "index.html").symlink_to(thesis)
    assert invoke("report", str(folder)).exit_code == 0
    assert thesis.read_text() == "years of work"
    assert not (folder / "index.html").is_symlink()
    assert "<html" in (folder / "index.html").read_text()


def test_report_waits_for_no_run_and_no_run_for_it(tiny_report, tmp_path):
    """``probe report`` on a folder that ``analyze --overwrite`` is replacing fails at once,
    and the page is not written; afterwards it renders."""
    from probe.app.output import reserved

    folder = copy(tiny_report, tmp_path)
    page = (folder / "index.html").read_bytes()
    with pytest.raises(InterruptedError), reserved(folder, overwrite=True):  # a run, then stopped
        one_line(invoke("report", str(folder)), "another probe run is writing")
        assert (folder / "index.html").read_bytes() == page
        raise InterruptedError
    assert invoke("report", str(folder)).exit_code == 0


def test_compare_never_replaces_its_own_input(tiny_report, tmp_path):
    a = copy(tiny_report, tmp_path)
    before = sorted(p.name for p in a.iterdir())
    one_line(invoke("compare", str(a), str(tiny_report), "--out", str(a), "--overwrite"),
             "is an input of this command")  # fmt: skip
    one_line(invoke("compare", str(a), str(tiny_report), "--out", str(tmp_path), "--overwrite"),
             "holds an input")  # fmt: skip
    assert sorted(p.name for p in a.iterdir()) == before


def limited(bytes_: int):
    """A child whose files cannot grow past ``bytes_`` (as on a full disk: EFBIG, no signal)."""
    import resource
    import signal

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (bytes_, bytes_))

    return apply


def test_a_full_disk_leaves_the_old_page_and_one_line(tiny_report, tmp_path):
    import subprocess
    import sys

    folder = copy(tiny_report, tmp_path)
    page = (folder / "index.html").read_bytes()
    done = subprocess.run([sys.executable, "-m", "probe.app.cli", "report", str(folder)],
                          capture_output=True, text=True, preexec_fn=limited(20_000))  # fmt: skip
    assert done.returncode == 1 and done.stderr.startswith("error: cannot write"), done.stderr
    assert "Traceback" not in done.stderr
    assert (folder / "index.html").read_bytes() == page
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in tiny_report.iterdir())
    assert [p.name for p in tmp_path.iterdir()] == ["report"]  # no lock left


def test_a_full_disk_while_writing_tables_is_one_line(tiny_report, tmp_path):
    import subprocess
    import sys

    model = tiny_report.parent / "model"
    out = tmp_path / "new"
    args = ["analyze", "-m", str(model), "-t", "sample", "-q", "-o", str(out), "-a", "syntax"]
    done = subprocess.run([sys.executable, "-m", "probe.app.cli", *args], capture_output=True,
                          text=True, preexec_fn=limited(5_000))  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith(f"error: cannot write {out}"), done.stderr
    assert "Traceback" not in done.stderr and list(tmp_path.iterdir()) == []


def test_an_older_layout_is_migrated_in_memory(tiny_report, tmp_path, monkeypatch):
    """A later layout adds a column to head_stats.csv: a step of MIGRATIONS fills it for
    folders of today's, which then render; their files are not changed."""
    from probe.app import folder as layout
    from probe.app.report import read_report

    folder = copy(tiny_report, tmp_path)
    stats = (folder / "head_stats.csv").read_bytes()
    columns = stats.split(b"\n", 1)[0].decode().split(",")
    renamed = columns[-1]  # today's last column is the one layout 2 "adds"
    rows = [line.split(",")[:-1] for line in stats.decode().strip().split("\n")]
    (folder / "head_stats.csv").write_text("\n".join(",".join(r) for r in rows) + "\n")
    one_line(invoke("report", str(folder)), "lacks columns", renamed,
             f"layout version {layout.SCHEMA}")  # fmt: skip

    def add_column(run: dict, tables: dict) -> None:
        tables["head_stats"][renamed] = float("nan")  # not measured by the older probe

    later = layout.SCHEMA + 1
    monkeypatch.setitem(layout.MIGRATIONS, layout.SCHEMA, add_column)
    monkeypatch.setattr(layout, "SCHEMA", later)
    run, tables, _ = read_report(folder)
    assert run["schema"] == later and tables["head_stats"][renamed].isna().all()
    assert invoke("report", str(folder)).exit_code == 0
    assert (folder / "head_stats.csv").read_text().count(renamed) == 0
