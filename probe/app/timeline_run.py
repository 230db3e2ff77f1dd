"""``probe timeline``, run: plan the checkpoints (``probe.app.timeline``), analyse each in turn in
one process, with the inputs read and tokenized once and one model in memory at a time
(``probe.app.execute.analyse``; each step's report published as ``probe analyze`` publishes it,
under ``OUT/steps/step-N``), then write the timeline's tables, ``run.json`` and page
(``probe.app.timeline_publish``).
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

from probe.app.card import Clock
from probe.app.execute import Inputs, Progress, analyse, load_model
from probe.app.output import MARKER, check_free, refuse_inputs, reserved, write_file
from probe.app.plan import Plan, Settings, plan
from probe.app.publish import publish
from probe.app.timeline import (
    SAME_RUN,
    Checkpoint,
    check_tokenizer,
    checkpoints,
    load_failed,
    recorded_hashes,
    steps_to_run,
    tokenizer_fingerprint,
    weights_hash,
)
from probe.errors import ProbeError


class TokenizerDiffersError(ProbeError):
    """A checkpoint's tokenizer is not the first one's: the run stops before its weights load."""


def plan_timeline(settings: Settings, revisions: str | None, resume: bool):
    """Check a timeline before torch is imported: its checkpoints, its folder and the analyses'
    plan (made for the first checkpoint; the others differ only in model and folder).

    Returns
    -------
    (checkpoints, plan, the checkpoints still to run)
    """
    if settings.out is None:
        raise ProbeError("probe timeline needs --out DIR: the folder of the timeline's reports")
    if settings.revision is not None or settings.overwrite:
        raise ProbeError("probe timeline takes --revisions and --resume, not --revision or "
                         "--overwrite")  # fmt: skip
    out = Path(settings.out)
    planned = checkpoints(settings.model, revisions)
    if Path(settings.model).exists():
        refuse_inputs(out, [Path(settings.model)])
    if not resume and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ProbeError(f"output folder {out} already exists and is not empty; give another "
                         "--out, or --resume to finish the run in it")  # fmt: skip
    if resume and out.exists() and not (out / "steps").is_dir() and any(out.iterdir()):
        raise ProbeError(
            f"--resume: {out} is no timeline's folder (it has no steps/): give the folder of "
            "the run to resume, or a new one without --resume"
        )
    first = planned[0]
    # The steps' folders are reserved one by one (overwrite: a step cut short is analysed again)
    base = plan(replace(settings, out=out / first.folder, overwrite=True,
                        model=first.source, revision=first.revision))  # fmt: skip
    if not out.exists():  # one that exists is empty, or the run's own (resumed)
        check_free(out, overwrite=False, kind="timeline")
    todo = steps_to_run(out, planned, _known_settings(base), resume)
    return planned, base, todo


def _known_settings(base: Plan) -> dict:
    """The values of ``SAME_RUN`` that the plan fixes before any model loads, as a step's
    ``run.json`` records them (the analyses only where the user named them: by default those
    that apply to the model run)."""
    settings = base.settings
    known = {"seed": settings.seed, "lm_head": settings.lm_head,
             "thresholds": asdict(base.thresholds),
             "treebank": [str(p) for p in base.source.treebank],
             "corpus": base.source.corpus.describe() if base.source.corpus else None}  # fmt: skip
    if not base.by_default:
        known["analyses"] = [cls.name for cls in base.classes]
    return {k: v for k, v in known.items() if k in SAME_RUN}


def for_step(base: Plan, out: Path, checkpoint: Checkpoint) -> Plan:
    """The plan of one checkpoint: the first's, with its model, revision and report folder."""
    folder = Path(out) / checkpoint.folder
    settings = replace(base.settings, model=checkpoint.source, revision=checkpoint.revision,
                       out=folder)  # fmt: skip
    return replace(base, settings=settings, output=folder)


