"""``probe timeline``'s plan and integrity: which checkpoints a source holds and at which steps,
a hash of each checkpoint's weights (two identical ones are flagged), and which steps of an
interrupted run are done. Its tables and sentences are ``probe.app.timeline_tables``'.

A source is a folder of a trainer's checkpoints (``checkpoint-N/``, ``step-N/`` or ``stepN/``
subfolders, the step N read from the name) or a hub model with revisions (``step1000,step2000``,
or a range pattern ``step{0..143000..1000}``). Everything here but ``weights_hash`` runs at
plan time, before torch or pandas is imported.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from probe.errors import ProbeError

if TYPE_CHECKING:
    import torch

# A checkpoint folder's name: the prefix says it is one, the number is its step.
FOLDER = re.compile(r"(checkpoint|step)[-_]?(\d+)")
LOOKS_LIKE_ONE = re.compile(r"(checkpoint|step)", re.IGNORECASE)
# A revision's step, anywhere in its name (Pythia's ``step1000``, OLMo's ``stage1-step1000-…``).
IN_REVISION = re.compile(r"(?:checkpoint|step)[-_]?(\d+)")
# ``prefix{start..stop..every}suffix``, bash's brace range: stop included, ``..every`` optional.
RANGE = re.compile(r"([^{}]*)\{(\d+)\.\.(\d+)(?:\.\.(\d+))?\}([^{}]*)")
MAX_REVISIONS = 10_000  # a pattern that expands to more is a typo, not a timeline
# A step's report folder is complete once analyze's publish stage has renamed it into place
# with these (it writes every file into a temporary folder first).
COMPLETE = ("run.json", "heads.csv")
# What makes two runs the same run, as ``run.json`` records it: a step done under other
# analyses, options or inputs is no step of this run.
SAME_RUN = ("analyses", "options", "thresholds", "lm_head", "seed", "treebank", "corpus",
            "context", "dtype")  # fmt: skip


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint of a timeline.

    step : the training step, read from its name
    name : the folder's name or the revision
    source : the folder's path, or the hub model's name
    revision : the hub revision; None for a folder
    """

    step: int
    name: str
    source: str
    revision: str | None = None

    @property
    def folder(self) -> str:
        """Its report folder under the timeline's folder: ``steps/step-N``."""
        return f"steps/step-{self.step}"


def step_of(name: str) -> int | None:
    """The step a checkpoint folder's name gives (``checkpoint-300``, ``step-300``,
    ``step300``: 300); None where the name is no checkpoint's."""
    match = FOLDER.fullmatch(name)
    return int(match.group(2)) if match else None


def revision_step(revision: str) -> int:
    """The step a hub revision names (``step1000``, ``stage1-step1000-tokens4B``)."""
    match = IN_REVISION.search(revision)
    if match is None:
        raise ProbeError(
            f"revision {revision!r} names no step: give revisions such as step1000 or "
            "checkpoint-1000, whose step orders the timeline"
        )
    return int(match.group(1))


def expand_revisions(text: str) -> list[str]:
    """The revisions ``--revisions`` names: a comma-separated list, each item a revision or a
    range pattern ``prefix{start..stop..every}suffix`` (stop included; every 1 if left out).

    ``"step{0..3000..1000},main"`` → ``["step0", "step1000", "step2000", "step3000", "main"]``
    """
    revisions = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            raise ProbeError(
                f"--revisions {text!r} has an empty item: separate revisions by one comma"
            )
        if "{" not in item and "}" not in item:
            revisions.append(item)
            continue
        match = RANGE.fullmatch(item)
        if match is None:
            raise ProbeError(
                f"--revisions: cannot read the pattern {item!r}: write one range as "
                "prefix{start..stop..every}suffix, e.g. step{0..143000..1000}"
            )
        prefix, start, stop, every, suffix = match.groups()
        start, stop, every = int(start), int(stop), int(every or 1)
        if every == 0 or stop < start:
            raise ProbeError(
                f"--revisions: the pattern {item!r} names no step: it needs start ≤ stop and "
                "a step of at least 1"
            )
        if (stop - start) // every + 1 > MAX_REVISIONS:
            raise ProbeError(
                f"--revisions: the pattern {item!r} names {(stop - start) // every + 1} "
                f"revisions, more than {MAX_REVISIONS}: is its step right?"
            )
        revisions += [f"{prefix}{n}{suffix}" for n in range(start, stop + 1, every)]
    return revisions


