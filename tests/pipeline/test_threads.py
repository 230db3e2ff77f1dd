"""The wait policy of torch's threads: passive for long inputs, set before torch starts where
the user set none, never over the user's, and recorded in ``run.json`` as it was in effect."""

import json
import os
import subprocess
import sys

import pytest

SETTLE = """
import json, os, sys
{before}
from probe.pipeline import threads
os.getloadavg = lambda: ({load}, 0.0, 0.0)  # the machine as the test says it is
threads.settle({tokens})
import torch
print(json.dumps(threads.in_effect()))
"""


def settled(before: str = "", tokens: int | None = 32768, load: float = 0.0, **env: str) -> dict:
    environment = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | env
    code = SETTLE.format(before=before, tokens=tokens, load=load)
    done = subprocess.run([sys.executable, "-c", code], env=environment,
                          capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(done.stdout.splitlines()[-1])


def test_passive_for_long_inputs_where_the_user_set_nothing():
    got = settled()
    assert got["wait_policy"] == "PASSIVE"
    assert got["wait_policy_set_by_probe"] == "windows of 32768 tokens"
    assert got["torch_threads"] >= 1


@pytest.mark.parametrize("tokens", [None, 512, 4095])
def test_the_runtimes_default_for_sentences_and_short_windows_on_a_quiet_machine(tokens):
    got = settled(tokens=tokens, load=0.5)
    assert got["wait_policy"] is None and got["wait_policy_set_by_probe"] is None


def test_passive_on_a_busy_machine():
    cores = len(os.sched_getaffinity(0))
    got = settled(tokens=None, load=cores + 1.0)
    assert got["wait_policy"] == "PASSIVE"
    assert (
        got["wait_policy_set_by_probe"]
        == f"a busy machine: load {cores + 1.0:.1f} on {cores} cores"
    )


@pytest.mark.parametrize("policy", ["ACTIVE", "PASSIVE"])
def test_the_users_policy_is_kept_and_not_claimed(policy):
    got = settled(load=99.0, OMP_WAIT_POLICY=policy)
    assert got["wait_policy"] == policy and got["wait_policy_set_by_probe"] is None


def test_nothing_is_set_or_claimed_once_torch_has_started():
    """The runtime has read its policy as torch loaded: setting one now would change nothing,
    and the record would say what was not used."""
    got = settled(before="import torch", load=99.0)
    assert got["wait_policy"] is None and got["wait_policy_set_by_probe"] is None


def test_a_long_corpus_run_records_its_passive_threads(tiny_model, tmp_path):
    """``probe analyze --corpus --context 4096`` as users run it, in a fresh process."""
    corpus = tmp_path / "notes.txt"
    corpus.write_text("the cat sat on the mat and the dog lay by the door\n" * 40)
    out = tmp_path / "r"
    command = [sys.executable, "-m", "probe.app.cli", "analyze", "-m", str(tiny_model),
               "-a", "roles", "--corpus", str(corpus), "--context", "4096", "-q",
               "-o", str(out)]  # fmt: skip
    environment = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    done = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=300)
    assert done.returncode == 0, done.stderr
    card = json.loads((out / "run.json").read_text())
    threads = card["threads"]
    assert threads == {"torch_threads": threads["torch_threads"], "wait_policy": "PASSIVE",
                       "wait_policy_set_by_probe": "windows of 4096 tokens"}  # fmt: skip
    # the long input went through the row path, and the card says how its blocks were summarised
    assert card["row_statistics"].startswith(("fused C kernel, ", "torch ("))
