"""``probe analyze``: one model, one treebank, every analysis, one output folder."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from probe.architectures import blocks, is_causal
from probe.corpus import encode, max_tokens
from probe.errors import ProbeError
from probe.loading import load, resolve_name
from probe.runner import run
from probe.treebank import SAMPLE, load_treebank

ANALYSES = ("syntax", "roles", "spectra", "probe")
PACKAGES = ("probe", "torch", "transformers", "datasets", "scikit-learn", "numpy", "pandas")


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
    analyses: Sequence[str] = ANALYSES
    seed: int = 0
    overwrite: bool = False
    revision: str | None = None
    trust_remote_code: bool = False
    thresholds: dict = field(default_factory=dict)


def slug(name: str) -> str:
    """A folder name for a model id or path (``google-bert/bert-base-uncased`` -> its last part)."""
    last = Path(name.rstrip("/")).name or name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", last).strip("-.") or "model"


def default_out(model: str) -> Path:
    return Path("reports") / slug(model)


def check_free(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        raise ProbeError(f"output folder {out} already exists; use --overwrite or another --out")


@contextmanager
def staged(out: Path, overwrite: bool) -> Iterator[Path]:
    """A temporary folder beside ``out`` that becomes ``out`` only if the body completes."""
    check_free(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield temporary
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            temporary.rename(out)
            shutil.rmtree(old)
        else:
            temporary.rename(out)
    finally:
        if temporary.exists():
            shutil.rmtree(temporary)


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for package in PACKAGES:
        with suppress(PackageNotFoundError):
            versions[package] = version(package)
    return versions


def analyze(
    settings: Settings,
    progress: Callable[[str, int | None], Callable[[Iterator], Iterator]] | None = None,
    status: Callable[[str], None] = lambda message: None,
) -> Path:
    """Run the analyses and write the report folder; returns its path.

    Parameters
    ----------
    settings : Settings
    progress : callable, optional
        ``progress(description, total)`` returns a wrapper that shows progress over an
        iterator (the CLI passes rich progress bars); None shows nothing.
    status : callable
        Receives one-line messages about the stage that starts.
    """
    from analyses import probing, roles, spectra, syntax
    from analyses.examples import ExampleCollector
    from probe.report import render

    unknown = set(settings.analyses) - set(ANALYSES)
    if unknown:
        raise ProbeError(
            f"unknown analysis {', '.join(sorted(unknown))}; choose from {', '.join(ANALYSES)}"
        )
    known = set(roles.Thresholds.__dataclass_fields__)
    if set(settings.thresholds) - known:
        wrong = ", ".join(sorted(set(settings.thresholds) - known))
        raise ProbeError(f"unknown threshold {wrong}; known: {', '.join(sorted(known))}")
    out = Path(settings.out) if settings.out else default_out(settings.model)
    check_free(out, settings.overwrite)
    timings: dict[str, float] = {}
    started = clock = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[stage] = round(now - clock, 3)
        clock = now

    status(f"reading treebank {', '.join(map(str, settings.treebank or [SAMPLE.name]))}")
    sentences = load_treebank(settings.treebank)
    read = len(sentences)
    if settings.max_sentences:
        sentences = sentences[: settings.max_sentences]
    lap("treebank")

    status(f"loading {settings.model}")
    torch.manual_seed(settings.seed)
    model, tokenizer = load(
        settings.model,
        device=settings.device,
        dtype=settings.dtype,
        revision=settings.revision,
        trust_remote_code=settings.trust_remote_code,
    )
    config = model.config
    n_layers, n_heads = len(blocks(model)), config.num_attention_heads
    causal = is_causal(model)
    lap("load")

    status("tokenizing")
    corpus = encode(sentences, tokenizer, max_tokens(config, tokenizer))
    if len(corpus) == 0:
        reasons = ", ".join(f"{n} {why}" for why, n in corpus.skipped.items())
        raise ProbeError(f"no sentence can be analysed ({reasons}); try another treebank")
    lap("tokenize")

    chosen = set(settings.analyses)
    thresholds = roles.Thresholds(**settings.thresholds)
    streaming = []
    if "syntax" in chosen:
        syntax_analysis = syntax.SyntaxAnalysis(n_layers, n_heads, seed=settings.seed)
        streaming.append(syntax_analysis)
    if "roles" in chosen:
        roles_analysis = roles.RolesAnalysis(n_layers, n_heads, causal=causal, seed=settings.seed)
        streaming.append(roles_analysis)
    if "probe" in chosen:
        probe_analysis = probing.ProbeAnalysis(len(sentences), seed=settings.seed)
        streaming.append(probe_analysis)
    examples = ExampleCollector(sentences, tokenizer)
    streaming.append(examples)

    n_batches = len(corpus.groups(settings.batch_size))
    wrap = progress("analysing batches", n_batches) if progress else iter
    run(model, corpus, streaming, batch_size=settings.batch_size, progress=wrap)
    lap("analyses")

    status("writing tables")
    tables: dict[str, pd.DataFrame] = {}
    if "syntax" in chosen:
        tables.update(syntax_analysis.tables())
    if "spectra" in chosen:
        tables.update(spectra.tables(model))
    if "roles" in chosen:
        role_tables = roles_analysis.tables()
        stats, similarity = role_tables["head_stats"], role_tables["head_similarity"]
        tables["head_similarity"] = similarity
    else:
        layer, head = np.divmod(np.arange(n_layers * n_heads), n_heads)
        stats, similarity = pd.DataFrame({"layer": layer, "head": head}), None
    best_per_head = (
        roles.best_relation_per_head(tables["syntax"], tables["syntax_baselines"], thresholds)
        if "syntax" in chosen
        else None
    )
    tables["heads"] = roles.heads_table(
        stats, similarity, best_per_head, tables.get("spectra"), thresholds, settings.seed
    )
    probe_result = probe_analysis.result() if "probe" in chosen else None
    lap("tables")

    with staged(out, settings.overwrite) as folder:
        for table_name, table in tables.items():
            table.to_csv(folder / f"{table_name}.csv", index=False)
        example_maps = examples.choose(tables["heads"], n_heads)
        (folder / "examples.json").write_text(json.dumps(example_maps), encoding="utf-8")
        run_card = {
            "model": settings.model,
            "model_source": resolve_name(settings.model),
            "model_type": config.model_type,
            "revision": settings.revision or getattr(config, "_commit_hash", None),
            "tokenizer": type(tokenizer).__name__,
            "layers": n_layers,
            "heads": n_heads,
            "d_model": config.hidden_size,
            "causal": causal,
            "device": str(next(model.parameters()).device),
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "treebank": [str(t) for t in (settings.treebank or [SAMPLE])],
            "sentences_read": read,
            "sentences_considered": len(sentences),
            "sentences_analysed": len(corpus),
            "sentences_skipped": dict(corpus.skipped),
            "words_analysed": int(sum(len(w) for w in corpus.dataset["words"])),
            "analyses": [a for a in ANALYSES if a in chosen],
            "seed": settings.seed,
            "batch_size": settings.batch_size,
            "thresholds": asdict(thresholds),
            "probe": probe_result,
            "packages": package_versions(),
            "command": " ".join(["probe", *sys.argv[1:]]) if sys.argv else "probe analyze",
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "timings_s": timings,
        }
        (folder / "run.json").write_text(json.dumps(run_card, indent=2), encoding="utf-8")
        status("rendering the report")
        render_start = time.perf_counter()
        render(folder)
        timings["render"] = round(time.perf_counter() - render_start, 3)
        timings["total"] = round(time.perf_counter() - started, 3)
        (folder / "run.json").write_text(json.dumps(run_card, indent=2), encoding="utf-8")
    return out
