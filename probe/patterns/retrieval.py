"""Retrieval heads (Wu et al. 2024, "Retrieval Head Mechanistically Explains Long-Context
Factuality"), found with a needle in a haystack.

A trial is one teacher-forced input: a haystack of L tokens of ordinary text, a needle sentence
inserted at a depth (0 = the haystack's start, 1 = its end), then a question and the needle's
answer copied after it. For each answer token, the query that predicts it (the position before)
is read; the head *retrieves* it when its top-1 attended key lies inside the needle and holds
that same token. A head's score on a trial is the share of answer tokens it retrieves:

    score(h, trial) = #{answer tokens t : argmax_j A_h[t - 1, j] ∈ needle, ids[j] = ids[t]}
                      / #answer tokens

The null trial leaves the needle out: a hit is then the same token anywhere in the haystack, so
a head that merely attends to matching tokens scores there too. Only the answer's query rows are
computed (``probe.capture.rows``): a trial of 8k tokens costs a forward pass and a few rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import suppress
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from probe.capture.rows import RowBlock, Scored, scored
from probe.capture.spec import describe

DEPTHS = tuple(i / 10 for i in range(11))  # 0 %, 10 %, … 100 %
NEEDLE = " The special magic number is{answer}"
QUESTION = " What is the special magic number? The special magic number is"
ANSWER = " {number}."


@dataclass(frozen=True)
class Trial:
    """One teacher-forced input and where its parts are.

    ``source``: the positions a hit may come from (the needle; the haystack, for a null);
    ``answer``: the positions of the answer's tokens (each predicted from the position before).
    """

    ids: tuple[int, ...]
    source: range
    answer: range
    length: int  # tokens of haystack
    depth: float
    needle: bool  # False: the null, the needle left out


def hits(block: RowBlock, ids: torch.Tensor, trial: Trial) -> torch.Tensor:
    """Answer tokens each head retrieves within one block of query rows: ``[head]``.

    Parameters
    ----------
    block : RowBlock
        Rows of one layer's pattern of this trial (batch of 1), any rows: those that predict no
        answer token are ignored.
    ids : ``[pos]`` long
        The trial's tokens, on the block's device.
    """
    p = block.pattern[0]  # [H, rows, keys]
    query = torch.arange(block.rows.start, block.rows.stop, device=p.device)
    wanted = (query + 1 >= trial.answer.start) & (query + 1 < trial.answer.stop)
    if not wanted.any():
        return p.new_zeros(p.shape[0])
    query = query[wanted]
    top = p[:, wanted].argmax(-1) + block.keys.start  # [H, queries]: each top-1 key
    inside = (top >= trial.source.start) & (top < trial.source.stop)
    same = ids[top] == ids[query + 1][None]
    return (inside & same).sum(-1).to(p.dtype)


def scores(model: nn.Module, trials: Iterable[Trial]) -> Iterator[np.ndarray]:
    """Each trial's score of every head, ``[layer, head]``, in order: one forward pass per trial
    on the model's sdpa kernel, and only the answer's query rows of each layer's pattern."""
    device = next(model.parameters()).device
    L = describe(model).n_layers
    for trial in trials:
        ids = torch.tensor(trial.ids, device=device)
        rows = slice(trial.answer.start - 1, trial.answer.stop - 1)
        found: dict[int, torch.Tensor] = {}

        def receive(layer: int, what: Scored, rows=rows, ids=ids, trial=trial, found=found):
            found[layer] = hits(what.block(rows), ids, trial)
            if layer == L - 1:
                raise _Done

        with torch.inference_mode(), scored(model, receive), suppress(_Done):
            model(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None])
        counted = torch.stack([found[layer] for layer in range(L)])
        yield (counted / len(trial.answer)).double().cpu().numpy()


class _Done(Exception):  # noqa: N818 (a signal: the last layer's rows are in)
    pass


def haystack(tokenizer, texts: Iterable[str], tokens: int) -> list[int]:
    """The first ``tokens`` tokens of ``texts`` joined by spaces (fewer if they run out):
    any iterable of strings, such as a treebank's sentences or a corpus's documents."""
    out: list[int] = []
    for text in texts:
        out += tokenizer(" " + text, add_special_tokens=False)["input_ids"]
        if len(out) >= tokens:
            break
    return out[:tokens]


def needle_trials(
    tokenizer,
    hay: Sequence[int],
    lengths: Sequence[int],
    depths: Sequence[float] = DEPTHS,
    seed: int = 0,
) -> list[Trial]:
    """For each length and depth a trial and its null, with a number drawn from ``seed``,
    the length and the depth: the same trials in every run and process.

    The needle is put at the token boundary ``round(depth · L)`` of the haystack's first L
    tokens; a BOS (or [CLS]) starts the input where the tokenizer has one.
    """
    from probe.inputs.units.repeats import specials

    first, _ = specials(tokenizer)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    question = encode(QUESTION)
    trials = []
    for length in lengths:
        part = list(hay[:length])
        for k, depth in enumerate(depths):
            rng = np.random.default_rng([seed, length, k])
            answer_text = ANSWER.format(number=int(rng.integers(10_000, 100_000)))
            needle, answer = encode(NEEDLE.format(answer=answer_text)), encode(answer_text)
            at = len(first) + round(depth * len(part))
            for present in (True, False):
                body = part[: at - len(first)] + needle + part[at - len(first) :] if present \
                    else part  # fmt: skip
                ids = [*first, *body, *question, *answer]
                source = range(at, at + len(needle)) if present else range(
                    len(first), len(first) + len(part))  # fmt: skip
                trials.append(Trial(tuple(ids), source, range(len(ids) - len(answer), len(ids)),
                                    len(part), depth, present))  # fmt: skip
    return trials