def folder_checkpoints(folder: Path) -> list[Checkpoint]:
    """The checkpoints in ``folder``, by step: its subfolders named ``checkpoint-N``,
    ``step-N`` or ``stepN``. Files and other subfolders (a trainer's ``runs/``) are left out;
    a subfolder named like a checkpoint whose step cannot be read is an error, so that no
    checkpoint is silently left out of the timeline."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ProbeError(f"{folder} is no folder: give a folder of checkpoint-N/ subfolders")
    found: dict[int, str] = {}
    for child in sorted(folder.iterdir()):
        if not child.is_dir():
            continue
        step = step_of(child.name)
        if step is None:
            if LOOKS_LIKE_ONE.match(child.name):
                raise ProbeError(
                    f"cannot read a step from the checkpoint folder {child.name!r} in {folder}: "
                    "name it checkpoint-N, step-N or stepN, N its training step"
                )
            continue
        if step in found:
            raise ProbeError(
                f"{folder} holds two checkpoints of step {step}: {found[step]} and "
                f"{child.name}; keep one"
            )
        found[step] = child.name
    if not found:
        single = (folder / "config.json").is_file()
        raise ProbeError(
            f"no checkpoints in {folder}: it needs checkpoint-N/, step-N/ or stepN/ subfolders"
            + (" (it is one model: probe analyze reads it)" if single else "")
        )
    return [Checkpoint(step, found[step], str(folder / found[step])) for step in sorted(found)]


def checkpoints(source: str, revisions: str | None = None) -> list[Checkpoint]:
    """The checkpoints of a timeline, by step: a local folder's checkpoint subfolders, or a hub
    model's ``revisions`` (``--revisions``' text), given in the order of their steps.

    A local folder with revisions, a hub model without them, two revisions of one step and
    revisions out of the order of their steps are each an error in one line.
    """
    local = Path(source).expanduser()
    if local.exists():
        if revisions is not None:
            raise ProbeError(
                f"--revisions is for a hub model, and {source} is a local folder: its "
                "checkpoints are its checkpoint-N/ subfolders; drop --revisions"
            )
        return folder_checkpoints(local)
    if revisions is None:
        raise ProbeError(
            f"{source} is no local folder: give a folder of checkpoint-N/ subfolders, or a hub "
            "model with --revisions (e.g. step{0..143000..1000})"
        )
    names = expand_revisions(revisions)
    steps = [revision_step(name) for name in names]
    for (before, step_a), (name, step_b) in zip(
        zip(names, steps, strict=True), zip(names[1:], steps[1:], strict=True), strict=False
    ):
        if step_b == step_a:
            raise ProbeError(f"--revisions: {before} and {name} are both step {step_a}; keep one")
        if step_b < step_a:
            raise ProbeError(
                f"--revisions: steps out of order, {before} (step {step_a}) before {name} "
                f"(step {step_b}): give them from the first step to the last"
            )
    return [Checkpoint(step, name, source, name) for name, step in zip(names, steps, strict=True)]


def weights_hash(model: torch.nn.Module) -> str:
    """A SHA-256 of a model's weights, the same in every process and on every device: over its
    state dict's entries sorted by name, each entry's name, dtype, shape and bytes.

    Two checkpoints with the same hash hold the same weights (a branch that serves the final
    weights under an earlier step's name). Parameters and buffers both count, so that a buffer
    the checkpoint sets (GPT-2's causal mask is none: transformers no longer saves it) cannot
    hide a difference. Reads one tensor at a time to the CPU: the memory it adds is one tensor's.
    """
    import torch

    digest = hashlib.sha256()
    state = model.state_dict()
    for name in sorted(state):
        tensor = state[name].detach()
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        if tensor.device.type == "meta":  # offloaded and not held: its name and shape only
            continue
        # The bytes as they are, whatever the dtype (numpy has no bfloat16): viewed as uint8.
        flat = tensor.to("cpu").contiguous().reshape(-1)
        digest.update(flat.view(dtype=torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def duplicate_weights(hashes: dict[int, str]) -> list[str]:
    """One warning line per group of steps whose weights are identical (the same
    ``weights_hash``), in the order of their first step; none where every checkpoint differs.

    ``{300: "ab…", 400: "ab…"}`` → ``["steps 300 and 400 have identical weights (sha256
    ab…): a checkpoint saved again under another step's name, or a revision that serves other
    weights"]``
    """
    groups: dict[str, list[int]] = {}
    for step in sorted(hashes):
        groups.setdefault(hashes[step], []).append(step)
    lines = []
    for digest, steps in groups.items():
        if len(steps) > 1:
            names = ", ".join(map(str, steps[:-1])) + f" and {steps[-1]}"
            lines.append(
                f"steps {names} have identical weights (sha256 {digest[:12]}): a checkpoint "
                "saved again under another step's name, or a revision that serves other weights"
            )
    return lines


def tokenizer_fingerprint(tokenizer) -> str:
    """A SHA-256 of what a tokenizer does: a fast tokenizer's whole definition (vocabulary,
    merges, normaliser, pre-tokeniser, post-processor; its truncation and padding settings left
    out, which change no token), else its vocabulary; and its special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        spec.pop("truncation", None), spec.pop("padding", None)
        text = json.dumps(spec, sort_keys=True)
    else:
        text = json.dumps(sorted(tokenizer.get_vocab().items()))
    special = json.dumps(sorted(map(str, tokenizer.all_special_tokens)))
    return hashlib.sha256(f"{text}\0{special}".encode()).hexdigest()


def check_tokenizer(first: Checkpoint, first_print: str, checkpoint: Checkpoint, print_: str):
    """One line, before ``checkpoint``'s model is loaded, where its tokenizer (fingerprint
    ``print_``) is not the first checkpoint's: the run's inputs were tokenized once, by it."""
    if print_ != first_print:
        raise ProbeError(
            f"the tokenizer of {checkpoint.name} (step {checkpoint.step}) differs from that of "
            f"{first.name} (step {first.step}): a timeline reads one tokenization of its inputs; "
            "give checkpoints of one model"
        )


def load_failed(checkpoint: Checkpoint, error: BaseException, out: Path) -> ProbeError:
    """The one line for a checkpoint that fails to load; the steps before it stay in ``out``."""
    why = (str(error).strip().splitlines() or [type(error).__name__])[0]
    where = checkpoint.source + (
        f" at revision {checkpoint.revision}" if checkpoint.revision else ""
    )
    return ProbeError(
        f"cannot load {checkpoint.name} (step {checkpoint.step}, {where}): {why}; the steps "
        f"before it are kept in {Path(out) / 'steps'}: fix it, then run again with --resume"
    )


def step_complete(folder: Path) -> bool:
    """Whether a step's report folder is complete: ``analyze`` renames it into place whole,
    with ``run.json`` and ``heads.csv`` in it."""
    return all((Path(folder) / name).is_file() for name in COMPLETE)


def steps_to_run(
    out: Path, planned: list[Checkpoint], settings: dict, resume: bool
) -> list[Checkpoint]:
    """The checkpoints a run must still analyse: all of them, or with ``resume`` those whose
    report folder under ``out`` is not complete.

    Parameters
    ----------
    out : the timeline's folder
    planned : every checkpoint of the run, by step
    settings : this run's values of ``SAME_RUN`` (as its steps' ``run.json`` will record them)
    resume : whether ``--resume`` was given

    A complete step of another run (another model or revision, other analyses, options or
    inputs, or a step this run does not plan) is an error in one line: its folder is left as
    it is.
    """
    if not resume:
        return list(planned)
    out, by_folder = Path(out), {c.folder: c for c in planned}
    steps = out / "steps"
    if out.exists() and not steps.is_dir() and any(out.iterdir()):
        raise ProbeError(
            f"--resume: {out} is no timeline's folder (it has no steps/): give the folder of "
            "the run to resume, or a new one without --resume"
        )
    done = set()
    for folder in sorted(steps.iterdir()) if steps.is_dir() else []:
        if not step_complete(folder):
            continue  # cut short: analysed again
        key = f"steps/{folder.name}"
        checkpoint = by_folder.get(key)
        if checkpoint is None:
            raise ProbeError(
                f"--resume: {out} holds {key}, a step this run does not plan: it is the folder "
                "of another run; give a new folder, or the run's own source"
            )
        try:
            recorded = json.loads((folder / "run.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise ProbeError(f"--resume: cannot read {folder / 'run.json'}: {error}") from None
        differs = _differs(recorded, checkpoint, settings)
        if differs:
            raise ProbeError(
                f"--resume: {key} in {out} is of another run (its {differs} differs from this "
                "run's): give a new folder, or the options of the run being resumed"
            )
        done.add(checkpoint.step)
    return [c for c in planned if c.step not in done]


def _differs(recorded: dict, checkpoint: Checkpoint, settings: dict) -> str | None:
    """The first thing a step's ``run.json`` records differently from this run: its model,
    revision, or one of ``SAME_RUN``; None where it records the same."""
    if _same_source(recorded.get("model"), checkpoint.source) is False:
        return f"model ({recorded.get('model')}, not {checkpoint.source})"
    if recorded.get("revision") != checkpoint.revision:
        return f"revision ({recorded.get('revision')}, not {checkpoint.revision})"
    for key in SAME_RUN:
        if key in settings and recorded.get(key) != settings[key]:
            return key
    return None


def _same_source(recorded: str | None, source: str) -> bool:
    """A local path is compared resolved (a run resumed from another folder names it
    otherwise); a hub name as it is."""
    if recorded is None:
        return False
    if Path(recorded).exists() or Path(source).exists():
        return Path(recorded).resolve() == Path(source).resolve()
    return recorded == source


def recorded_hashes(out: Path, planned: list[Checkpoint]) -> dict[int, str]:
    """The weights hashes the complete steps' ``run.json`` record (``weights_sha256``), by
    step: a resumed run's hashes of the steps it does not load again."""
    hashes = {}
    for c in planned:
        folder = Path(out) / c.folder
        if step_complete(folder):
            recorded = json.loads((folder / "run.json").read_text(encoding="utf-8"))
            if recorded.get("weights_sha256"):
                hashes[c.step] = recorded["weights_sha256"]
    return hashes


def checkpoint_records(planned: list[Checkpoint], hashes: dict[int, str]) -> list[dict]:
    """``run.json``'s ``checkpoints``: each one's step, name, source, revision and weights
    hash (None for a step not loaded in this run)."""
    return [
        {"step": c.step, "name": c.name, "source": c.source, "revision": c.revision,
         "weights_sha256": hashes.get(c.step)}
        for c in planned
    ]  # fmt: skip
