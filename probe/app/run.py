"""``probe analyze``: one model, its inputs, the chosen analyses, one output folder.

The run has three stages:

- ``plan`` resolves the analyses (checking their contract), their options, the tables' schemas,
  the input and the output folder: everything that can be checked is checked here, before torch is
  imported;
- ``execute`` loads the model and streams every input unit a chosen analysis reads
  (``probe.inputs.units``) through it, handing each layer's captures to the analyses that read that
  unit, then merges the processes' states exactly (``probe.distributed``);
- ``publish`` finishes the analyses into tables and writes them, the report and ``run.json``
  into a staging folder that takes the output's place at once (``probe.app.output``).
"""

from __future__ import annotations

import gc
import json
import platform
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import suppress
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from functools import partial
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import analyses
from analyses.vocabulary import Role, Thresholds
from probe.app import tables as table_io
from probe.app.folder import SCHEMA
from probe.app.output import check_free, default_out, refuse_inputs, reserved, write_file
from probe.errors import ProbeError
from probe.inputs import units
from probe.options import ATTENTION_BUDGET, Option, parse_size, resolve
from probe.run import helper

PACKAGES = ("probe", "torch", "transformers", "tokenizers", "numpy", "pandas")
Progress = Callable[[str, int | None], Callable[[Iterable], Iterator]]


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
    max_memory: dict[int | str, str] | None = None  # with device_map: {0: "70GiB", "cpu": …}
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
    """Resolve and check a run without loading anything heavy.

    Raises
    ------
    ProbeError
        For an unknown analysis, option or threshold, a value out of range, a treebank that
        does not exist, or an output folder that is taken.
    analyses.ContractError
        For an analysis that breaks its contract (a programming error), naming it.
    """
    _check_values(settings)
    chosen = settings.analyses
    names = list(analyses.defaults() if chosen is None else chosen)
    unknown = [a for a in names if a not in analyses.REGISTRY]
    if unknown or not names:
        known = ", ".join(analyses.REGISTRY)
        raise ProbeError(f"unknown analysis {', '.join(unknown) or '(none)'}; choose from {known}")
    names = list(dict.fromkeys(names))
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
    from probe.run.checkpoint import has_lm_head, read_config

    needing = [cls.name for cls in classes if cls.lm_head]
    if not needing:
        return
    name = needing[0]
    if not settings.lm_head:
        raise ProbeError(f"--analyses {name} reads the model's predictions; add --lm-head")
    config = read_config(settings.model, settings.revision)
    if config is not None and has_lm_head(config) is False:
        saved = ", ".join(config["architectures"])
        raise ProbeError(
            f"--analyses {name} reads the model's predictions, and {settings.model} has no "
            f"language-model head (its config.json names {saved}); give a checkpoint saved "
            "with its head (a *LMHeadModel, *ForCausalLM or *ForMaskedLM class)"
        )


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
    (``probe.run.loading.resolve_device``)."""
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


def check(settings: Settings) -> Plan:
    """``plan``, which the command line runs before importing torch: a mistake is answered at
    once, and the helper process (``probe.run.helper``) learns what the run will hand it."""
    return plan(settings)


@dataclass
class RunCard:
    """What a report says about its run: ``run.json``, and the top of the page."""

    model: str
    model_source: str
    model_type: str
    revision: str | None
    tokenizer: str
    layers: int
    heads: int
    d_model: int
    causal: bool
    device: str
    device_map: dict[str, str] | None
    processes: int
    dtype: str
    treebank: list[str]
    inputs: dict[str, dict]  # each unit's tally: what was read, analysed and skipped
    reads: dict[str, list[str]]  # analysis -> the units (and so the inputs) it read
    analyses: list[str]
    options: dict[str, Any]
    seed: int
    batch_size: int
    lm_head: bool
    thresholds: dict[str, float]
    packages: dict[str, str] = field(default_factory=dict)
    command: str = "probe analyze"
    created: str = ""
    timings_s: dict[str, float] = field(default_factory=dict)
    # Seconds each analysis took to finish (within timings_s's "tables"): where an analysis
    # runs the model itself when it finishes (the circuit), its time is spent there
    finish_s: dict[str, float] = field(default_factory=dict)
    # Per input read (treebank, corpus): of its first words, how many the tokenizer turns into
    # its unknown token alone, and the share (probe.inputs.unknown)
    unknown_words: dict[str, dict] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # analysis -> why it did not run
    warnings: list[str] = field(default_factory=list)  # what the page and the command warn of
    schema: int = SCHEMA  # the folder's layout version (probe.app.folder)
    corpus: str | None = None  # the plain-text corpus the text unit read
    context: int | None = None  # its tokens per window, as used (capped at the model's limit)
    spec: dict[str, Any] = field(default_factory=dict)  # probe.capture.spec.ModelSpec
    threads: dict[str, Any] = field(default_factory=dict)  # probe.run.threads.in_effect
    # How the long inputs' row blocks were summarised (probe.capture.fused.used); None: no rows
    row_statistics: str | None = None
    # The claims' ablations (analyses.claims): per kind of input, its count, the positions
    # measured, the measure, the ablation and the heads ablated; None where none ran.
    claims: list[dict[str, Any]] | None = None

    def as_dict(self) -> dict[str, Any]:
        """The card as ``run.json`` holds it, with the sentence and coreference counts also at
        the top level, where reports written before units read them."""
        card = asdict(self)
        sentences = self.inputs.get("sentence", {})
        coref = self.inputs.get("window", {})
        card |= {
            "sentences_read": sentences.get("read", 0),
            "sentences_analysed": sentences.get("analysed", 0),
            "sentences_skipped": dict(sentences.get("skipped", {})),
            "words_analysed": sentences.get("words", 0),
            "coref": {
                "window": self.options.get("coref_window") if coref else None,
                "documents": coref.get("documents", 0),
                "windows": coref.get("windows", 0),
                "mentions": coref.get("mentions", 0),
                "sentences_skipped": coref.get("sentences_skipped", 0),
                "windows_skipped": dict(coref.get("windows_skipped", {})),
            },
        }
        return card


class Clock:
    """Seconds spent in each stage of the run."""

    def __init__(self) -> None:
        self.started = self.last = time.perf_counter()
        self.timings: dict[str, float] = {}

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.timings[stage] = round(now - self.last, 3)
        self.last = now

    def total(self) -> None:
        self.timings["total"] = round(time.perf_counter() - self.started, 3)


@dataclass
class Outcome:
    """What ``execute`` leaves for ``publish``: the merged states and what the run card needs."""

    analyses: list[analyses.Analysis]
    examples: Any  # probe.app.examples.Examples, when head cards have example sentences
    card: RunCard
    n_layers: int
    n_heads: int


def analyze(
    settings: Settings,
    progress: Progress | None = None,
    status: Callable[[str], None] = lambda message: None,
) -> Path | None:
    """Plan, execute and publish a run; returns the report folder's path.

    Under torchrun every process runs this: each streams its share of the input, the states
    are merged into rank 0's (``probe.distributed``), and rank 0 alone writes the report; the
    others return None.

    Parameters
    ----------
    settings : Settings
    progress : callable, optional
        ``progress(description, total)`` returns a wrapper that shows progress over an
        iterable of batches (the CLI passes rich progress bars); None shows nothing.
    status : callable
        Receives one-line messages about the stage that starts.
    """
    run = plan(settings)
    from probe.distributed import Ranks
    from probe.inputs.pipes import forget_copies

    ranks = Ranks.from_environment()
    paused = not gc.isenabled()  # see _freeze
    try:
        if not ranks.leader:
            execute(run, ranks, None, lambda message: None)
            return None
        # Reserved before any compute: a second run to the same place fails now, not at the end.
        with reserved(run.output, settings.overwrite) as folder:
            outcome = execute(run, ranks, progress, status)
            publish(run, outcome, folder, status)
        return run.output
    finally:
        forget_copies(run.source.treebank)  # a pipe's copy is this run's alone
        if paused:  # as the caller left it, and what _freeze froze can be freed again
            gc.unfreeze()
            gc.disable()


def execute(run: Plan, ranks, progress: Progress | None, status: Callable[[str], None]):
    """Load the model, stream every unit through it, and merge the processes' states.

    Returns
    -------
    Outcome or None
        On rank 0, the merged states; on the other processes, None.
    """
    clock = Clock()  # "start": importing torch and transformers, joining the processes
    import torch

    from probe.distributed import Tally, joined, merge_to_leader
    from probe.run.loading import load, resolve_device

    settings = run.settings
    device = resolve_device(settings.device, ranks.local_rank)
    with joined(ranks, device):
        clock.lap("start")
        status(f"loading {settings.model}")
        torch.manual_seed(settings.seed)
        model, tokenizer = load(
            settings.model,
            device=device,
            dtype=settings.dtype,
            revision=settings.revision,
            trust_remote_code=settings.trust_remote_code,
            lm_head=settings.lm_head,
            before_weights=partial(_check_tokenizer, run),
            **_placement(settings, ranks),
        )
        run, skipped, unknown = _readable(run, tokenizer)
        chosen, examples = _begin(run, model, tokenizer)
        _freeze()
        clock.lap("load")
        tally = Tally()
        for name in run.units:
            readers = [a for a in chosen if name in run.reads[a.name]]
            tally[name] = _stream_unit(run, name, readers, examples, model, tokenizer, ranks,
                                       progress, status)  # fmt: skip
        clock.lap("analyses")
        if ranks.size > 1:
            status(f"merging the analyses of {ranks.size} processes")
        merged = merge_to_leader([*chosen, tally, *([examples] if examples else [])], ranks)
        if ranks.size > 1:
            clock.lap("merge")
    if merged is None:
        return None
    _check_input(run, tally)
    card = _card(run, model, tokenizer, chosen, ranks, tally)
    card.timings_s = clock.timings
    card.unknown_words, card.skipped = unknown, skipped
    card.warnings = _unreadable_warnings(unknown, skipped, tokenizer)
    return Outcome(chosen, examples, card, card.layers, card.heads)


def _readable(run: Plan, tokenizer) -> tuple[Plan, dict[str, str], dict[str, dict]]:
    """The run without what its tokenizer cannot read: the share of the treebank's and the
    corpus's words that become the unknown token (``probe.inputs.unknown``), and, where that is
    more than ``MOSTLY_UNKNOWN``, the run without the units of that input: an analysis that
    read nothing else is skipped (with why), one that reads another unit too goes on without it.

    Raises
    ------
    ProbeError
        Where no analysis is left.
    """
    from dataclasses import replace
    from itertools import islice

    from probe.inputs import unknown as unknowns

    inputs = {units.get_input(u) for u in run.units}
    measured = {}
    if "treebank" in inputs:
        from probe.inputs.treebank import iter_treebank

        sentences = islice(iter_treebank(run.source.treebank), run.source.max_sentences)
        measured["treebank"] = unknowns.unknown_words(tokenizer, unknowns.treebank_words(sentences))
    if "corpus" in inputs:
        from probe.inputs.texts import texts

        rows = texts(run.source.corpus, run.source.max_texts)
        measured["corpus"] = unknowns.unknown_words(tokenizer, unknowns.corpus_words(rows))
    unreadable = {name for name, m in measured.items() if m["share"] > unknowns.MOSTLY_UNKNOWN}
    if not unreadable:
        return run, {}, measured
    dropped = {u for u in run.units if units.get_input(u) in unreadable}
    reads = {name: tuple(u for u in read if u not in dropped) for name, read in run.reads.items()}
    skipped = {}
    for cls in run.classes:
        lost = [units.get_input(u) for u in run.reads[cls.name] if u in dropped]
        if lost and not reads[cls.name]:
            m = measured[lost[0]]
            skipped[cls.name] = (f"{m['share']:.0%} of the {lost[0]}'s words (of the first "
                                 f"{m['words']}) are the tokenizer's unknown token")  # fmt: skip
    classes = tuple(cls for cls in run.classes if cls.name not in skipped)
    if not classes:
        what = " and ".join(sorted(unreadable))
        m = measured[min(unreadable)]
        raise ProbeError(f"{m['share']:.0%} of the {min(unreadable)}'s words (of the first "
                         f"{m['words']}) become the tokenizer's unknown token, and every analysis "
                         f"of this run reads the {what}; give a {what} in the model's language, "
                         "or analyses of the weights or of repeated sequences")  # fmt: skip
    reads = {cls.name: reads[cls.name] for cls in classes}
    needed = tuple(u for u in run.units if u not in dropped)
    return replace(run, classes=classes, reads=reads, units=needed), skipped, measured


def _unreadable_warnings(unknown: dict[str, dict], skipped: dict[str, str], tokenizer) -> list:
    """One line per input the tokenizer mostly cannot read: the share, and what was skipped."""
    from probe.inputs.unknown import MOSTLY_UNKNOWN

    lines = []
    for name, m in unknown.items():
        if m["share"] > MOSTLY_UNKNOWN:
            gone = [a for a, why in skipped.items() if f"the {name}'s words" in why]
            lines.append(
                f"{m['share']:.0%} of the {name}'s words (of the first {m['words']}) become the "
                f"tokenizer's unknown token {tokenizer.unk_token!r}: the model cannot read the "
                f"{name}, so nothing was measured on it"
                + (f"; skipped {', '.join(gone)}" if gone else "")
            )
    return lines


def _begin(run: Plan, model, tokenizer) -> tuple[list[analyses.Analysis], Any]:
    """The analyses that can run on ``model``, created; and the head cards' example sentences,
    when a unit that gives them is streamed for an analysis of patterns."""
    from probe.app.examples import Examples
    from probe.capture.spec import describe

    classes = _applicable(run, model)
    spec = describe(model)
    n_layers, n_heads = spec.n_layers, spec.n_heads
    chosen = []
    for cls in classes:
        context = analyses.Context(
            n_layers, n_heads, spec.causal, run.settings.seed, run.thresholds, model,
            run.options_of(cls.options), tokenizer.mask_token_id, tokenizer,
        )  # fmt: skip
        chosen.append(cls(context))
    examples = None
    cards = [a for a in chosen if "hook_pattern" in a.captures]
    if any(units.get(u).examples for a in cards for u in run.reads[a.name]):
        examples = Examples(tokenizer, n_layers, n_heads)
    return chosen, examples


def _freeze() -> None:
    """When the command line paused the collector for the start-up: imports and the model made
    about a million objects that live as long as the run, which it need not walk again."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def _stream_unit(run: Plan, name: str, readers, examples, model, tokenizer, ranks, progress,
                 status) -> dict:  # fmt: skip
    """Stream unit ``name`` through ``model`` for the analyses that read it; its tally."""
    from probe.capture.spec import describe
    from probe.inputs.corpus import max_tokens
    from probe.run.runner import stream, stream_rows

    if not readers:  # none of its analyses applies to this model
        return {}
    cls = units.get(name)
    needed = [a.reads for a in readers]
    unit = cls(run.source, tokenizer, max_tokens(model.config, tokenizer), shard=ranks.shard,
               options=run.options_of(cls.options),
               stop=None if None in needed else max(needed))  # fmt: skip
    status(f"analysing {cls.label}")
    batches = _tagged(unit.batches(run.settings.batch_size), name)
    if progress is not None:
        batches = progress(f"analysing {cls.counted or cls.label}", unit.size())(batches)
    consumers = [*readers, *([examples] if examples and cls.examples else [])]
    wanted = sorted({c for a in readers for c in a.captures})
    # Patterns in blocks of rows, beside the model's sdpa kernel, when every consumer that reads
    # captures takes them (importance reads none: only the batches)
    rows = all(getattr(c, "rows", False) or getattr(c, "captures", None) == () for c in consumers)
    if set(wanted) == {"hook_pattern"} and rows and describe(model).rows_unsupported is None:
        stream_rows(model.base_model, batches, consumers, parse_size(run.settings.attention_budget))
    else:
        stream(model.base_model, batches, consumers, wanted)  # no language-model head needed
    return unit.tally()


