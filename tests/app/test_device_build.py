"""``--device cuda`` on a torch built without CUDA is refused in the plan, from the build's
``torch/version.py`` read as text: torch is not imported (which took 5.6-9.6 s before the
refusal). A CUDA or ROCm build is never refused there: tests fake each build's file."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLAN = textwrap.dedent("""
    import json, sys
    from probe.app.plan import Settings, plan, torch_build
    from probe.errors import ProbeError
    try:
        plan(Settings("minilm", treebank=["sample"], device=sys.argv[1], out=sys.argv[2]))
        refused = None
    except ProbeError as e:
        refused = str(e)
    print(json.dumps({"refused": refused, "build": torch_build(),
                      "torch": "torch" in sys.modules}))
""")
# torch/version.py as each build's wheel writes it (2.13.0's, ROCm's as its wheels name it).
BUILDS = {
    "cpu": ("2.13.0+cpu", None, None),
    "cuda": ("2.13.0+cu128", "12.8", None),
    "cuda-unlabelled": ("2.13.0", "12.8", None),  # PyPI's Linux wheel: no local version
    "rocm": ("2.13.0+rocm6.4", None, "6.4.43482"),
}


def fake_torch(folder: Path, version: str, cuda: str | None, hip: str | None) -> Path:
    """A torch package whose import would fail, with a ``version.py`` of the build's form."""
    package = folder / "torch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('the plan imported torch')\n")
    (package / "version.py").write_text(
        "from typing import Optional\n\n"
        "__all__ = ['__version__', 'debug', 'cuda', 'git_version', 'hip', 'rocm', 'xpu']\n"
        f"__version__ = {version!r}\ndebug = False\ncuda: Optional[str] = {cuda!r}\n"
        f"git_version = 'cf30153c4c131c8164ee7798e5022d810682e2cb'\nhip: Optional[str] = {hip!r}\n"
        "rocm: Optional[str] = None\nxpu: Optional[str] = None\n"
    )
    return folder


def plan(tmp_path: Path, device: str, torch_at: Path | None = None) -> dict:
    path = os.pathsep.join([*([str(torch_at)] if torch_at else []), str(ROOT)])
    done = subprocess.run([sys.executable, "-c", PLAN, device, str(tmp_path / "r")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=os.environ | {"PYTHONPATH": path})  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("build", sorted(BUILDS))
def test_cuda_is_refused_on_a_build_without_it_and_only_there(tmp_path, build):
    version, cuda, hip = BUILDS[build]
    got = plan(tmp_path, "cuda:1", fake_torch(tmp_path / "site", version, cuda, hip))
    assert got["build"] == [version, cuda is not None or hip is not None]
    assert not got["torch"]
    if build == "cpu":
        assert got["refused"] == (
            "--device cuda:1: the installed torch (2.13.0+cpu) is built without CUDA; use "
            "--device cpu, or install a CUDA build of torch (pytorch.org/get-started)"
        )
    else:
        assert got["refused"] is None


def test_the_installed_build_is_read_as_torch_itself_says():
    """The reading of this machine's torch/version.py agrees with the imported torch."""
    import torch

    from probe.app.plan import torch_build

    gpu = torch.version.cuda is not None or torch.version.hip is not None
    assert torch_build() == (torch.__version__, gpu)


@pytest.mark.slow
def test_the_command_refuses_in_one_line_without_importing_torch(tmp_path):
    """The real build of this machine: refused in the plan when it has no CUDA, else planned;
    torch is imported in neither case."""
    import torch

    got = plan(tmp_path, "cuda")
    assert not got["torch"]
    if torch.version.cuda is None and torch.version.hip is None:
        assert got["refused"].startswith(
            f"--device cuda: the installed torch ({torch.__version__})"
        )
    else:
        assert got["refused"] is None


def test_mps_is_refused_off_macos(monkeypatch):
    from probe.app import plan
    from probe.errors import ProbeError

    monkeypatch.setattr(sys, "platform", "linux")
    with pytest.raises(ProbeError, match=r"^--device mps is Apple's GPU, which this machine"):
        plan._check_build("mps")
    monkeypatch.setattr(sys, "platform", "darwin")
    plan._check_build("mps")  # torch says, once loaded, whether this Mac has it
    plan._check_build("cpu")
