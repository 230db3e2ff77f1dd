"""The circuit analysis's task: prompt pairs, clean and corrupted, with a metric of the model's
output: the ``repeats`` task made from random tokens, or a ``.jsonl`` file of pairs, read and
checked when the run is planned (``TaskOption``) and turned into model inputs when the analysis
finishes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from probe.errors import ProbeError
from probe.lazy import lazy
from probe.options import Option

torch = lazy("torch")

REPEATS = "repeats"
ALL = slice(None)  # a metric's pairs where it is given every pair at once
FIELDS = ("clean", "corrupted", "answer")  # each line's required fields; ``wrong`` is optional


@dataclass(frozen=True)
class Pair:
    """One line of a task file."""

    line: int
    clean: str
    corrupted: str
    answer: str
    wrong: str | None


def read_task(path: Path) -> list[Pair]:
    """The pairs of a ``.jsonl`` task file, checked.

    Raises
    ------
    ProbeError
        One line naming the file, the line and the field: a file that cannot be read, a line
        that is not a JSON object, a field missing or not a string, ``wrong`` on some lines
        but not others, or no pairs.
    """
    if not path.is_file():  # a folder, or a pipe that would hang the run waiting for a writer
        what = "no such file" if not path.exists() else "not a regular file"
        raise ProbeError(f"--task {path}: {what}; give repeats or a .jsonl file of pairs")
    pairs = []
    try:
        # Lines end at \n (JSON strings may hold U+2028, which str.splitlines would split at);
        # a byte-order mark is taken as UTF-8's.
        with path.open(encoding="utf-8-sig") as lines:
            for number, line in enumerate(lines, start=1):
                if line.strip():
                    pairs.append(_pair(path, number, line))
    except (OSError, UnicodeDecodeError) as e:
        raise ProbeError(f"--task {path}: cannot read it ({e}); give repeats or a .jsonl file "
                         "of pairs") from None  # fmt: skip
    if not pairs:
        raise ProbeError(f"{path}: no pairs; give one JSON object a line")
    with_wrong = [p.wrong is not None for p in pairs]
    if any(with_wrong) and not all(with_wrong):
        odd = pairs[with_wrong.index(not with_wrong[0])]
        raise ProbeError(f"{path} line {odd.line}: field 'wrong' is given on some lines and not "
                         "others; give it on every line (a logit difference) or none (the "
                         "answer's log-probability)")  # fmt: skip
    return pairs


def _pair(path: Path, number: int, line: str) -> Pair:
    """One line of a task file, checked (``read_task``)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ProbeError(f"{path} line {number}: not JSON ({e.msg})") from None
    except (RecursionError, ValueError) as e:  # nesting too deep, a number too long
        raise ProbeError(f"{path} line {number}: not JSON that can be read ({e})") from None
    if not isinstance(row, dict):
        raise ProbeError(f"{path} line {number}: not a JSON object with fields "
                         f"{', '.join(FIELDS)}")  # fmt: skip
    for field in (*FIELDS, "wrong"):
        if field not in row:
            if field == "wrong":
                continue
            raise ProbeError(f"{path} line {number}: no field {field!r}; each line needs "
                             "clean, corrupted and answer (wrong is optional)")  # fmt: skip
        if not isinstance(row[field], str) or not row[field]:
            raise ProbeError(f"{path} line {number}: field {field!r} must be a non-empty "
                             "string")  # fmt: skip
    return Pair(number, row["clean"], row["corrupted"], row["answer"], row.get("wrong"))


@dataclass(frozen=True)
class TaskOption(Option):
    """``--task``: ``repeats`` or a task file, which is read and checked when the run is planned,
    before the model loads."""

    def check(self, value: Any) -> Any:
        value = super().check(value)
        if value != REPEATS:
            read_task(Path(value))
        return value


def task_name(task: str) -> str:
    """The task in words: the repeats task (random tokens made for it) or a task file's."""
    if task == REPEATS:
        return "repeats task (random tokens, then the same again)"
    return f"task {Path(task).name}"


def repeats_unit(tokenizer, seed: int, pairs: int, n: int, limit: int):
    """The repeated sequences the repeats task draws its pairs from
    (``probe.inputs.units.repeats``), a length beyond the model's refused naming
    ``--circuit-length``, the option that set it."""
    from probe.inputs.units import Source
    from probe.inputs.units.repeats import RepeatedSequences

    try:
        options = {"repeat_length": n, "repeat_sequences": pairs}
        return RepeatedSequences(Source(seed=seed), tokenizer, limit, options=options)
    except ProbeError as e:
        raise ProbeError(str(e).replace("--repeat-length", "--circuit-length")) from None