def _tagged(batches: Iterable, name: str) -> Iterator:
    """``batches``, each marked with the unit that made it (an analysis may read several)."""
    for batch in batches:
        batch.unit = name
        yield batch


def _check_input(run: Plan, tally: dict) -> None:
    """A treebank that gave the sentence unit nothing to read, or nothing it could analyse."""
    sentences = tally.get("sentence")  # {} where no analysis of sentences applied
    if sentences and not sentences["read"]:
        raise ProbeError(f"no sentences in {', '.join(map(str, run.source.treebank))}")
    if sentences and not sentences["analysed"]:
        reasons = ", ".join(f"{n} {why}" for why, n in sentences["skipped"].items())
        raise ProbeError(f"no sentence can be analysed ({reasons}); try another treebank")
    text = tally.get("text")  # {} where no analysis of a corpus applied
    if text and not text["windows"]:
        raise ProbeError(f"no text of corpus {run.source.corpus.name} has a token")


def _card(run: Plan, model, tokenizer, chosen, ranks, tally) -> RunCard:
    from probe.capture.spec import describe
    from probe.inputs.corpus import max_tokens
    from probe.run import threads
    from probe.run.loading import describe_source, main_device

    settings, config, spec = run.settings, model.config, describe(model)
    limit = max_tokens(config, tokenizer)
    used = dict(run.options)  # as the units used them: a window capped at the model's limit
    for name in run.units:
        used |= units.get(name).used(run.options, limit)
    return RunCard(
        model=settings.model,
        model_source=describe_source(settings.model),
        model_type=config.model_type,
        revision=settings.revision or getattr(config, "_commit_hash", None),
        tokenizer=type(tokenizer).__name__,
        layers=spec.n_layers,
        heads=spec.n_heads,
        d_model=spec.d_model,
        causal=spec.causal,
        spec=spec.as_dict(),
        device=str(main_device(model)),
        device_map=_device_map(model),
        processes=ranks.size,
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        treebank=[str(p) for p in run.source.treebank],
        inputs={name: _plain(counts) for name, counts in tally.items()},
        reads={a.name: list(run.reads[a.name]) for a in chosen},
        analyses=[a.name for a in chosen],
        options=used,
        seed=settings.seed,
        batch_size=settings.batch_size,
        lm_head=settings.lm_head,
        thresholds=asdict(run.thresholds),
        packages=package_versions(),
        threads=threads.in_effect(),
        row_statistics=_row_statistics(),
        command=" ".join(["probe", *sys.argv[1:]]) if sys.argv else "probe analyze",
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        corpus=run.source.corpus.describe() if run.source.corpus else None,
        context=_context(run, limit) if "text" in run.units else None,
    )


