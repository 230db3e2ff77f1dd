"""What a checkpoint says of itself before it loads (``probe.pipeline.checkpoint``): whether its
config.json names a class with a language-model head, read from a folder, an alias or the hub's
local cache, without torch."""

import json
import os
import subprocess
import sys

import pytest
from induction import MODEL

from probe.pipeline.checkpoint import has_lm_head, read_config


@pytest.mark.parametrize(
    ("names", "head"),
    [
        (["GPT2LMHeadModel"], True),
        (["LlamaForCausalLM"], True),
        (["Qwen2ForCausalLM"], True),
        (["BertForMaskedLM"], True),
        (["T5ForConditionalGeneration"], True),
        (["GPT2DoubleHeadsModel"], True),
        (["GPT2Model"], False),
        (["BertModel"], False),
        (["T5EncoderModel"], False),
        (["BertForSequenceClassification"], False),
        (["RobertaForTokenClassification", "RobertaModel"], False),
        (["ElectraForPreTraining"], None),  # a discriminator's head: loading finds out
        (["BertForPreTraining"], None),
        ([], None),
        (None, None),
    ],
)
def test_which_classes_hold_a_head(names, head):
    config = {} if names is None else {"architectures": names}
    assert has_lm_head(config) is head


def test_configs_are_read_from_folders_and_aliases(tmp_path):
    assert has_lm_head(read_config(str(MODEL))) is True  # GPT2LMHeadModel
    assert has_lm_head(read_config("minilm")) is False  # the demo package's BertModel
    assert read_config(str(tmp_path)) is None  # a folder without config.json
    (tmp_path / "config.json").write_text("{not json")
    assert read_config(str(tmp_path)) is None  # loading says what is wrong with it
    assert read_config(str(tmp_path / "nowhere")) is None


CACHED = """
import sys
from probe.pipeline.checkpoint import has_lm_head, read_config
assert has_lm_head(read_config("someone/base-only")) is False
assert read_config("someone/elsewhere") is None  # not in the cache: nothing is downloaded
assert "torch" not in sys.modules and "transformers" not in sys.modules
"""


def test_a_hub_model_is_read_from_the_local_cache_without_torch(tmp_path):
    snapshot = tmp_path / "models--someone--base-only" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"architectures": ["GPT2Model"]}))
    (tmp_path / "models--someone--base-only" / "refs").mkdir()
    (tmp_path / "models--someone--base-only" / "refs" / "main").write_text("abc123")
    env = os.environ | {"HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", CACHED], capture_output=True, text=True,
                          env=env, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
