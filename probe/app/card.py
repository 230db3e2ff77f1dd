"""What a report says about its run (``run.json``, and the top of the page): the ``RunCard``,
made from the plan, the loaded model and what was read (``make_card``); the seconds each stage
took (``Clock``); and the versions of the packages that ran it (``package_versions``).
"""

from __future__ import annotations

import platform
import sys
import time
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from probe.app.folder import SCHEMA
from probe.app.plan import Plan
from probe.inputs import units

PACKAGES = ("probe", "torch", "transformers", "tokenizers", "numpy", "pandas")


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
    threads: dict[str, Any] = field(default_factory=dict)  # probe.pipeline.threads.in_effect
    # How the long inputs' row blocks were summarised (probe.capture.fused.used); None: no rows
    row_statistics: str | None = None
    # The claims' ablations (analyses.claims): per kind of input, its count, the positions
    # measured, the measure, the ablation and the heads ablated; None where none ran.
    claims: list[dict[str, Any]] | None = None
    # probe timeline's: a SHA-256 of the checkpoint's weights (probe.app.timeline.weights_hash),
    # and the model's loss on the run's inputs (probe.app.timeline_loss); None in probe analyze
    weights_sha256: str | None = None
    loss: dict[str, Any] | None = None
    # The circuit's summary (analyses.circuit's circuit_run row: its size, faithfulness, the
    # ablation that chose it, MIB's cpr and cmd, the stability's jaccard with its interval);
    # None where it did not run.
    circuit: dict[str, Any] | None = None

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


def make_card(plan: Plan, model, tokenizer, chosen, ranks, tally) -> RunCard:
    """The card of a run that streamed its inputs: ``chosen``, the analyses that ran on ``model``,
    and ``tally``, what each unit read."""
    from probe.capture.spec import describe
    from probe.inputs.corpus import max_tokens
    from probe.pipeline import threads
    from probe.pipeline.loading import describe_source, main_device

    settings, config, spec = plan.settings, model.config, describe(model)
    limit = max_tokens(config, tokenizer)
    used = dict(plan.options)  # as the units used them: a window capped at the model's limit
    for name in plan.units:
        used |= units.get(name).used(plan.options, limit)
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
        treebank=[str(p) for p in plan.source.treebank],
        inputs={name: _plain(counts) for name, counts in tally.items()},
        reads={a.name: list(plan.reads[a.name]) for a in chosen},
        analyses=[a.name for a in chosen],
        options=used,
        seed=settings.seed,
        batch_size=settings.batch_size,
        lm_head=settings.lm_head,
        thresholds=asdict(plan.thresholds),
        packages=package_versions(),
        threads=threads.in_effect(),
        row_statistics=_row_statistics(),
        command=" ".join(["probe", *sys.argv[1:]]) if sys.argv else "probe analyze",
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        corpus=plan.source.corpus.describe() if plan.source.corpus else None,
        context=_context(plan, limit) if "text" in plan.units else None,
    )


def _row_statistics() -> str | None:
    """How the row path summarised its blocks, where it ran (``probe.capture.fused.used``)."""
    fused = sys.modules.get("probe.capture.fused")
    return None if fused is None else fused.used()


def _context(plan: Plan, limit: int) -> int:
    """The tokens per window of the corpus, as the text unit cuts it."""
    from probe.inputs.units.texts import DEFAULT_CONTEXT

    return min(plan.source.context or DEFAULT_CONTEXT, limit)


def _plain(counts: dict) -> dict:
    return {k: _plain(v) if isinstance(v, dict) else v for k, v in counts.items()}


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for package in PACKAGES:
        with suppress(PackageNotFoundError):
            versions[package] = version(package)
    return versions


def _device_map(model) -> dict[str, str] | None:
    """Where accelerate placed each part of the model (GPU index, ``cpu`` or ``disk``)."""
    placed = getattr(model, "hf_device_map", None)
    return {name: str(where) for name, where in placed.items()} if placed else None