def _row_statistics() -> str | None:
    """How the row path summarised its blocks, where it ran (``probe.capture.fused.used``)."""
    fused = sys.modules.get("probe.capture.fused")
    return None if fused is None else fused.used()


def _context(run: Plan, limit: int) -> int:
    """The tokens per window of the corpus, as the text unit cuts it."""
    from probe.inputs.units.texts import DEFAULT_CONTEXT

    return min(run.source.context or DEFAULT_CONTEXT, limit)


def _plain(counts: dict) -> dict:
    return {k: _plain(v) if isinstance(v, dict) else v for k, v in counts.items()}


def publish(run: Plan, outcome: Outcome, folder: Path, status: Callable[[str], None]) -> None:
    """Finish the analyses into tables, and write them, the examples, the report and
    ``run.json`` into ``folder`` (the staging folder that ``reserved`` moves into place)."""
    from probe.app.page import compile_templates

    clock = Clock()
    # first: the helper process compiled the templates while torch imported, and answers at
    # once, where it would answer only after a fit handed to it
    compile_templates([analysis.name for analysis in outcome.analyses])
    classes = [type(a) for a in outcome.analyses]
    schemas = table_io.schemas(classes)
    handed = {analysis.name: analysis.hand_off() for analysis in outcome.analyses}
    # While the helper process works on what was handed to it, this one imports the page and
    # finishes the other analyses; those that wait on the helper finish last. The helper then
    # writes the files, each queued behind that work, while this one goes on.
    from probe.app import examples as examples_io
    from probe.app.report import render_html

    finished, tables, written = {}, {}, []
    # Those that read the others' heads (claims tested by ablation) finish after them.
    last = [a for a in outcome.analyses if a.reads_heads]
    for analysis in sorted(outcome.analyses, key=lambda a: (a.reads_heads, handed[a.name])):
        status(f"finishing: {analysis.title.lower()}")
        started = time.perf_counter()
        if analysis.reads_heads:
            others = [type(a) for a in outcome.analyses if a not in last]
            analysis.take_heads(join_heads(others, finished, run.thresholds, outcome.n_layers,
                                           outcome.n_heads))  # fmt: skip
        done = analysis.finish()
        outcome.card.finish_s[analysis.name] = round(time.perf_counter() - started, 3)
        finished |= done
        for name in (name for name in done if name in schemas):
            tables[name] = table_io.typed(done[name], schemas[name], name)
            written.append(helper.submit(table_io.write, tables[name], folder / f"{name}.csv"))
    heads = join_heads(classes, finished, run.thresholds, outcome.n_layers, outcome.n_heads)
    tables["heads"] = table_io.typed(heads, schemas["heads"], "heads")
    written.append(helper.submit(table_io.write, tables["heads"], folder / "heads.csv"))
    tables = {name: tables[name] for name in schemas}
    if "claims_run" in tables:
        outcome.card.claims = json.loads(tables["claims_run"].to_json(orient="records"))
    clock.lap("tables")
    examples = {"sentences": [], "heads": {}}
    if outcome.examples is not None:
        chosen, patterns = outcome.examples.choose(tables["heads"]), outcome.examples.patterns()
        written.append(helper.submit(examples_io.write, folder, chosen, patterns))
        examples = examples_io.assemble(chosen, patterns)
    status("rendering the report")
    card = outcome.card
    card.timings_s |= clock.timings
    try:
        html = render_html(card.as_dict(), tables, examples)
        write_file(folder / "index.html", html)
        for pending in written:  # every file in place (or written here, where the helper failed)
            pending.result()
    except BaseException:  # nothing of the helper's may land in the folder being removed
        helper.abandon()
        raise
    _check_written(folder, tables)
    clock.lap("render")
    card.timings_s["render"] = clock.timings["render"]
    card.timings_s["total"] = round(sum(v for k, v in card.timings_s.items() if k != "total"), 3)
    write_file(folder / "run.json", json.dumps(card.as_dict(), indent=2))


