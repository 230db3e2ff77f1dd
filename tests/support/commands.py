"""The ``probe`` command run by the tests: in this process (failing in one line), and as a
subprocess, alone or under torchrun."""

import os
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from probe.app.cli import app

runner = CliRunner()


def fails_in_one_line(args: list[str], message: str) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    assert result.output.startswith("error:") and message in result.output, result.output
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit)


SUPPORT = Path(__file__).parent  # where the launchers are (failing_rank.py)


def probe_analyze(out: Path, *args: str, processes: int = 1, launcher: str = "probe"):
    """``probe analyze`` on the demo model as a subprocess: alone, or under torchrun."""
    command = [sys.executable, "-m", "probe.app.cli"] if launcher == "probe" else [
        sys.executable, str(SUPPORT / launcher)]  # fmt: skip
    if processes > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={processes}", "--no-python", *command]  # fmt: skip
    env = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    sample = [] if {"-t", "--treebank"} & set(args) else ["-t", "sample"]
    command += ["analyze", "-m", "minilm", "-o", str(out), "-q", *sample, *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