def run_timeline(
    settings: Settings,
    revisions: str | None = None,
    resume: bool = False,
    progress: Progress | None = None,
    status: Callable[[str], None] = lambda message: None,
) -> Path:
    """Analyse every checkpoint of ``settings.model`` (a folder of checkpoints, or a hub model
    with ``revisions``) into ``settings.out``, and write the timeline; returns its folder.

    Each checkpoint's report is published under ``steps/step-N`` as soon as it is done, so
    that a failure leaves the steps before it (``--resume`` goes on from there).

    Raises
    ------
    ProbeError
        Bad input, in one line: no checkpoints, an unreadable step name, revisions for a local
        folder, tokenizers that differ, a checkpoint that fails to load, ``--resume`` on
        another run's folder.
    """
    from probe.app.timeline_publish import write_timeline

    planned, base, todo = plan_timeline(settings, revisions, resume)
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / MARKER).exists():
        write_file(out / MARKER, json.dumps({"kind": "timeline"}))
    hashes = recorded_hashes(out, planned) if resume else {}
    if todo:
        hashes |= _analyse_steps(base, out, planned, todo, progress, status)
    status("writing the timeline")
    return write_timeline(out, planned, hashes, base)


def _analyse_steps(base: Plan, out: Path, planned: list[Checkpoint], todo: list[Checkpoint],
                   progress, status) -> dict[int, str]:  # fmt: skip
    """Each checkpoint of ``todo`` loaded, analysed and published in turn; their weights'
    hashes by step."""
    from probe.distributed import Ranks, joined
    from probe.pipeline.loading import resolve_device

    ranks = Ranks.from_environment()
    if ranks.size > 1:
        raise ProbeError("probe timeline runs in one process: run it without torchrun")
    device = resolve_device(base.settings.device, ranks.local_rank)
    first = planned[0]
    first_print = _fingerprint(for_step(base, out, first))
    inputs, hashes = Inputs(), {}
    with joined(ranks, device):
        for checkpoint in todo:
            step = for_step(base, out, checkpoint)
            clock = Clock()
            try:
                model, tokenizer = load_model(step, device, ranks, status, _same_tokenizer(
                    first, first_print, checkpoint))  # fmt: skip
            except TokenizerDiffersError:
                raise
            except Exception as error:  # any failure to load is one line
                raise load_failed(checkpoint, error, out) from None
            hashes[checkpoint.step] = weights_hash(model)
            with reserved(step.output, overwrite=True) as folder:
                outcome = analyse(step, model, tokenizer, ranks, progress, status, clock, inputs)
                outcome.card.weights_sha256 = hashes[checkpoint.step]
                outcome.card.command = "probe timeline"
                if base.settings.lm_head and "repeats" in inputs.units:
                    from probe.app.timeline_loss import second_copy_loss

                    outcome.card.loss = second_copy_loss(model, tokenizer, inputs, step)
                del model
                publish(step, outcome, folder, status)
            del outcome
            # analyse froze what the start made (execute._freeze), the first model with it:
            # unfrozen, so that a cycle in a model is freed before the next one loads
            gc.unfreeze()
            gc.collect()
    return hashes


def _fingerprint(step: Plan) -> str:
    """The first checkpoint's tokenizer's fingerprint, its model not loaded."""
    from transformers import AutoTokenizer

    kwargs = {"revision": step.settings.revision} if step.settings.revision else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(step.settings.model, **kwargs)
    except Exception as error:  # one line, as a load that fails
        first = Checkpoint(0, step.settings.model, step.settings.model, step.settings.revision)
        raise ProbeError(f"cannot read the tokenizer of {first.source}"
                         f"{' at revision ' + first.revision if first.revision else ''}: "
                         f"{(str(error).strip().splitlines() or [type(error).__name__])[0]}"
                         ) from None  # fmt: skip
    return tokenizer_fingerprint(tokenizer)


def _same_tokenizer(first: Checkpoint, first_print: str, checkpoint: Checkpoint) -> Callable:
    """``load``'s check before the weights: the checkpoint's tokenizer is the first's."""

    def check(tokenizer, config) -> None:
        try:
            check_tokenizer(first, first_print, checkpoint, tokenizer_fingerprint(tokenizer))
        except ProbeError as error:
            raise TokenizerDiffersError(str(error)) from None

    return check
