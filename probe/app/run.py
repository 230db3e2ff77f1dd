"""``probe analyze``: one model, one treebank, the chosen analyses, one output folder.

The run is a loop over the analyses the user chose (``analyses.REGISTRY``): what they need
decides the work (the corpus is read and the model run only for analyses that capture
attention), they stream layer by layer, finish into tables, and the report is drawn from those
tables alone.
"""

from __future__ import annotations

import gc
import json
import platform
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from itertools import islice
from pathlib import Path

import analyses
from analyses.vocabulary import Role, Thresholds
from probe.app import tables as table_io
from probe.app.output import check_free, default_out, reserved
from probe.errors import ProbeError

PACKAGES = ("probe", "torch", "transformers", "tokenizers", "numpy", "pandas")
WINDOWS_PER_BATCH_SHARE = 4  # a batch holds at most a quarter of batch_size full windows
Progress = Callable[[str, int | None], Callable[[Iterable], Iterator]]


@dataclass
class Settings:
    """Everything ``probe analyze`` needs; the CLI's options, one to one."""

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
    analyses: Sequence[str] = tuple(analyses.defaults())
    seed: int = 0
    coref_window: int = 128
    lm_head: bool = False  # load the model with its language-model head (for importance)
    importance_sentences: int = 200
    importance_ablation: str = "mean"
    overwrite: bool = False
    revision: str | None = None
    trust_remote_code: bool = False
    thresholds: dict = field(default_factory=dict)

    @property
    def output(self) -> Path:
        return Path(self.out) if self.out else default_out(self.model)


def check(settings: Settings) -> Thresholds:
    """Check the options that need nothing loaded; returns the thresholds they set.

    Raises
    ------
    ProbeError
        For an unknown analysis or threshold, or an output folder that is taken.
    """
    unknown = [a for a in settings.analyses if a not in analyses.REGISTRY]
    if unknown or not settings.analyses:
        known = ", ".join(analyses.REGISTRY)
        raise ProbeError(f"unknown analysis {', '.join(unknown) or '(none)'}; choose from {known}")
    wrong = sorted(set(settings.thresholds) - set(Thresholds.names()))
    if wrong:
        known = ", ".join(Thresholds.names())
        raise ProbeError(f"unknown threshold {', '.join(wrong)}; known: {known}")
    try:
        thresholds = Thresholds(**settings.thresholds)
    except ValueError as e:
        raise ProbeError(f"--threshold: {e}") from None
    check_free(settings.output, settings.overwrite)
    return thresholds


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
        ``layer``, ``head``, each analysis's ``head_columns`` (in registry order), and ``roles``
        (the roles granted, ``;``-separated, in the order of ``Role``).
    """
    import pandas as pd

    from probe.heads import all_heads

    heads = pd.DataFrame(all_heads(n_layers, n_heads), columns=["layer", "head"])
    for cls in classes:
        part = cls.heads(tables, thresholds)
        if part is not None:
            heads = heads.merge(part, on=["layer", "head"], how="left")
    granted = {
        role: heads.pop(role).astype("boolean").fillna(False).to_numpy()
        for role in map(str, Role)
        if role in heads
    }
    heads["roles"] = [
        ";".join(role for role, held in granted.items() if held[i]) for i in range(len(heads))
    ]
    return heads


def captures(consumers: Sequence[analyses.Analysis]) -> list[str]:
    """The hook suffixes any of ``consumers`` reads."""
    return sorted({c for a in consumers for c in a.captures})


def analyze(
    settings: Settings,
    progress: Progress | None = None,
    status: Callable[[str], None] = lambda message: None,
) -> Path | None:
    """Run the analyses and write the report folder; returns its path.

    Under torchrun every process runs this: each streams its share of the corpus, the states
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
    thresholds = check(settings)
    from probe.distributed import Ranks

    ranks = Ranks.from_environment()
    paused = not gc.isenabled()  # see _run
    try:
        if not ranks.leader:
            _run(settings, thresholds, ranks, None, progress, status)
            return None
        # Reserved before any compute: a second run to the same place fails now, not at the end.
        with reserved(settings.output, settings.overwrite) as folder:
            _run(settings, thresholds, ranks, folder, progress, status)
        return settings.output
    finally:
        if paused:  # as the caller left it, and what _run froze can be freed again
            gc.unfreeze()
            gc.disable()


