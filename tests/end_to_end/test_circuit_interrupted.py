"""``probe analyze -a circuit --task FILE`` interrupted at every stage: planning, loading, the
circuit's compute, writing. Each SIGINT or SIGTERM ends the run with the shell's status (130,
143) and one line, no traceback; the output folder is absent, or the complete report it held
before (``--overwrite``); no staging folder, lock or temporary file is left, and no process of
the run's (its session) outlives it."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from induction import MODEL

ROOT = Path(__file__).resolve().parents[2]

PAIRS = 48


def _task(path: Path) -> Path:
    rng = random.Random(0)
    with path.open("w") as out:
        for _ in range(PAIRS):
            first = [rng.randrange(1, 64) for _ in range(12)]
            fresh = [rng.randrange(1, 64) for _ in range(12)]
            words = " ".join
            out.write(json.dumps({"clean": words(f"t{t}" for t in first + first[:-1]),
                                  "corrupted": words(f"t{t}" for t in fresh + first[:-1]),
                                  "answer": f"t{first[-1]}"}) + "\n")  # fmt: skip
    return path


def _entry_point() -> list[str]:
    """The ``probe`` command as pyproject.toml installs it (``module:function``), so that an
    installed script of an older version is not what is tested."""
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, function = scripts["probe"].split(":")
    return [sys.executable, "-c", f"import sys; from {module} import {function}; "
            f"sys.argv[0] = 'probe'; sys.exit({function}())"]  # fmt: skip


PROBE = _entry_point()


def _command(task: Path, out: Path, *more: str) -> list[str]:
    return [*PROBE, "analyze", "--model", str(MODEL), "-a", "circuit", "--lm-head", "--task",
            str(task), "--circuit-pairs", str(PAIRS), "--out", str(out), *more]  # fmt: skip


def _session(sid: int) -> list[int]:
    """The processes of session ``sid`` still alive (zombies are not: they hold nothing)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # state, ppid, pgrp, session, ...
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def _contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}  # fmt: skip


def _env(tmp: Path) -> dict[str, str]:
    return {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"}


def _complete(report: Path) -> bool:
    return (report / ".probe-report").is_file() and (report / "circuit_run.csv").is_file()


def _interrupt(command, env, stop, when, root: Path):
    """Run ``command`` in a session of its own and signal it when ``when()`` says the moment
    has come; return its status, stderr and whether it was signalled before it ended."""
    child = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                             text=True, env=env, start_new_session=True)  # fmt: skip
    sent = False
    when.start(child.pid)
    try:
        while child.poll() is None:
            if when():
                child.send_signal(stop)
                sent = True
                break
            time.sleep(0.005)
        _, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    deadline = time.monotonic() + 10
    while _session(child.pid) and time.monotonic() < deadline:  # a helper ends on its own
        time.sleep(0.05)
    assert not _session(child.pid), f"processes of the run left behind: {_session(child.pid)}"
    return child.returncode, err, sent


class Moment:
    """When to signal a run writing to ``root / "report"``: ``after`` seconds past the moment
    probe's first lines answer SIGTERM (``caught``: before them the interpreter itself starts,
    out of probe's hands) or past the staging folder's appearance (``staging``), or when the
    lock or a written file appears (``marker``)."""

    def __init__(self, name: str, root: Path, after: float = 0.0, marker: str = "") -> None:
        self.name, self.root, self.after, self.marker = name, root, after, marker

    def start(self, pid: int) -> None:
        self.pid, self.seen = pid, None

    def __call__(self) -> bool:
        if self.marker == "lock":
            return any(self.root.glob(".report.probe-lock"))
        stagings = [p for p in self.root.glob(".report.probe-*-*") if p.is_dir()]
        if self.marker == "written":
            return any(any(p.iterdir()) for p in stagings)
        began = _catches_sigterm(self.pid) if self.marker == "caught" else bool(stagings)
        if self.seen is None and began:
            self.seen = time.monotonic()
        return self.seen is not None and time.monotonic() - self.seen >= self.after


def _catches_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has a handler for SIGTERM (its status's SigCgt mask)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(mask, 16) >> (signal.SIGTERM - 1) & 1)


def _stages(root: Path, command, env) -> tuple[float, float]:
    """A whole run's seconds from the staging folder's appearance to its first file (the
    circuit's compute, after the model loaded), and in all."""
    child = subprocess.Popen(command, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             env=env)  # fmt: skip
    start, staged, written = time.monotonic(), None, None
    while child.poll() is None:
        stagings = [p for p in root.glob(".report.probe-*-*") if p.is_dir()]
        if staged is None and stagings:
            staged = time.monotonic()
        if written is None and any(any(p.iterdir()) for p in stagings):
            written = time.monotonic()
        time.sleep(0.005)
    assert child.returncode == 0 and staged and written
    return written - staged, time.monotonic() - start


@pytest.mark.slow
def test_the_circuit_run_interrupted_anywhere_leaves_nothing_half_done(tmp_path):
    """Each point takes SIGINT and SIGTERM, one into a fresh folder and the other with
    --overwrite over a previous report, alternating: every point and every signal meets both."""
    task = _task(tmp_path / "task.jsonl")
    root = tmp_path / "runs"
    root.mkdir()
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = _env(temporary)
    previous = tmp_path / "previous"
    done = subprocess.run(_command(task, previous), capture_output=True, text=True, env=env,
                          check=False)  # fmt: skip
    assert done.returncode == 0 and _complete(previous), done.stderr
    before = _contents(previous)
    cached = {p.name for p in temporary.iterdir()}  # torch's own caches (torchinductor_USER)
    window, took = _stages(root, _command(task, root / "report"), env)
    shutil.rmtree(root / "report")
    print(f"a whole run: {took:.1f} s, {window:.1f} s from its staging folder to its first file")
    points = [
        *(Moment(f"starting + {t} s", root, t, "caught") for t in (0.0, 0.1, 0.2, 0.4)),
        Moment("reserved", root, marker="lock"),
        *(Moment(f"compute {f:.0%}", root, f * window, "staging") for f in (0.1, 0.4, 0.7)),
        Moment("writing", root, marker="written"),
    ]
    interrupted = 0
    for i, when in enumerate(points):
        for j, stop in enumerate((signal.SIGINT, signal.SIGTERM)):
            overwrite = (i + j) % 2 == 1
            out = root / "report"
            if overwrite:
                shutil.copytree(previous, out)
            more = ("--overwrite",) if overwrite else ()
            status, err, sent = _interrupt(_command(task, out, *more), env, stop, when, root)
            label = f"{stop.name} at {when.name}{' (--overwrite)' if overwrite else ''}"
            print(label, status, err.strip())
            if status == 0:  # it finished first: then its report is whole
                assert _complete(out), label
            else:
                interrupted += 1
                assert sent and status == 128 + stop, (label, status, err)
                assert "Traceback" not in err and len(err.strip().splitlines()) == 1, (label, err)
                if overwrite:
                    assert _contents(out) == before, label  # the previous report, untouched
                else:
                    assert not out.exists(), label
            names = sorted(p.name for p in root.iterdir())
            assert names == (["report"] if out.exists() else []), (label, names)
            left = {p.name for p in temporary.iterdir()} - cached
            assert not left, (label, left)
            shutil.rmtree(out, ignore_errors=True)
    assert interrupted >= 2 * (len(points) - 1), interrupted
