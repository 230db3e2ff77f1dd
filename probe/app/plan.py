"""A run of ``probe analyze``, planned: its settings (``Settings``, the command's options one to
one), the analyses' and units' declared options, and every check that can be made before torch
is imported (``plan``, which returns the checked ``Plan``). The command line and the Python API
run the same checks, with the same one-line errors.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import analyses
from analyses.vocabulary import Thresholds
from probe.app import tables as table_io
from probe.app.output import check_free, default_out, refuse_inputs
from probe.capture.names import nearest
from probe.errors import ProbeError
from probe.inputs import units
from probe.options import ATTENTION_BUDGET, Option, parse_size, resolve


@dataclass
class Settings:
    """Everything ``probe analyze`` needs; the CLI's options, one to one. ``options`` holds the
    analyses' and units' own options by name (``{"importance_sentences": 100}``)."""

    model: str
    treebank: Sequence[str] | None = None
    out: Path | None = None
    max_sentences: int | None = None
    batch_size: int = 32
    device: str = "cpu"
    dtype: str | None = None
    device_map: str | None = None  # accelerate places the model: auto, balanced, sequential
    # With device_map: {0: "70GiB", "cpu": …}, or as --max-memory gives it, "0=70GiB,cpu=200GiB"
    max_memory: dict[int | str, str] | str | None = None
    offload_folder: Path | None = None
    analyses: Sequence[str] | None = None  # None: each analysis that runs by default
    seed: int = 0
    lm_head: bool = False  # load the model with its language-model head (for importance)
    overwrite: bool = False
    revision: str | None = None
    trust_remote_code: bool = False
    thresholds: dict = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    attention_budget: str = (
        ATTENTION_BUDGET  # a block of attention rows' bytes (probe.capture.rows)
    )
    # Plain text for the analyses that need no annotation (``probe.inputs.texts``): a file, folder
    # or hf:NAME[:CONFIG][@SPLIT]; its text column, its first texts, the tokens per window.
    corpus: str | None = None
    text_column: str = "text"
    max_texts: int | None = None
    context: int | None = None

    @property
    def output(self) -> Path:
        if self.out:
            return Path(self.out)
        chosen = None if self.analyses is None else list(dict.fromkeys(self.analyses))
        if chosen == analyses.defaults():
            chosen = None  # the default analyses, named: the default folder
        return default_out(self.model, self.treebank, self.corpus, chosen)


@dataclass(frozen=True)
class Plan:
    """A run, resolved and checked before any compute."""

    settings: Settings
    classes: tuple[type[analyses.Analysis], ...]  # in the order the user gave
    by_default: bool  # the user named no analyses: those that cannot run are left out
    thresholds: Thresholds
    options: dict[str, Any]  # every option of the chosen analyses and their units
    units: tuple[str, ...]  # the units they read, in the order first needed
    reads: dict[str, tuple[str, ...]]  # analysis -> the units it reads in this run
    source: units.Source
    output: Path

    def options_of(self, declared: Sequence[Option]) -> dict[str, Any]:
        return {o.name: self.options[o.name] for o in declared}


def declared_options(names: Iterable[str] | None = None) -> dict[str, tuple[Option, str]]:
    """The options of these analyses (None: all registered) and of the units they read, by
    name, each with the name of what declares it.

    Raises
    ------
    analyses.ContractError
        When two declare an option of the same name differently.
    """
    classes = [analyses.get(n) for n in (analyses.REGISTRY if names is None else names)]
    read = dict.fromkeys(u for units_ in _unit_reads(classes).values() for u in units_)
    owners = [*classes, *(units.get(u) for u in read)]
    found: dict[str, tuple[Option, str]] = {}
    for owner in owners:
        for option in owner.options:
            if option.name in found and found[option.name][0] != option:
                raise analyses.ContractError(
                    f"option {option.flag} is declared by both {found[option.name][1]!r} and "
                    f"{owner.name!r}; rename one"
                )
            found.setdefault(option.name, (option, owner.name))
    return found


def _unit_reads(classes, given: set[str] | None = None) -> dict[str, tuple[str, ...]]:
    """Each analysis's units in a run of ``classes`` on the inputs ``given``
    (``Analysis.units``), less those it reads only ``alongside`` another analysis where none of
    the others reads them."""
    reads = {cls.name: cls.units(given) for cls in classes}
    for cls in classes:
        others = {u for other in classes if other is not cls for u in reads[other.name]}
        reads[cls.name] = tuple(u for u in reads[cls.name]
                                if u not in cls.alongside or u in others)  # fmt: skip
    return reads


def _options(names: Sequence[str], given: dict[str, Any]) -> dict[str, Any]:
    """The values of the chosen analyses' and their units' options.

    Raises
    ------
    ProbeError
        For a value out of range, or an option of an analysis the run does not include.
    """
    declared = declared_options(names)
    core = {f.name for f in fields(Settings)} | {"quiet", "threshold", "treebank"}
    for name, (option, owner) in declared.items():
        if name in core:
            raise analyses.ContractError(
                f"{owner!r} declares option {option.flag}, which probe analyze has already; "
                "rename it"
            )
    stray = [name for name, value in given.items() if name not in declared and value is not None]
    if stray:
        everything = declared_options()
        name = stray[0]
        if name not in everything:
            raise ProbeError(f"unknown option {name}")
        option, owner = everything[name]
        if owner not in analyses.REGISTRY:  # a unit's option: name the analyses that read it
            readers = [a for a in analyses.REGISTRY if owner in analyses.get(a).units()
                       and owner not in analyses.get(a).alongside]  # fmt: skip
            raise ProbeError(
                f"{option.flag} says how to read the {units.get(owner).label}, which no analysis "
                f"of this run reads; add {' or '.join(readers)} to --analyses or leave the "
                "option out"
            )
        raise ProbeError(f"{option.flag} is an option of {owner}, which this run does not "
                         f"include; add {owner} to --analyses or leave the option out")  # fmt: skip
    return resolve([option for option, _ in declared.values()], given)


def plan(settings: Settings) -> Plan:
    """Resolve and check a run without loading anything heavy. The command line runs it before
    importing torch: a mistake is answered at once, and the helper process
    (``probe.pipeline.helper``) learns what the run will hand it.

    Raises
    ------
    ProbeError
        For an unknown analysis, option, threshold, dtype or placement, a value out of range,
        a treebank that does not exist, or an output folder that is taken.
    analyses.ContractError
        For an analysis that breaks its contract (a programming error), naming it.
    """
    settings = _check_loading(settings)
    _check_values(settings)
    chosen = settings.analyses
    names = list(analyses.defaults() if chosen is None else chosen)
    unknown = [a for a in names if a not in analyses.REGISTRY]
    if unknown or not names:
        known = ", ".join(analyses.REGISTRY)
        close = [m for a in unknown for m in nearest(a, analyses.REGISTRY)]  # misspellings'
        meant = f"; did you mean {' or '.join(map(repr, dict.fromkeys(close)))}?" if close else ""
        raise ProbeError(f"unknown analysis {', '.join(unknown) or '(none)'}{meant}; "
                         f"choose from {known}")  # fmt: skip
    names = list(dict.fromkeys(names))
    names += analyses.followers(names)
    classes = tuple(analyses.get(n) for n in names)
    for name, cls in zip(names, classes, strict=True):
        # The full check (heads() on empty tables) imports pandas, which the run otherwise
        # first needs while its helper fits: it is made here for an analysis probe does not
        # ship, which should fail before the compute; probe's own pass it in its tests.
        analyses.check_analysis(cls, name, full=not analyses.shipped(cls))
    table_io.schemas(classes)  # two analyses writing one table fail here, naming both
    wrong = sorted(set(settings.thresholds) - set(Thresholds.names()))
    if wrong:
        known = ", ".join(Thresholds.names())
        raise ProbeError(f"unknown threshold {', '.join(wrong)}; known: {known}")
    try:
        thresholds = Thresholds(**settings.thresholds)
    except ValueError as e:
        raise ProbeError(f"--threshold: {e}") from None
    options = _options(names, settings.options)
    if chosen is not None:  # analyses chosen by default that cannot run are left out after load
        _check_lm_head(settings, classes)
    given = {"treebank", "corpus"} if settings.corpus else {"treebank"}
    reads = _unit_reads(classes, given)
    needed = tuple(dict.fromkeys(u for read in reads.values() for u in read))
    source = _source(settings, {units.get_input(u) for u in needed}, reads)
    parse_size(settings.attention_budget)
    check_free(settings.output, settings.overwrite)
    corpus = [Path(f) for f in source.corpus.files] if source.corpus else []
    refuse_inputs(settings.output, [*source.treebank, *corpus, *_local(settings.model)])
    return Plan(settings, classes, settings.analyses is None, thresholds, options, needed,
                reads, source, settings.output)  # fmt: skip


def _check_lm_head(settings: Settings, classes: Iterable[type[analyses.Analysis]]) -> None:
    """An analysis named that reads the model's predictions (``lm_head``) needs ``--lm-head``
    and a checkpoint whose config names a class with a head: refused now, before the model
    loads. A config that cannot tell, or is not on this machine yet, is checked after loading
    (``Analysis.unsupported``).

    Raises
    ------
    ProbeError
        Naming the analysis, and the checkpoint's classes where they hold no head.
    """
    from probe.pipeline.checkpoint import has_lm_head, read_config

    needing = [cls.name for cls in classes if cls.lm_head]
    if not needing:
        return
    name = needing[0]
    config = read_config(settings.model, settings.revision)
    # A checkpoint without a head first: --lm-head would not help it.
    if config is not None and has_lm_head(config) is False:
        saved = ", ".join(config["architectures"])
        raise ProbeError(
            f"--analyses {name} reads the model's predictions, and {settings.model} has no "
            f"language-model head (its config.json names {saved}); give a checkpoint saved "
            "with its head (a *LMHeadModel, *ForCausalLM or *ForMaskedLM class)"
        )
    if not settings.lm_head:
        raise ProbeError(f"--analyses {name} reads the model's predictions; add --lm-head")


def _source(settings: Settings, inputs: set[str | None], reads: dict) -> units.Source:
    """The inputs the run's units read, resolved and checked (a corpus's first text is read)."""
    from probe.inputs.texts import corpus_spec

    corpus_options = {"--text-column": settings.text_column != "text",
                      "--max-texts": settings.max_texts, "--context": settings.context}  # fmt: skip
    if not settings.corpus and any(corpus_options.values()):
        flag = next(flag for flag, given in corpus_options.items() if given)
        raise ProbeError(f"{flag} says how to read --corpus; give --corpus too")
    if settings.corpus and "corpus" not in inputs:
        readers = [n for n in analyses.REGISTRY if "text" in analyses.get(n).units()]
        raise ProbeError(
            f"no analysis of this run reads --corpus ({', '.join(reads)} read annotation or "
            f"the weights); add one of {', '.join(readers)}"
        )
    treebank = ()
    if "treebank" in inputs:
        from probe.inputs.treebank import treebank_paths

        treebank = tuple(treebank_paths(settings.treebank))
    corpus = corpus_spec(settings.corpus, settings.text_column) if settings.corpus else None
    return units.Source(treebank, settings.max_sentences, settings.seed, corpus,
                        settings.max_texts, settings.context)  # fmt: skip


DTYPES = ("float32", "float16", "bfloat16")
DEVICE_MAPS = ("auto", "balanced", "sequential")  # accelerate's placements
MEMORY = re.compile(r"^(\d+(\.\d+)?)\s*([KMGT]i?B|B)?$", re.IGNORECASE)
MEMORY_DEVICES = ("cpu", "mps", "xpu", "npu", "disk")  # and GPU indices


def parse_memory(text: str) -> dict[int | str, str]:
    """``0=70GiB,cpu=200GiB`` (``--max-memory``) -> ``{0: "70GiB", "cpu": "200GiB"}`` (for
    accelerate).

    Raises
    ------
    ProbeError
        For a device other than a GPU index, cpu or disk, or a size that is not one.
    """
    limits: dict[int | str, str] = {}
    for item in text.split(","):
        where, _, size = (part.strip() for part in item.partition("="))
        key: int | str = int(where) if where.isascii() and where.isdigit() else where.lower()
        _check_memory(item, key, size)
        limits[key] = size.replace(" ", "")
    return limits


def _check_memory(item: str, key: int | str, size: str) -> None:
    """One entry of ``--max-memory`` (``item``, as given): a device accelerate knows, a size."""
    if key not in MEMORY_DEVICES and not isinstance(key, int):
        raise ProbeError(f"--max-memory {item!r}: the device is a GPU index, cpu or disk")
    count = isinstance(size, int) and size >= 0  # accelerate takes a count of bytes too
    if not count and not (isinstance(size, str) and MEMORY.match(size)):
        raise ProbeError(f"--max-memory {item!r}: give a size such as 70GiB or 512MB")


def _check_loading(settings: Settings) -> Settings:
    """How the model is to be loaded and placed: its dtype, accelerate's placement, and the
    memory per device, which load would reject only after torch is imported (or not at all).
    Returns ``settings`` with the memory per device as a dict (``parse_memory``)."""
    if settings.dtype not in (None, *DTYPES):
        raise ProbeError(f"unknown --dtype {settings.dtype!r}; use float32, float16 or bfloat16")
    if settings.device_map not in (None, *DEVICE_MAPS):
        raise ProbeError(
            f"unknown --device-map {settings.device_map!r}; use auto, balanced or sequential"
        )
    if (settings.max_memory or settings.offload_folder) and not settings.device_map:
        raise ProbeError(
            "--max-memory and --offload-folder place a model with --device-map; add it"
        )
    memory = settings.max_memory
    if isinstance(memory, str):
        return replace(settings, max_memory=parse_memory(memory) if memory else None)
    for key, size in (memory or {}).items():
        _check_memory(f"{key}={size}", key, size)
    return settings


DEVICE = re.compile(r"auto|cpu|(cuda|mps|xpu)(:\d+)?")
SEEDS = 2**32  # numpy's and scikit-learn's seeds are below this
LARGEST = 2**63 - 1


def _check_values(settings: Settings) -> None:
    """The options torch would reject only once imported (seconds later), and the settings
    the environment gives, checked now."""
    from probe.inputs.download import deadline, min_rate, timeout

    timeout(), deadline(), min_rate()
    if not DEVICE.fullmatch(settings.device):
        known = "cpu, cuda, cuda:N, mps or auto"
        raise ProbeError(f"unknown --device {settings.device!r}; use {known}")
    _check_build(settings.device)
    if not 0 <= settings.seed < SEEDS:
        raise ProbeError(f"--seed {settings.seed} is out of range; give 0 to {SEEDS - 1}")
    counts = {"max_sentences": settings.max_sentences, "batch_size": settings.batch_size}
    for name, value in (counts | settings.options).items():  # torch and islice take int64
        if isinstance(value, int) and not -LARGEST <= value <= LARGEST:
            flag = "--" + name.replace("_", "-")
            raise ProbeError(f"{flag} {value} is out of range (at most {LARGEST})")


def _check_build(device: str) -> None:
    """A GPU this machine's torch cannot use, refused before torch is imported (which takes
    seconds): ``cuda`` on a build without CUDA or ROCm (``torch/version.py`` says so), ``mps``
    off macOS. A machine whose CUDA build sees no GPU is told once torch is loaded
    (``probe.pipeline.loading.resolve_device``)."""
    kind = device.partition(":")[0]
    if kind == "mps" and sys.platform != "darwin":
        raise ProbeError(f"--device {device} is Apple's GPU, which this machine has not; "
                         "use --device cpu or cuda")  # fmt: skip
    build = torch_build() if kind == "cuda" else None
    if build is not None and not build[1]:
        raise ProbeError(
            f"--device {device}: the installed torch ({build[0]}) is built without CUDA; use "
            "--device cpu, or install a CUDA build of torch (pytorch.org/get-started)"
        )


def torch_build() -> tuple[str, bool] | None:
    """The installed torch's version and whether it is built for a GPU (CUDA, or ROCm, which
    torch also calls ``cuda``), read from its ``torch/version.py`` as text, without importing
    torch; None where it cannot be told (no torch, or a ``version.py`` of another form)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("torch")  # finds, never imports
    if spec is None or spec.origin is None:
        return None
    try:
        tree = ast.parse(Path(spec.origin).with_name("version.py").read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    values = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and isinstance(node.value, ast.Constant):
            values[target.id] = node.value.value
    if not {"__version__", "cuda", "hip"} <= values.keys():
        return None
    return str(values["__version__"]), values["cuda"] is not None or values["hip"] is not None


def _local(model: str) -> list[Path]:
    """The model's folder, when it is one (an output must not replace it)."""
    return [Path(model)] if Path(model).is_dir() else []