def _check_written(folder: Path, tables: dict) -> None:
    """Every table is in the folder before it is published (the helper wrote it, or the run)."""
    missing = [name for name in tables if not (folder / f"{name}.csv").is_file()]
    if missing:
        raise ProbeError(f"the report's table {missing[0]}.csv was not written; nothing was "
                         "replaced: re-run probe analyze")  # fmt: skip


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for package in PACKAGES:
        with suppress(PackageNotFoundError):
            versions[package] = version(package)
    return versions


def join_heads(
    classes: Sequence[type[analyses.Analysis]],
    tables: dict,
    thresholds: Thresholds,
    n_layers: int,
    n_heads: int,
):
    """``heads``: one row per head, joining what every analysis says about it, with its roles.

    Returns
    -------
    pandas.DataFrame
        ``layer``, ``head``, each analysis's ``head_columns`` (in the run's order), and
        ``roles`` (the roles granted, ``;``-separated, in the order of ``Role``).

    Raises
    ------
    analyses.ContractError
        When an analysis's ``heads`` gives columns other than those it declares.
    """
    import pandas as pd

    from probe.heads import all_heads

    heads = pd.DataFrame(all_heads(n_layers, n_heads), columns=["layer", "head"])
    granted = {}  # role -> held, per head: a role two analyses grant is held where either does
    for cls in classes:
        part = cls.heads(tables, thresholds)
        if part is not None:
            analyses.check_head_columns(cls, part)
            heads = heads.merge(part, on=["layer", "head"], how="left")
            for role in map(str, Role):
                if role in heads:
                    held = heads.pop(role).astype("boolean").fillna(False).to_numpy()
                    granted[role] = granted[role] | held if role in granted else held
    granted = {role: granted[role] for role in map(str, Role) if role in granted}
    heads["roles"] = [
        ";".join(role for role, held in granted.items() if held[i]) for i in range(len(heads))
    ]
    return heads