def _run(
    settings: Settings,
    thresholds: Thresholds,
    ranks,
    folder: Path | None,
    progress: Progress | None,
    status: Callable[[str], None],
) -> None:
    """``analyze``'s work; rank 0 writes the report's files into ``folder``."""
    timings: dict[str, float] = {}
    started = clock = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[stage] = round(now - clock, 3)
        clock = now

    classes = [analyses.get(name) for name in analyses.REGISTRY if name in settings.analyses]
    streaming = any(cls.unit for cls in classes)
    schemas = table_io.schemas(classes)  # checked before any compute

    import torch

    from analyses import Context
    from probe.app import examples as examples_io
    from probe.app.examples import Examples
    from probe.app.report import render_html
    from probe.architectures import blocks, head_count, is_causal
    from probe.coreference import Windows
    from probe.corpus import Corpus, max_tokens
    from probe.distributed import Tally, joined, merge_to_leader
    from probe.loading import describe_source, load, main_device, resolve_device
    from probe.runner import stream
    from probe.treebank import iter_treebank, treebank_paths

    paths = treebank_paths(settings.treebank) if streaming else []
    device = resolve_device(settings.device, ranks.local_rank)
    if not ranks.leader:  # one process speaks for the run
        progress, status = None, lambda message: None

    with joined(ranks, device):
        lap("start")
        status(f"loading {settings.model}")
        torch.manual_seed(settings.seed)
        model, tokenizer = load(
            settings.model,
            device=device,
            dtype=settings.dtype,
            revision=settings.revision,
            trust_remote_code=settings.trust_remote_code,
            lm_head=settings.lm_head,
            **_placement(settings, ranks),
        )
        config = model.config
        classes = _applicable(classes, model, settings)
        schemas = table_io.schemas(classes)
        n_layers, n_heads = len(blocks(model)), head_count(model)
        causal = is_causal(model)
        options = {
            "importance_sentences": settings.importance_sentences,
            "importance_ablation": settings.importance_ablation,
            "mask_token_id": tokenizer.mask_token_id,
        }
        context = Context(n_layers, n_heads, causal, settings.seed, thresholds, model, options)
        chosen = [cls(context) for cls in classes]
        if not gc.isenabled():  # the command line paused the collector for the start-up:
            # imports and the model made about a million objects that live as long as the run,
            # which the collector need not walk again and again
            gc.freeze()
            gc.enable()
        lap("load")

        tally = Tally()
        examples = None
        limit = max_tokens(config, tokenizer)
        window = min(settings.coref_window, limit)
        sentence_analyses = [a for a in chosen if a.unit == "sentence"]
        window_analyses = [a for a in chosen if a.unit == "window"]
        body = model.base_model  # the stream needs no language-model head
        coreference_seen = not sentence_analyses  # unknown until the treebank has been read
        if sentence_analyses:
            status(f"analysing {', '.join(map(str, paths))}")

            def sentences():
                nonlocal coreference_seen
                for sentence in iter_treebank(paths):  # every process reads every sentence
                    coreference_seen = coreference_seen or any(sentence.entity)
                    yield sentence

            needed = [a.reads for a in sentence_analyses]
            stop = settings.max_sentences
            if None not in needed and not window_analyses:  # e.g. importance alone
                stop = min(stop or max(needed), max(needed))
            corpus = Corpus(sentences(), tokenizer, limit, max_sentences=stop, shard=ranks.shard)
            wanted = captures(sentence_analyses)
            if "hook_pattern" in wanted:  # the head cards' example maps
                examples = Examples(tokenizer, n_layers, n_heads)
            batches = corpus.batches(settings.batch_size)
            if progress is not None:
                total = settings.max_sentences and -(-settings.max_sentences // ranks.size)
                batches = progress("analysing sentences", total)(batches)
            stream(body, batches, [*sentence_analyses, *filter(None, [examples])], wanted)
            tally |= {"read": corpus.read, "analysed": corpus.analysed, "words": corpus.words,
                      "skipped": Tally(corpus.skipped)}  # fmt: skip
        if window_analyses and coreference_seen:  # a treebank without Entity= needs no windows
            status("analysing coreference windows")
            read = islice(iter_treebank(paths), settings.max_sentences)
            windows = Windows(read, tokenizer, window, shard=ranks.shard)
            # Windows are all near the limit: a batch of them is bounded by cells, as sentences are.
            cells = settings.batch_size * window * window // WINDOWS_PER_BATCH_SHARE
            window_corpus = Corpus(windows, tokenizer, window)
            batches = window_corpus.batches(settings.batch_size, cells)
            if progress is not None:
                batches = progress("coreference windows", None)(batches)
            stream(body, batches, window_analyses, captures(window_analyses))
            tally["coref"] = Tally(
                documents=windows.documents,
                windows=windows.windows,
                mentions=windows.mentions,
                sentences_skipped=windows.skipped,
                # windows the corpus refused (tokenized in context, one came out too long)
                windows_skipped=Tally(window_corpus.skipped),
            )
        lap("analyses")
        if ranks.size > 1:
            status(f"merging the analyses of {ranks.size} processes")
        merged = merge_to_leader([*chosen, tally, *([examples] if examples else [])], ranks)
        if ranks.size > 1:
            lap("merge")
    if merged is None:
        return
    if sentence_analyses and not tally["read"]:
        raise ProbeError(f"no sentences in {', '.join(map(str, paths))}")
    if sentence_analyses and not tally["analysed"]:
        reasons = ", ".join(f"{n} {why}" for why, n in tally["skipped"].items())
        raise ProbeError(f"no sentence can be analysed ({reasons}); try another treebank")

    tables = {}
    for analysis in chosen:
        status(f"finishing: {analysis.title.lower()}")
        tables |= analysis.finish()
    tables["heads"] = join_heads(classes, tables, thresholds, n_layers, n_heads)
    tables = {name: table_io.typed(tables[name], schema) for name, schema in schemas.items()}
    lap("tables")

    coref = tally.get("coref", {})
    run_card = {
        "model": settings.model,
        "model_source": describe_source(settings.model),
        "model_type": config.model_type,
        "revision": settings.revision or getattr(config, "_commit_hash", None),
        "tokenizer": type(tokenizer).__name__,
        "layers": n_layers,
        "heads": n_heads,
        "d_model": config.hidden_size,
        "causal": causal,
        "device": str(main_device(model)),
        "device_map": _device_map(model),
        "processes": ranks.size,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "treebank": [str(p) for p in paths],
        "sentences_read": tally.get("read", 0),
        "sentences_analysed": tally.get("analysed", 0),
        "sentences_skipped": dict(tally.get("skipped", {})),
        "words_analysed": tally.get("words", 0),
        "coref": {
            "window": window if streaming else None,
            "documents": coref.get("documents", 0),
            "windows": coref.get("windows", 0),
            "mentions": coref.get("mentions", 0),
            "sentences_skipped": coref.get("sentences_skipped", 0),
            "windows_skipped": dict(coref.get("windows_skipped", {})),
        },
        "analyses": [cls.name for cls in classes],
        "seed": settings.seed,
        "batch_size": settings.batch_size,
        "lm_head": settings.lm_head,
        "thresholds": asdict(thresholds),
        "packages": package_versions(),
        "command": " ".join(["probe", *sys.argv[1:]]) if sys.argv else "probe analyze",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "timings_s": timings,
    }
    for name, table in tables.items():
        table_io.write(table, folder / f"{name}.csv")
    if examples is not None:
        examples_io.write(folder, examples.choose(tables["heads"]), examples.patterns())
    status("rendering the report")
    html = render_html(run_card, tables, examples_io.read(folder))
    (folder / "index.html").write_text(html, encoding="utf-8")
    lap("render")
    timings["total"] = round(time.perf_counter() - started, 3)
    (folder / "run.json").write_text(json.dumps(run_card, indent=2), encoding="utf-8")


def _applicable(classes: list, model, settings: Settings) -> list:
    """The analyses that can run on ``model``: chosen by default, the others are left out;
    named by the user, any that cannot run is an error."""
    reasons = {cls.name: cls.unsupported(model) for cls in classes}
    if list(settings.analyses) != analyses.defaults():
        for name, reason in reasons.items():
            if reason:
                raise ProbeError(f"--analyses {name}: {reason}")
    return [cls for cls in classes if not reasons[cls.name]]


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
