"""The download paths, run for real against stand-in servers on 127.0.0.1 that the tests start and
stop: a stand-in Hugging Face hub serving small models, and a plain HTTP server serving CoNLL-U,
with its failure modes. The second run of each comes from the cache, with the server gone."""

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers as tf
from hub import free_port, probe_cli, serving
from models import SMALL
from tokenizers_util import byte_level_bpe, wordpiece
from treebanks import EWT, GUM, needs_ewt, needs_gum

from probe.errors import ProbeError
from probe.inputs.download import fetch
from probe.inputs.treebank import SAMPLE, UD_TREEBANKS, download_url, read_conllu
from probe.pipeline.loading import hub_address

pytestmark = pytest.mark.slow  # runs real models or the whole command line

# The page of the docs that gives the commands to run with network access.
COMMANDS = Path(__file__).resolve().parents[2] / "docs" / "guide" / "command-line.md"


@pytest.fixture(scope="module")
def hub_repos(tmp_path_factory):
    """Tiny random models under the ids the aliases of the docs' commands name."""
    root = tmp_path_factory.mktemp("hub")
    torch.manual_seed(0)
    bert = root / "bert"
    tf.BertModel(
        tf.BertConfig(**SMALL | {"vocab_size": 130}, intermediate_size=64)
    ).save_pretrained(bert)
    wordpiece().save_pretrained(bert)
    gpt2 = root / "gpt2"
    config = tf.GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=300, n_positions=256,
                           bos_token_id=0, eos_token_id=0)  # fmt: skip
    tf.GPT2Model(config).save_pretrained(gpt2)
    byte_level_bpe().save_pretrained(gpt2)
    return {
        "google-bert/bert-base-uncased": bert,
        "openai-community/gpt2": gpt2,
        "acme/tiny-bert": bert,
    }


def docs_network_commands() -> list[list[str]]:
    """The docs' "With network access" commands, as argument lists."""
    text = COMMANDS.read_text(encoding="utf-8")
    block = text[text.index("With network") :].split("\n\n")[1]
    return [line.split("#")[0].split()[1:] for line in block.splitlines() if line.strip()]


@needs_ewt()
@needs_gum()
@pytest.mark.slow
def test_the_docs_network_commands(hub_repos, tmp_path):
    """The docs' commands as written (on 100 sentences), each in a folder of its own, against
    a stand-in hub and a UD mirror; then again in new folders, with both servers gone: from the
    caches."""
    commands = docs_network_commands()
    assert [c[:1] for c in commands] == [["analyze"]] * 3 + [["report"]]
    ewt, gum = UD_TREEBANKS["en_ewt"], UD_TREEBANKS["en_gum"]  # the pinned releases
    mirror = {
        f"/{ewt.repo}/{ewt.release}/en_ewt-ud-dev.conllu": (
            EWT / "en_ewt-ud-dev.conllu"
        ).read_bytes(),
        f"/{gum.repo}/{gum.release}/en_gum-ud-dev.conllu": (
            GUM / "en_gum-ud-dev.conllu"
        ).read_bytes(),
    }
    env = {
        "HF_HUB_OFFLINE": "0",
        "HF_HOME": str(tmp_path / "hf"),
        "PROBE_CACHE": str(tmp_path / "treebanks"),
    }  # not "probe": python -m would import it
    gone = {"HF_ENDPOINT": f"http://127.0.0.1:{free_port()}",
            "PROBE_UD_MIRROR": f"http://127.0.0.1:{free_port()}"}  # fmt: skip
    with serving(routes=mirror, repos=hub_repos) as base:
        run_all(commands, env | {"HF_ENDPOINT": base, "PROBE_UD_MIRROR": base}, tmp_path / "online")
    run_all(commands, env | gone, tmp_path / "offline")  # the servers are gone: from the caches
    card = json.loads(
        (tmp_path / "offline" / "1" / "reports" / "bert-base-en_gum" / "run.json").read_text()
    )
    assert card["coref"]["mentions"] > 0  # GUM's coreference came through the mirror


def run_all(commands: list[list[str]], env: dict, root: Path) -> None:
    """Each analyze command in a folder of its own (they write the same reports/…); the report
    command in the first one's."""
    for i, command in enumerate(commands):
        folder = root / str(i if command[0] == "analyze" else 0)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "my.conllu").write_text(SAMPLE.read_text())
        # As written, but for the suite's time: at most 100 sentences (a later option wins).
        extra = ["-q", "--max-sentences", "100"] if command[0] == "analyze" else []
        done, _ = probe_cli(env, *command, *extra, cwd=folder)
        assert done.returncode == 0, (command, done.stderr)


def test_an_unreachable_hub_is_one_line_in_seconds(tmp_path):
    env = {"HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf"),
           "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}  # fmt: skip
    done, seconds = probe_cli(
        env, "analyze", "--model", "acme/tiny-bert", "-o", str(tmp_path / "r")
    )
    assert done.returncode == 1 and "the Hugging Face hub cannot be reached" in done.stderr
    assert "Traceback" not in done.stderr and seconds < 20