def _applicable(run: Plan, model) -> list:
    """The analyses that can run on ``model``: chosen by default, the others are left out;
    named by the user, any that cannot run is an error."""
    reasons = {cls.name: cls.unsupported(model) for cls in run.classes}
    if not run.by_default:
        for name, reason in reasons.items():
            if reason:
                raise ProbeError(f"--analyses {name}: {reason}")
    return [cls for cls in run.classes if not reasons[cls.name]]


def _check_tokenizer(run: Plan, tokenizer, config) -> None:
    """What each analysis's inputs need of the tokenizer, checked before the weights load."""
    for cls in run.classes:
        cls.check_tokenizer(tokenizer, config, run.options_of(cls.options))


def _placement(settings: Settings, ranks) -> dict:
    """``load``'s arguments for accelerate's placement. Under torchrun each process's copy of
    the model spans only its own group of GPUs (``Ranks.gpus``)."""
    if settings.device_map is None:
        return {}
    import torch

    max_memory = settings.max_memory
    if ranks.size > 1 and torch.cuda.is_available():
        from accelerate.utils import get_max_memory

        mine = ranks.gpus(torch.cuda.device_count())
        available = get_max_memory() | (max_memory or {})
        max_memory = {k: v for k, v in available.items() if not isinstance(k, int) or k in mine}
    return {"device_map": settings.device_map, "max_memory": max_memory,
            "offload_folder": settings.offload_folder}  # fmt: skip


def _device_map(model) -> dict[str, str] | None:
    """Where accelerate placed each part of the model (GPU index, ``cpu`` or ``disk``)."""
    placed = getattr(model, "hf_device_map", None)
    return {name: str(where) for name, where in placed.items()} if placed else None