def repeats_task(tokenizer, seed: int, pairs: int, n: int, limit: int):
    """The repeats task's inputs ``{"input_ids": [pairs, T]}``, clean and corrupted, and its
    metric: clean is the specials before, A, A and the specials after; corrupted has A' (fresh
    tokens) in place of the first A. Drawn as ``probe.inputs.units.repeats`` draws its sequences
    (pair i: the repeat and null of sequence i, keyed to the seed)."""
    unit = repeats_unit(tokenizer, seed, pairs, n, limit)
    s = len(unit.first)
    clean, corrupted = [], []
    for i in range(pairs):
        repeat, null = unit.pair(i)
        first, fresh = repeat[s : s + n], null[s + n : s + 2 * n]
        clean.append(repeat)
        corrupted.append([*unit.first, *fresh, *first, *unit.last])
    ids = torch.tensor(clean)
    other = torch.tensor(corrupted)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    corrupted_inputs = {"input_ids": other, "attention_mask": torch.ones_like(other)}
    # Positions s+n … s+2n−2 predict the second copy's tokens s+n+1 … s+2n−1.
    targets = ids[:, s + n + 1 : s + 2 * n]

    def metric(logits: torch.Tensor, pairs: slice = ALL) -> torch.Tensor:  # the logits' pairs
        logp = torch.log_softmax(logits[:, s + n : s + 2 * n - 1].float(), dim=-1)
        return logp.gather(-1, targets[pairs].to(logp.device)[..., None])[..., 0].mean(-1)

    return inputs, corrupted_inputs, metric


def file_task(path: Path, tokenizer, pairs: int, limit: int):
    """A task file's first ``pairs`` pairs as model inputs, right-padded alike, their metric
    at each pair's last real position, and what the metric measures.

    Raises
    ------
    ProbeError
        Naming the file and line: a pair whose texts differ in length in tokens, an answer or
        wrong token that is not one token, or a text longer than the model reads.
    """
    rows = read_task(path)[:pairs]
    clean, corrupted, answers, wrongs = [], [], [], []
    for p in rows:
        a, b = (tokenizer(text).input_ids for text in (p.clean, p.corrupted))
        if len(a) != len(b):
            raise ProbeError(f"{path} line {p.line}: clean is {len(a)} tokens and corrupted "
                             f"{len(b)}; a pair's texts need as many tokens")  # fmt: skip
        if len(a) > limit:
            raise ProbeError(f"{path} line {p.line}: {len(a)} tokens, more than the model's "
                             f"{limit}")  # fmt: skip
        clean.append(a)
        corrupted.append(b)
        for field, store in (("answer", answers), ("wrong", wrongs)):
            word = getattr(p, field)
            if word is None:
                continue
            ids = tokenizer(word, add_special_tokens=False).input_ids
            if len(ids) != 1:
                raise ProbeError(f"{path} line {p.line}: {field} {word!r} is {len(ids)} tokens; "
                                 "give one token (with its leading space where the tokenizer "
                                 "marks one)")  # fmt: skip
            store.append(ids[0])
    width = max(len(a) for a in clean)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    lengths = torch.tensor([len(a) for a in clean])
    mask = (torch.arange(width)[None] < lengths[:, None]).long()

    def padded(rows_: list[list[int]]) -> torch.Tensor:
        return torch.tensor([r + [pad] * (width - len(r)) for r in rows_])

    last = lengths - 1
    answer = torch.tensor(answers)
    wrong = torch.tensor(wrongs) if wrongs else None

    def metric(all_logits: torch.Tensor, pairs: slice = ALL) -> torch.Tensor:  # their pairs
        at = last[pairs].to(all_logits.device)
        logits = all_logits[torch.arange(len(at), device=at.device), at].float()
        picked = logits.gather(-1, answer[pairs].to(logits.device)[:, None])[:, 0]
        if wrong is None:
            return picked - logits.logsumexp(-1)
        return picked - logits.gather(-1, wrong[pairs].to(logits.device)[:, None])[:, 0]

    kind = "logit difference answer − wrong" if wrong is not None else "log-probability of answer"
    return (
        {"input_ids": padded(clean), "attention_mask": mask},
        {"input_ids": padded(corrupted), "attention_mask": mask.clone()},
        metric,
        kind + " at the last position",
    )