def test_a_trickling_hub_is_cut_and_the_next_run_fetches_the_model_whole(hub_repos, tmp_path):
    """A hub that sends the weights a byte a second is cut after one stretch of
    PROBE_HTTP_DEADLINE (here 2 s, at PROBE_HTTP_MIN_RATE 1000 bytes a second), in one line naming
    the model and the time; the hub's cache holds no part of the weights; and the next run, on a
    hub that answers, downloads them whole and writes its report."""
    hf = tmp_path / "hf"
    env = {"HF_HUB_OFFLINE": "0", "HF_HOME": str(hf), "PROBE_HTTP_TIMEOUT": "5",
           "PROBE_HTTP_DEADLINE": "2", "PROBE_HTTP_MIN_RATE": "1000"}  # fmt: skip
    args = ["analyze", "-m", "acme/tiny-bert", "-a", "spectra", "-q", "-o", str(tmp_path / "r")]
    with serving(repos=hub_repos, trickle={"model.safetensors"}) as base:
        done, seconds = probe_cli(env | {"HF_ENDPOINT": base}, *args)
    print(f"\n{seconds:.1f} s for the whole command: {done.stderr.strip()}")
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "cannot download model 'acme/tiny-bert': too slow, cut after" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and seconds < 60, seconds
    files = [p for p in hf.rglob("*") if p.is_file() or p.is_symlink()]
    assert not [p for p in files if p.name == "model.safetensors" or "incomplete" in p.name]
    assert not (tmp_path / "r").exists()
    weights = (hub_repos["acme/tiny-bert"] / "model.safetensors").read_bytes()
    with serving(repos=hub_repos) as base:
        done, _ = probe_cli(env | {"HF_ENDPOINT": base}, *args)
    assert done.returncode == 0, done.stderr
    (cached,) = hf.rglob("model.safetensors")
    assert cached.read_bytes() == weights and (tmp_path / "r" / "index.html").exists()


def test_a_hub_that_falls_silent_mid_file_is_one_line(hub_repos, tmp_path):
    """The weights' first ten bytes, then silence: after the hub client's retries, one line that
    says the hub stopped answering (not "unknown model", as transformers has it), and no part
    of the file in the cache."""
    hf = tmp_path / "hf"
    env = {"HF_HUB_OFFLINE": "0", "HF_HOME": str(hf), "PROBE_HTTP_TIMEOUT": "1"}
    args = ["analyze", "-m", "acme/tiny-bert", "-a", "spectra", "-q", "-o", str(tmp_path / "r")]
    with serving(repos=hub_repos, silent={"model.safetensors"}) as base:
        done, seconds = probe_cli(env | {"HF_ENDPOINT": base}, *args)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "model 'acme/tiny-bert': the hub stopped answering" in done.stderr, done.stderr
    assert seconds < 120, seconds
    files = [p for p in hf.rglob("*") if p.is_file() or p.is_symlink()]
    assert not [p for p in files if p.name == "model.safetensors" or "incomplete" in p.name]


def test_hub_address_follows_the_endpoint_and_proxies(monkeypatch):
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://mirror.example:8080/hf")
    assert hub_address() == ("mirror.example", 8080)
    monkeypatch.setenv("HF_ENDPOINT", "https://huggingface.co")
    assert hub_address() == ("huggingface.co", 443)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.cluster:3128")
    assert hub_address() == ("proxy.cluster", 3128)
    monkeypatch.setenv("NO_PROXY", "huggingface.co")
    assert hub_address() == ("huggingface.co", 443)


def test_a_treebank_url_is_cached_and_pinned(tmp_path, monkeypatch):
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path / "cache"))
    data = SAMPLE.read_bytes()
    pin = hashlib.sha256(data).hexdigest()
    with serving(routes={"/t/sample.conllu": data}) as base:
        (path,) = download_url(f"{base}/t/sample.conllu#sha256={pin}")
    assert path.read_bytes() == data and read_conllu(path)
    (again,) = download_url(f"{base}/t/sample.conllu#sha256={pin}")  # the server is gone
    assert again == path


@pytest.mark.parametrize(
    ("route", "pin", "message"),
    [
        (None, None, "the server answered 404"),
        ("html", None, "the server sent a web page"),
        ("cut", None, "IncompleteRead"),
        (
            b"1\tHi\thi\tINTJ\t_\t_\t0\troot\t_\t_\n\n",
            "0" * 64,
            "does not match its pinned SHA-256",
        ),
        ("never", None, "timed out"),
    ],
)
def test_download_failures_are_one_line_and_cache_nothing(
    tmp_path, monkeypatch, route, pin, message
):
    monkeypatch.setenv("PROBE_HTTP_TIMEOUT", "1")
    target = tmp_path / "cache" / "t.conllu"
    routes = {} if route is None else {"/t.conllu": route}
    start = time.monotonic()
    with serving(routes=routes) as base, pytest.raises(ProbeError, match=message):
        fetch(f"{base}/t.conllu", target, sha256=pin, validate=read_conllu)
    assert time.monotonic() - start < 5
    assert not list((tmp_path / "cache").iterdir())  # nothing cached, no part file


BOUND_SCRIPT = """
import os, sys
import huggingface_hub.constants as constants
from probe.inputs.hub import bound_waits
bound_waits()
xet = os.environ["HF_HUB_DISABLE_XET"]
print(constants.HF_HUB_DISABLE_XET, constants.HF_HUB_DOWNLOAD_TIMEOUT, xet)
"""


@pytest.mark.parametrize(("given", "expected"), [(None, "True 7 1"), ("0", "False 7 0")])
def test_every_hub_file_comes_through_the_paced_client_unless_the_user_says(given, expected):
    """hf_xet's transfers bypass the hub client that the pace watches: probe turns them off,
    even when the client was imported first, and leaves the user's own setting alone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_HUB_")}
    env |= {"PROBE_HTTP_TIMEOUT": "7"} | ({"HF_HUB_DISABLE_XET": given} if given else {})
    done = subprocess.run([sys.executable, "-c", BOUND_SCRIPT], capture_output=True, text=True,
                          env=env, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == expected.split()
