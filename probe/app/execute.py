"""A planned run, executed: load the model, stream every input unit a chosen analysis reads
(``probe.inputs.units``) through it, handing each layer's captures to the analyses that read
that unit, and merge the processes' states exactly (``probe.distributed``). What it leaves for
``probe.app.publish`` is an ``Outcome``: the merged analyses and the run card.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import analyses
from probe.app.card import Clock, RunCard, make_card
from probe.app.plan import Plan, Settings
from probe.errors import ProbeError
from probe.inputs import units
from probe.options import parse_size

Progress = Callable[[str, int | None], Callable[[Iterable], Iterator]]


@dataclass
class Outcome:
    """What ``execute`` leaves for ``publish``: the merged states and what the run card needs."""

    analyses: list[analyses.Analysis]
    examples: Any  # probe.app.examples.Examples, when head cards have example sentences
    card: RunCard
    n_layers: int
    n_heads: int


class Inputs:
    """The run's inputs as read and tokenized once, for runs of several models with one tokenizer
    (``probe timeline``'s checkpoints): what the tokenizer cannot read, and each unit's batches
    and tally. The first model's run fills it; the later ones stream the same batches. It holds
    the batches' token ids (a few bytes a token), never a capture."""

    def __init__(self) -> None:
        self.readable: tuple | None = None  # _readable's answer
        self.units: dict[str, tuple[list, dict]] = {}  # unit name -> (its batches, its tally)


def execute(plan: Plan, ranks, progress: Progress | None, status: Callable[[str], None]):
    """Load the model, stream every unit through it, and merge the processes' states.

    Returns
    -------
    Outcome or None
        On rank 0, the merged states; on the other processes, None.
    """
    clock = Clock()  # "start": importing torch and transformers, joining the processes
    from probe.distributed import joined
    from probe.pipeline.loading import resolve_device

    device = resolve_device(plan.settings.device, ranks.local_rank)
    with joined(ranks, device):
        clock.lap("start")
        model, tokenizer = load_model(plan, device, ranks, status)
        return analyse(plan, model, tokenizer, ranks, progress, status, clock)


def load_model(plan: Plan, device, ranks, status: Callable[[str], None],
               check: Callable | None = None):  # fmt: skip
    """The run's model and tokenizer, loaded on ``device`` (seeded by the run's seed), the
    tokenizer checked against what the analyses' inputs need before the weights load, and by
    ``check(tokenizer, config)`` where given."""
    import torch

    from probe.pipeline.loading import load

    settings = plan.settings
    status(f"loading {settings.model}")
    torch.manual_seed(settings.seed)
    return load(
        settings.model,
        device=device,
        dtype=settings.dtype,
        revision=settings.revision,
        trust_remote_code=settings.trust_remote_code,
        lm_head=settings.lm_head,
        before_weights=partial(_check_tokenizer, plan, check),
        **_placement(settings, ranks),
    )


def analyse(plan: Plan, model, tokenizer, ranks, progress: Progress | None,
            status: Callable[[str], None], clock: Clock, inputs: Inputs | None = None):  # fmt: skip
    """Stream every unit through a loaded model and merge the processes' states: ``execute``
    after loading. With ``inputs``, the units' batches are read and tokenized once, by the
    first model given them, and streamed again through the others.

    Returns
    -------
    Outcome or None
        On rank 0, the merged states; on the other processes, None.
    """
    from probe.distributed import Tally, merge_to_leader

    if inputs is not None and inputs.readable is not None:
        plan, skipped, unknown = inputs.readable
    else:
        plan, skipped, unknown = _readable(plan, tokenizer)
        if inputs is not None:
            inputs.readable = plan, skipped, unknown
    chosen, examples = _begin(plan, model, tokenizer)
    _freeze()
    clock.lap("load")
    tally = Tally()
    for name in plan.units:
        readers = [a for a in chosen if name in plan.reads[a.name]]
        tally[name] = _stream_unit(plan, name, readers, examples, model, tokenizer, ranks,
                                   progress, status, inputs)  # fmt: skip
    clock.lap("analyses")
    if ranks.size > 1:
        status(f"merging the analyses of {ranks.size} processes")
    merged = merge_to_leader([*chosen, tally, *([examples] if examples else [])], ranks)
    if ranks.size > 1:
        clock.lap("merge")
    if merged is None:
        return None
    _check_input(plan, tally)
    card = make_card(plan, model, tokenizer, chosen, ranks, tally)
    card.timings_s = clock.timings
    card.unknown_words, card.skipped = unknown, skipped
    card.warnings = _unreadable_warnings(unknown, skipped, tokenizer)
    return Outcome(chosen, examples, card, card.layers, card.heads)


def _readable(plan: Plan, tokenizer) -> tuple[Plan, dict[str, str], dict[str, dict]]:
    """The run without what its tokenizer cannot read: the share of the treebank's and the
    corpus's words that become the unknown token (``probe.inputs.unknown``), and, where that is
    more than ``MOSTLY_UNKNOWN``, the run without the units of that input: an analysis that
    read nothing else is skipped (with why), unless it makes inputs of its own
    (``runs_without_units``: the claims' repeated sequences); one that reads another unit too
    goes on without it.

    Raises
    ------
    ProbeError
        Where no analysis is left.
    """
    from dataclasses import replace
    from itertools import islice

    from probe.inputs import unknown as unknowns

    inputs = {units.get_input(u) for u in plan.units}
    measured = {}
    if "treebank" in inputs:
        from probe.inputs.treebank import iter_treebank

        sentences = islice(iter_treebank(plan.source.treebank), plan.source.max_sentences)
        measured["treebank"] = unknowns.unknown_words(tokenizer, unknowns.treebank_words(sentences))
    if "corpus" in inputs:
        from probe.inputs.texts import texts

        rows = texts(plan.source.corpus, plan.source.max_texts)
        measured["corpus"] = unknowns.unknown_words(tokenizer, unknowns.corpus_words(rows))
    unreadable = {name for name, m in measured.items() if m["share"] > unknowns.MOSTLY_UNKNOWN}
    if not unreadable:
        return plan, {}, measured
    dropped = {u for u in plan.units if units.get_input(u) in unreadable}
    reads = {name: tuple(u for u in read if u not in dropped) for name, read in plan.reads.items()}
    skipped = {}
    for cls in plan.classes:
        lost = [units.get_input(u) for u in plan.reads[cls.name] if u in dropped]
        if lost and not reads[cls.name] and not cls.runs_without_units:
            m = measured[lost[0]]
            skipped[cls.name] = (f"{m['share']:.0%} of the {lost[0]}'s words (of the first "
                                 f"{m['words']}) are the tokenizer's unknown token")  # fmt: skip
    classes = tuple(cls for cls in plan.classes if cls.name not in skipped)
    if not classes:
        what = " and ".join(sorted(unreadable))
        m = measured[min(unreadable)]
        raise ProbeError(f"{m['share']:.0%} of the {min(unreadable)}'s words (of the first "
                         f"{m['words']}) become the tokenizer's unknown token, and every analysis "
                         f"of this run reads the {what}; give a {what} in the model's language, "
                         "or analyses of the weights or of repeated sequences")  # fmt: skip
    reads = {cls.name: reads[cls.name] for cls in classes}
    needed = tuple(u for u in plan.units if u not in dropped)
    return replace(plan, classes=classes, reads=reads, units=needed), skipped, measured


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


def _begin(plan: Plan, model, tokenizer) -> tuple[list[analyses.Analysis], Any]:
    """The analyses that can run on ``model``, created; and the head cards' example sentences,
    when a unit that gives them is streamed for an analysis of patterns."""
    from probe.app.examples import Examples
    from probe.capture.spec import describe

    classes = _applicable(plan, model)
    spec = describe(model)
    n_layers, n_heads = spec.n_layers, spec.n_heads
    chosen = []
    for cls in classes:
        context = analyses.Context(
            n_layers, n_heads, spec.causal, plan.settings.seed, plan.thresholds, model,
            plan.options_of(cls.options), tokenizer.mask_token_id, tokenizer,
        )  # fmt: skip
        chosen.append(cls(context))
    examples = None
    cards = [a for a in chosen if "hook_pattern" in a.captures]
    if any(units.get(u).examples for a in cards for u in plan.reads[a.name]):
        examples = Examples(tokenizer, n_layers, n_heads)
    return chosen, examples


def _freeze() -> None:
    """When the command line paused the collector for the start-up: imports and the model made
    about a million objects that live as long as the run, which it need not walk again."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def _stream_unit(plan: Plan, name: str, readers, examples, model, tokenizer, ranks, progress,
                 status, inputs: Inputs | None = None) -> dict:  # fmt: skip
    """Stream unit ``name`` through ``model`` for the analyses that read it; its tally. With
    ``inputs``, its batches are those read before, or are kept for the next model."""
    from probe.capture.spec import describe
    from probe.inputs.corpus import max_tokens
    from probe.pipeline.runner import stream, stream_rows

    if not readers:  # none of its analyses applies to this model
        return {}
    cls = units.get(name)
    status(f"analysing {cls.label}")
    kept = inputs.units.get(name) if inputs is not None else None
    if kept is not None:
        batches, size, unit = iter(kept[0]), sum(map(_moves, kept[0])), None
    else:
        needed = [a.reads for a in readers]
        unit = cls(plan.source, tokenizer, max_tokens(model.config, tokenizer), shard=ranks.shard,
                   options=plan.options_of(cls.options),
                   stop=None if None in needed else max(needed))  # fmt: skip
        batches, size = _tagged(unit.batches(plan.settings.batch_size), name), unit.size()
        if inputs is not None:
            batches = _kept(batches, inputs.units.setdefault(name, ([], {}))[0])
    if progress is not None:
        batches = progress(f"analysing {cls.counted or cls.label}", size)(batches)
    consumers = [*readers, *([examples] if examples and cls.examples else [])]
    wanted = sorted({c for a in readers for c in a.captures})
    # Patterns in blocks of rows, beside the model's sdpa kernel, when every consumer that reads
    # captures takes them (importance reads none: only the batches)
    rows = all(getattr(c, "rows", False) or getattr(c, "captures", None) == () for c in consumers)
    if set(wanted) == {"hook_pattern"} and rows and describe(model).rows_unsupported is None:
        stream_rows(
            model.base_model, batches, consumers, parse_size(plan.settings.attention_budget)
        )
    else:
        stream(model.base_model, batches, consumers, wanted)  # no language-model head needed
    if unit is None:
        return dict(kept[1])
    tally = unit.tally()
    if inputs is not None:
        inputs.units[name][1].update(tally)
    return tally


def _moves(batch) -> int:
    """How far a batch moves its unit's progress bar."""
    return batch.progress if batch.progress is not None else len(batch)


def _kept(batches: Iterable, into: list) -> Iterator:
    """``batches``, each kept in ``into`` as it goes by."""
    for batch in batches:
        into.append(batch)
        yield batch


def _tagged(batches: Iterable, name: str) -> Iterator:
    """``batches``, each marked with the unit that made it (an analysis may read several)."""
    for batch in batches:
        batch.unit = name
        yield batch


def _check_input(plan: Plan, tally: dict) -> None:
    """A treebank that gave the sentence unit nothing to read, or nothing it could analyse."""
    sentences = tally.get("sentence")  # {} where no analysis of sentences applied
    if sentences and not sentences["read"]:
        raise ProbeError(f"no sentences in {', '.join(map(str, plan.source.treebank))}")
    if sentences and not sentences["analysed"]:
        reasons = ", ".join(f"{n} {why}" for why, n in sentences["skipped"].items())
        raise ProbeError(f"no sentence can be analysed ({reasons}); try another treebank")
    text = tally.get("text")  # {} where no analysis of a corpus applied
    if text and not text["windows"]:
        raise ProbeError(f"no text of corpus {plan.source.corpus.name} has a token")


def _applicable(plan: Plan, model) -> list:
    """The analyses that can run on ``model``: chosen by default, the others are left out;
    named by the user, any that cannot run is an error (one that follows another is left out)."""
    reasons = {cls.name: cls.unsupported(model) for cls in plan.classes}
    if not plan.by_default:
        for name, reason in reasons.items():
            if reason and name in plan.settings.analyses:
                raise ProbeError(f"--analyses {name}: {reason}")
    return [cls for cls in plan.classes if not reasons[cls.name]]


def _check_tokenizer(plan: Plan, check: Callable | None, tokenizer, config) -> None:
    """What each analysis's inputs need of the tokenizer (and ``check``, where given), checked
    before the weights load."""
    if check is not None:
        check(tokenizer, config)
    for cls in plan.classes:
        cls.check_tokenizer(tokenizer, config, plan.options_of(cls.options))


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
