"""The claims' inputs: which claims each kind of input tests, and the model inputs made from what
the stream kept, in fixed groups by length, each with a tag per token that marks where a claim
is measured.

Four kinds, each built through its unit's public functions: the kept treebank sentences (tagged
by each token's relation), the repeated random sequences (``probe.inputs.units.repeats``,
tagged on the second copy), the kept coreference windows (tagged at the scored mentions' head
words) and the needle-in-a-haystack trials (``probe.patterns.retrieval``, tagged at the
positions that predict the answer's tokens). Every kind is packed by ``packed`` alone: the same
groups, whatever ``--batch-size``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from analyses.vocabulary import Role
from probe.inputs.treebank import RELATIONS
from probe.lazy import lazy

if TYPE_CHECKING:
    from probe.patterns.retrieval import Trial

np = lazy("numpy")
torch = lazy("torch")

GROUP = 4  # inputs per group of ablated passes, by length: fixed, whatever --batch-size

RELATION = "relation"  # a best relation named on a head card without the syntactic role
# The claims tested, and the inputs each is tested on.
ON_SENTENCES = (str(Role.SYNTACTIC), RELATION)
ON_REPEATS = (str(Role.PREVIOUS_TOKEN), str(Role.DUPLICATE_TOKEN), str(Role.INDUCTION))
ON_WINDOWS = (str(Role.COREFERENCE),)
ON_NEEDLES = (str(Role.RETRIEVAL),)
CLAIMS = (*ON_SENTENCES, *ON_REPEATS, *ON_WINDOWS, *ON_NEEDLES)

FIRST_COPY = 1  # the repeats' tag on the first copy (their second's is 0), read by the control

# A group: its model inputs, its tags ``[batch, pos]`` (-1 where nothing is read) and the
# numbers of its inputs.
Group = tuple[dict, "torch.Tensor", "np.ndarray"]


def groups_of(n: int) -> list[tuple[int, int]]:
    """(start, stop) of groups of ``GROUP`` of ``n`` inputs, a last group of one joined to the
    one before it (resample ablation takes each input's z from another of its group)."""
    bounds = [(start, min(start + GROUP, n)) for start in range(0, n, GROUP)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        bounds[-2:] = [(bounds[-2][0], n)]
    return bounds


def packed(rows: list[tuple[list[int], list[int]]], model) -> list[Group]:
    """Inputs of token ids and tags (``rows``, numbered in order) in groups by length (ties by
    number: the same groups always), right-padded: each group's model inputs, tags
    ``[batch, pos]`` (-1 on padding) and numbers."""
    from probe.pipeline.loading import main_device

    device = main_device(model)
    order = sorted(range(len(rows)), key=lambda i: (len(rows[i][0]), i))
    groups = []
    for start, stop in groups_of(len(order)):
        chosen = order[start:stop]
        width = max(len(rows[i][0]) for i in chosen)
        ids = torch.zeros(len(chosen), width, dtype=torch.long)
        tags = torch.full((len(chosen), width), -1, dtype=torch.long)
        mask = torch.zeros(len(chosen), width, dtype=torch.long)
        for r, i in enumerate(chosen):
            token_ids, tagged = rows[i]
            ids[r, : len(token_ids)] = torch.tensor(token_ids)
            tags[r, : len(tagged)] = torch.tensor(tagged)
            mask[r, : len(token_ids)] = 1
        inputs = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
        groups.append((inputs, tags, np.array(chosen)))
    return groups


def sentence_groups(
    kept: dict[int, tuple[float, list[int], list[int]]], relations: set[str], n: int, model
) -> tuple[list[Group], dict[str, set[int]]]:
    """Groups of the ``kept`` sentences (index -> key, token ids, each token's relation index or
    -1) of the claimed ``relations``: tagged by each token's relation, numbered by the sentences'
    indices; and each relation's sample: its first ``n`` sentences by key."""
    # In key order, each sentence that holds a claimed relation not yet in n of those chosen:
    # each relation's first n, few sentences in all.
    need = {RELATIONS.index(r): n for r in relations}
    chosen = []
    for i in sorted(kept, key=lambda i: (kept[i][0], i)):
        helps = [r for r in set(kept[i][2]) if need.get(r, 0) > 0]
        if helps:
            chosen.append(i)
            for r in helps:
                need[r] -= 1
    samples = {r: {i for i in chosen if RELATIONS.index(r) in kept[i][2]}
               for r in relations}  # fmt: skip
    samples = {r: set(sorted(own, key=lambda i: (kept[i][0], i))[:n])
               for r, own in samples.items()}  # fmt: skip
    # numbered in index order, so that packed's ties by number are ties by index
    indices = sorted(chosen)
    groups = packed([(kept[i][1], kept[i][2]) for i in indices], model)
    return [(inputs, tags, np.array(indices)[numbers]) for inputs, tags, numbers in groups], samples


def repeat_groups(tokenizer, seed: int, n_sequences: int, length: int, model) -> list[Group]:
    """Groups of the repeated random sequences 0, 1, … (the taxonomy's first ones: BOS,
    ``length`` random tokens, the same again, as ``RepeatedSequences.pair(2 · index)`` draws
    them): tagged 0 on the second copy and ``FIRST_COPY`` on the first (the control's),
    numbered by the sequences' indices."""
    from probe.inputs.units.repeats import halves, ordinary_tokens, specials

    vocabulary = ordinary_tokens(tokenizer)
    first, last = specials(tokenizer)
    second = [-1] * len(first) + [FIRST_COPY] * length + [0] * length + [-1] * len(last)
    rows = []
    for index in range(n_sequences):
        drawn, _ = halves(seed, 2 * index, vocabulary, length)
        rows.append(([*first, *drawn, *drawn, *last], second))
    return packed(rows, model)


def window_groups(windows: dict[tuple[int, int], tuple[float, list[int], list[int]]], model):
    """Groups of the kept coreference ``windows`` ((document, first sentence) -> key, token ids,
    0 at the scored mentions' head words and -1 elsewhere), numbered by their ranks in key
    order."""
    order = sorted(windows, key=lambda w: (windows[w][0], w))
    return packed([(windows[w][1], windows[w][2]) for w in order], model)


def retrieval_trials(
    texts: dict[int, tuple[str, int]], tokenizer, model, haystack_tokens: int, n: int, seed: int
) -> tuple[list[Trial], dict]:
    """The retrieval claims' needle trials (the needle present), in a haystack of at most
    ``haystack_tokens`` tokens of the kept first sentences (``texts``: index -> text, tokens), at
    ``n`` evenly spaced depths; and what was used."""
    from probe.inputs.corpus import max_tokens
    from probe.patterns.retrieval import haystack, needle_trials

    room = max_tokens(model.config, tokenizer) - 64  # retrieval's OVERHEAD
    hay = haystack(tokenizer, (texts[i][0] for i in sorted(texts)), min(haystack_tokens, room))
    if not hay:
        return [], {"haystack_tokens": 0}
    depths = [k / max(n - 1, 1) for k in range(n)]
    trials = [t for t in needle_trials(tokenizer, hay, [len(hay)], depths, seed=seed)
              if t.needle]  # fmt: skip
    return trials, {"haystack_tokens": len(hay)}


def needle_groups(trials: list[Trial], model) -> list[Group]:
    """Groups of the needle ``trials``: tagged 0 at the positions that predict the answer's
    tokens, numbered in order."""
    rows = []
    for trial in trials:
        tags = [-1] * len(trial.ids)
        for t in trial.answer:  # the answer's token t is predicted at t - 1
            tags[t - 1] = 0
        rows.append((list(trial.ids), tags))
    return packed(rows, model)
