"""Tensors read straight from a model's checkpoint files, without building the modules that own
them: a model loaded without its language-model head still has that head's weight on disk, and
the copying score needs it (an untied W_U is no transpose of W_E).

Reads one tensor of a ``.safetensors`` file (or a memory-mapped ``.bin``), from a local folder or
the hub's cache; never downloads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from probe.capture.spec import describe

SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"


def unembedding(model: nn.Module) -> tuple[torch.Tensor | None, bool]:
    """The output embedding that the model's checkpoint holds, for a model loaded without it.

    The language-model class of the model's architecture (``AutoModelForCausalLM``,
    ``AutoModelForSeq2SeqLM`` or ``AutoModelForMaskedLM``), built on the meta device, names the
    head's weight and says whether it is tied to the input embedding.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A base model (``AutoModel``), loaded from a local folder or the hub's cache.

    Returns
    -------
    (weight, tied)
        ``weight`` ``[vocab, d]``: the head's own weight, read from the checkpoint (None where it
        is tied, or where the checkpoint holds no head). ``tied``: the checkpoint's head is the
        input embedding (a tied language-model head, or a masked-LM head whose other weights the
        checkpoint holds). ``(None, False)``: the checkpoint holds no unembedding.
    """
    head = _head(model)
    if head is None:
        return None, False
    name, holder, tied = head
    files = _files(_source(model))
    if tied:
        # A causal head is the tied linear alone; a masked-LM head also has its transform, which
        # a checkpoint without the head (a sentence encoder's) lacks.
        return None, not holder or any(key.startswith(holder + ".") for key in files)
    key = f"{name}.weight"
    if key not in files:
        return None, False
    return _read(files[key], key), False


def _head(model: nn.Module) -> tuple[str, str, bool] | None:
    """The qualified names of the language-model class's output embedding and of the module that
    holds it (empty: the model itself), and whether it is tied to the input embedding; None where
    the architecture has no such class."""
    import transformers as tf

    spec, config = describe(model), model.config
    if spec.encoder_decoder:
        auto = tf.AutoModelForSeq2SeqLM
    elif spec.causal:
        auto = tf.AutoModelForCausalLM
    else:
        auto = tf.AutoModelForMaskedLM
    try:
        with torch.device("meta"):
            lm = auto.from_config(config)
    except ValueError:  # no such class for this architecture
        return None
    output, embedding = lm.get_output_embeddings(), lm.get_input_embeddings()
    if output is None:
        return None
    name = next(n for n, m in lm.named_modules() if m is output)
    holder = next(n for n, m in lm.named_modules() if any(c is output for c in m.children()))
    return name, holder, output.weight is embedding.weight


def _source(model: nn.Module) -> str:
    return str(getattr(model, "name_or_path", "") or model.config._name_or_path)


def _files(source: str) -> dict[str, Path]:
    """Every tensor name of the checkpoint at ``source`` (a folder or a hub id in the cache),
    with the file that holds it; empty where none is found."""
    for single, index in ((SAFETENSORS, SAFETENSORS_INDEX), (BIN, BIN_INDEX)):
        found = _locate(source, index)
        if found is not None:
            weights = json.loads(found.read_text())["weight_map"]
            return {key: found.parent / file for key, file in weights.items()}
        found = _locate(source, single)
        if found is not None:
            return dict.fromkeys(_keys(found), found)
    return {}


def _locate(source: str, filename: str) -> Path | None:
    """``filename`` in the folder ``source``, or in the hub's cache of the model ``source``."""
    folder = Path(source)
    if folder.is_dir():
        return folder / filename if (folder / filename).is_file() else None
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(source, filename)
    except ValueError:  # not a hub id
        return None
    return Path(cached) if isinstance(cached, str) else None


def _keys(path: Path) -> list[str]:
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            return list(f.keys())
    return list(torch.load(path, map_location="meta", weights_only=True, mmap=True))


def _read(path: Path, key: str) -> torch.Tensor:
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            return f.get_tensor(key)
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)[key]
