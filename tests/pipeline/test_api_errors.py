"""A mistake in the Python API is one line that names it: ``probe.load`` raises one
``ProbeError`` with no chain of the libraries' exceptions behind it, and a misspelt hook name
is answered with the names nearest to it, not a list of every name."""

import json
import re
import subprocess
import sys

import pytest
import torch
from models import small_model

import probe
from probe.capture.names import hook_name, nearest, unknown


def load_error(name: str) -> probe.ProbeError:
    with pytest.raises(probe.ProbeError) as caught:
        probe.load(name)
    return caught.value


@pytest.fixture
def folders(tmp_path):
    """A folder that is no model, a file, and folders with a config but nothing else."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"\0" * 8)
    (tmp_path / "config-only").mkdir()
    (tmp_path / "config-only" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (tmp_path / "no-type").mkdir()  # transformers' reason is several lines: kept, on one
    (tmp_path / "no-type" / "config.json").write_text("{}")
    return tmp_path


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("./nosuch", r"^no such model folder: \./nosuch \(looked for in .+\); give a model folder"),
        ("/no/such/folder", r"^no such model folder: /no/such/folder; give"),
        ("models/a/b", r"^no such model folder: models/a/b "),  # two slashes: no hub id
        ("{tmp}/empty", r"empty is not a model folder: it has no config\.json"),
        ("{tmp}/weights.bin", r"weights\.bin is a file, not a model folder"),
        (
            "{tmp}/config-only",
            r"config-only is not a loadable model folder \(.*\bno file named "
            r"model\.safetensors",
        ),
        ("{tmp}/no-type", r"no-type is not a loadable model folder \(.+ \(1\) .+ \(2\) .+\)$"),
        # Offline (conftest sets HF_HUB_OFFLINE): a hub id not in the local cache.
        ("no-such-model-xyz", r"^cannot load 'no-such-model-xyz': it is not a local folder, and"),
        ("someone/no-such-model", r"^cannot load 'someone/no-such-model': .*offline"),
        ("gpt2", r"^cannot load 'gpt2' \(openai-community/gpt2\): .*offline"),
    ],
)
def test_load_raises_one_error_without_the_libraries_chain(folders, name, message):
    error = load_error(name.format(tmp=folders))
    shown = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    assert shown is None, f"the traceback shows {shown!r} too"
    text = str(error)
    assert "\n" not in text and re.search(message, text), text


def test_an_unknown_dtype_is_named():
    with pytest.raises(probe.ProbeError, match=r"^unknown dtype 'floot16'; use float32, float16"):
        probe.load("minilm", dtype="floot16")
    with pytest.raises(probe.ProbeError, match=r"^unknown dtype 'nn'"):  # torch.nn: no dtype
        probe.load("minilm", dtype="nn")


@pytest.mark.slow
def test_a_missing_folder_is_one_exception_in_the_traceback(tmp_path):
    """What the user sees of ``probe.load("./nosuch")``: probe's exception alone, not three
    chained exceptions of Hugging Face's first (79 lines before probe's own)."""
    done = subprocess.run([sys.executable, "-c", "import probe; probe.load('./nosuch')"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and lines[-1].startswith("probe.errors.ProbeError: no such model")
    assert done.stderr.count("Traceback") == 1 and "direct cause" not in done.stderr
    assert "During handling" not in done.stderr and len(lines) < 12, done.stderr


@pytest.fixture(scope="module")
def gpt2():
    return small_model("gpt2")  # 2 layers


@pytest.fixture(scope="module")
def batch():
    return {"input_ids": torch.tensor([[1, 2, 3, 4]])}


@pytest.mark.parametrize(
    ("wrong", "meant"),
    [
        ("hook_patern", "'hook_pattern'"),
        ("blocks.0.attn.hook_patern", "'blocks.0.attn.hook_pattern'"),
        ("blcks.1.attn.hook_z", "'blocks.1.attn.hook_z'"),
        ("blocks.0.hook_resid_pr", "'blocks.0.hook_resid_pre'"),
        ("hook_scal", "'ln1.hook_scale' or 'ln2.hook_scale'"),  # as near as each other
    ],
)
def test_a_misspelt_name_is_answered_with_the_nearest(gpt2, batch, wrong, meant):
    expected = f"unknown hook point '{wrong}'; did you mean {meant}?"
    with pytest.raises(KeyError) as caught, probe.trace(gpt2, [wrong]):
        gpt2(**batch)
    assert caught.value.args == (expected,)
    with pytest.raises(KeyError) as caught, probe.hooks(gpt2, {wrong: lambda x, hook: x}):
        gpt2(**batch)
    assert caught.value.args == (expected,)


def test_a_layer_or_point_the_model_lacks_is_named(gpt2):
    with pytest.raises(KeyError, match=r"'blocks\.7\.attn\.hook_z': the model's blocks are "
                       r"layers 0 to 1"), probe.trace(gpt2, ["blocks.7.attn.hook_z"]):  # fmt: skip
        pass
    lacks = r"'hook_rot_q': this model has no hook_rot_q \(rotary models: the queries after"
    with pytest.raises(KeyError, match=lacks), probe.trace(gpt2, "hook_rot_q"):
        pass


def test_cache_lookups_name_the_nearest_or_what_was_captured(gpt2, batch):
    with probe.trace(gpt2, ["hook_pattern"]) as cache:
        gpt2(**batch)
    messages = {}
    for key in ("blocks.0.attn.hook_patern", "blocks.0.attn.hook_z", "blocks.5.attn.hook_pattern",
                ("patern", 0), "hook_patern"):  # fmt: skip
        with pytest.raises((KeyError, ValueError)) as caught:
            cache[key]
        messages[key] = caught.value.args[0]
    assert messages == {
        "blocks.0.attn.hook_patern": "unknown hook point 'blocks.0.attn.hook_patern'; "
        "did you mean 'blocks.0.attn.hook_pattern'?",
        "blocks.0.attn.hook_z": "blocks.0.attn.hook_z was not captured: it holds hook_pattern; "
        "name its point in probe.trace(model, names), or leave names out for every point",
        "blocks.5.attn.hook_pattern": "blocks.5.attn.hook_pattern was not captured: it holds "
        "hook_pattern, at blocks.0.attn.hook_pattern, blocks.1.attn.hook_pattern",
        ("patern", 0): "unknown hook point 'hook_patern'; did you mean 'hook_pattern'?",
        "hook_patern": "unknown hook point 'hook_patern'; did you mean 'hook_pattern'?",
    }
    assert cache["pattern", 1] is cache["blocks.1.attn.hook_pattern"]  # the right names still
    assert "blocks.0.attn.hook_z" not in cache and cache.get("nothing") is None


def test_nearest_keeps_only_the_nearest():
    names = [f"blocks.{i}.attn.hook_{p}" for i in range(12) for p in ("pattern", "z", "q")]
    assert nearest("blocks.3.attn.hook_patern", names) == ["blocks.3.attn.hook_pattern"]
    assert nearest("hook_xyzzy_quux", ["hook_pattern", "hook_z"]) == []
    assert unknown("completely.different", names).endswith(
        "a point is named in full ('blocks.0.attn.hook_z') or by its last part ('hook_z'), "
        "as the hook reference lists them"
    )
    with pytest.raises(ValueError, match=r"^unknown hook point 'hook_attn_scors'; did you mean "
                       r"'hook_attn_scores'\?$"):  # fmt: skip
        hook_name("attn_scors", 0)
