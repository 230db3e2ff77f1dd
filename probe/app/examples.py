"""Example attention maps for the report's head cards: a few real treebank sentences, and for
each head the few that best show what it does (for a syntactic head, the sentences where it gets
its best relation right most often, first).

The candidates are the first ``n_candidates`` sentences of the treebank (by position, whatever
order the batches come in) of a readable length; their token-level patterns are kept, layer by
layer, so memory is fixed whatever the corpus size.
"""

from __future__ import annotations

import json
import re
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from analyses.vocabulary import Direction, Role
from probe.errors import ProbeError
from probe.heads import HeadId
from probe.inputs.coreference import mentions, scored
from probe.inputs.treebank import Sentence

if TYPE_CHECKING:
    import pandas as pd
    from transformers import PreTrainedTokenizerBase

    from probe.inputs.corpus import Batch
    from probe.pipeline.runner import LayerCapture

N_CANDIDATES = 32  # enough for 72 cards to lead with different sentences, mostly
PER_HEAD = 3  # sentences on each head's card
COREFERENCE = "coreference"  # a card's "relation" when it shows coreference links
WORDS = (5, 14)  # a readable sentence has this many words…
MAX_TOKENS = 32  # …and at most this many tokens


@dataclass
class _Candidate:
    index: int
    sentence: Sentence
    tokens: list[str]
    word_of_token: list[int]
    pattern: np.ndarray  # [layer, head, q_pos, k_pos]
    predicted: np.ndarray  # [direction, layer, head, word]


class Examples:
    """Token-level attention of every head on a few short sentences (a stream consumer)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        n_layers: int,
        n_heads: int,
        *,
        n_candidates: int = N_CANDIDATES,
    ) -> None:
        self.tokenizer, self.n_layers, self.n_heads = tokenizer, n_layers, n_heads
        self.n_candidates = n_candidates
        self.candidates: dict[int, _Candidate] = {}  # by sentence index
        self._now: list[tuple[int, _Candidate]] = []

    def begin_batch(self, batch: Batch) -> None:
        self._now = []
        for b in range(len(batch)):
            n_tokens, n_words = int(batch.attention_mask[b].sum()), int(batch.n_words[b])
            if not (WORDS[0] <= n_words <= WORDS[1]) or n_tokens > MAX_TOKENS:
                continue
            index = int(batch.index[b])
            if len(self.candidates) >= self.n_candidates and index > max(self.candidates):
                continue
            candidate = _Candidate(
                index=index,
                sentence=batch.sentences[b],
                tokens=self.tokenizer.convert_ids_to_tokens(batch.input_ids[b, :n_tokens].tolist()),
                word_of_token=batch.word_of_token[b, :n_tokens].tolist(),
                pattern=np.zeros((self.n_layers, self.n_heads, n_tokens, n_tokens), np.float32),
                predicted=np.zeros((2, self.n_layers, self.n_heads, n_words), np.int64),
            )
            self.candidates[index] = candidate
            self._now.append((b, candidate))
            while len(self.candidates) > self.n_candidates:
                del self.candidates[max(self.candidates)]
        self._now = [(b, c) for b, c in self._now if self.candidates.get(c.index) is c]

    def update(self, batch: Batch, layer: int, capture: LayerCapture) -> None:
        for b, candidate in self._now:
            T, n = candidate.pattern.shape[-1], candidate.predicted.shape[-1]
            candidate.pattern[layer] = capture.pattern[b, :, :T, :T].cpu().numpy()
            candidate.predicted[:, layer] = capture.predictions[b, :, :, :n].cpu().numpy()

    def end_batch(self, batch: Batch) -> None:
        self._now = []

    def __getstate__(self) -> dict:
        """The candidates, for a merge in another process; not the tokenizer."""
        return {k: v for k, v in self.__dict__.items() if k not in ("tokenizer", "_now")}

    def merge(self, other: Examples) -> None:
        self.candidates.update(other.candidates)
        while len(self.candidates) > self.n_candidates:
            del self.candidates[max(self.candidates)]

    def choose(self, heads: pd.DataFrame) -> dict:
        """``examples.json``: the candidate sentences (their treebank position ``index``; heads
        0-based, -1 for the root; ``coreference``, each scored mention's head word with its
        antecedents' in the sentence), and per head (keyed ``"layer.head"``) the sentences its
        card shows, in order. A head with the coreference role is shown on its links, a
        syntactic head on its best relation; either with how many of them it gets right
        (``correct``) of how many (``words``), best first."""
        candidates = [self.candidates[i] for i in sorted(self.candidates)]
        if not candidates:  # no sentence of a readable length
            return {"sentences": [], "heads": {}}
        links = [coreference_links(c.sentence) for c in candidates]
        sentences = [
            {
                "index": c.index,
                "words": c.sentence.words,
                "heads": c.sentence.heads,
                "relations": c.sentence.relations,
                "coreference": found,
                "tokens": c.tokens,
                "word_of_token": c.word_of_token,
            }
            for c, found in zip(candidates, links, strict=True)
        ]
        # Cards show different sentences where they can: among equally telling sentences, the
        # one shown least so far comes first; a head without a relation is shown on the
        # sentences shown least, the longest (which show positional and sink heads best) first.
        used = [0] * len(candidates)
        chosen = {}
        for row in heads.itertuples():
            head = HeadId(row.layer, row.head)
            relation = getattr(row, "best_relation", None)
            tried = []  # (relation, direction, [(correct, of, sentence)]), the first that shows
            if Role.COREFERENCE in str(row.roles).split(";"):
                hits = [_coreference_hits(c, found, head)
                        for c, found in zip(candidates, links, strict=True)]  # fmt: skip
                # read as the coreference analysis reads it: from the mention
                tried.append((COREFERENCE, Direction.DEPENDENT_TO_HEAD, hits))
            if isinstance(relation, str) and relation:
                direction = Direction(row.best_relation_direction)
                hits = [_hits(c, direction.index, head, relation) for c in candidates]
                tried.append((relation, direction, hits))
            least = sorted(range(len(candidates)),
                           key=lambda i: (used[i], -len(candidates[i].tokens), i))  # fmt: skip
            shown, relation, direction = [{"sentence": i} for i in least[:PER_HEAD]], None, None
            for name, way, hits in tried:
                ranked = sorted((-correct, used[i], -correct / of, i)
                                for i, (correct, of) in enumerate(hits) if of)  # fmt: skip
                if ranked:  # some candidate has a word of it
                    shown = [{"sentence": i, "correct": -c, "words": hits[i][1]}
                             for c, _, _, i in ranked[:PER_HEAD]]  # fmt: skip
                    relation, direction = name, way
                    break
            for s in shown:
                used[s["sentence"]] += 1
            chosen[head.key] = {"relation": relation, "direction": direction, "shown": shown}
        return {"sentences": sentences, "heads": chosen}

    def patterns(self) -> dict[str, np.ndarray]:
        """``attention.npz``: each candidate sentence's token-level attention, float16
        ``[layer, head, q_pos, k_pos]``, keyed by its place in ``examples.json`` (``"0"``…)."""
        candidates = [self.candidates[i] for i in sorted(self.candidates)]
        return {str(i): c.pattern.astype(np.float16) for i, c in enumerate(candidates)}


def _hits(candidate: _Candidate, direction: int, head: HeadId, relation: str) -> tuple[int, int]:
    """Words of ``relation`` in ``candidate`` whose head this head predicts, and all of them."""
    s = candidate.sentence
    predicted = candidate.predicted[direction, head.layer, head.head]
    words = [i for i, (h, r) in enumerate(zip(s.heads, s.relations, strict=True))
             if r == relation and h >= 0]  # fmt: skip
    return sum(1 for i in words if predicted[i] == s.heads[i]), len(words)


def coreference_links(sentence: Sentence) -> list[tuple[int, list[int]]]:
    """The sentence's mentions scored as the coreference analysis scores them, each as its head
    word and its antecedents' head words, all within the sentence."""
    try:
        found = scored(mentions([sentence]))
    except ProbeError:  # a mention that runs over the sentence's ends
        return []
    return [(m.head, sorted({a.head for a in antecedents})) for m, antecedents in found]


def _coreference_hits(
    candidate: _Candidate, links: list[tuple[int, list[int]]], head: HeadId
) -> tuple[int, int]:
    """Mentions whose most-attended word (from their head word) is an antecedent's head word."""
    predicted = candidate.predicted[Direction.DEPENDENT_TO_HEAD.index, head.layer, head.head]
    return sum(1 for m, antecedents in links if predicted[m] in antecedents), len(links)


def write(folder: Path, chosen: dict, patterns: dict[str, np.ndarray]) -> None:
    """``examples.json`` and ``attention.npz`` in ``folder``."""
    from probe.files import write_file

    write_file(folder / "examples.json", json.dumps(chosen))
    write_file(folder / "attention.npz", lambda path: np.savez_compressed(path, **patterns))


def assemble(chosen: dict, patterns: dict[str, np.ndarray]) -> dict:
    """The examples as ``read`` gives them back, from what ``write`` is given."""
    examples = {"sentences": [dict(s) for s in chosen["sentences"]], "heads": chosen["heads"]}
    for i, sentence in enumerate(examples["sentences"]):
        sentence["pattern"] = patterns[str(i)].astype(np.float32)
    return examples


def read(folder: Path, n_layers: int | None = None, n_heads: int | None = None) -> dict:
    """A report folder's examples (``examples.json``) with each sentence's ``pattern`` (from
    ``attention.npz``), checked: every sentence's words, heads and tokens agree, every head's
    sentences exist, every pattern is finite and fits its tokens (and the ``n_layers`` x
    ``n_heads`` grid, when given). A folder without them (a run without patterns) has none.

    Raises
    ------
    ProbeError
        Naming the file and the first thing wrong in it.
    """
    path = folder / "examples.json"
    if not path.exists():
        return {"sentences": [], "heads": {}}
    try:
        examples = json.loads(path.read_text(encoding="utf-8"))
        for sentence in examples["sentences"]:
            _check_sentence(sentence)
        for key, head in examples["heads"].items():
            _check_head(key, head, len(examples["sentences"]), n_layers, n_heads)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ProbeError(f"{path} is malformed ({str(e).splitlines()[0]})") from None
    path = folder / "attention.npz"
    try:
        with np.load(path) as saved:
            for i, sentence in enumerate(examples["sentences"]):
                T = len(sentence["tokens"])
                pattern = saved[str(i)]
                grid = (n_layers or pattern.shape[0], n_heads or pattern.shape[1])
                if pattern.ndim != 4 or pattern.shape != (*grid, T, T):
                    raise ValueError(f"sentence {i}'s attention is not over its {T} tokens")
                if not np.isfinite(pattern).all():
                    raise ValueError(f"sentence {i}'s attention is not finite")
                sentence["pattern"] = pattern.astype(np.float32)
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        raise ProbeError(f"{path} is missing or malformed ({str(e).splitlines()[0]})") from None
    return examples


def _check_sentence(sentence: dict) -> None:
    """Raises ValueError unless a sentence's words, tree, tokens and links agree."""
    n = len(sentence["words"])
    lists = {k: sentence[k] for k in ("words", "heads", "relations", "tokens", "word_of_token")}
    if not all(isinstance(v, list) for v in lists.values()):
        raise ValueError("a sentence's words, heads, relations and tokens must be lists")
    if len(sentence["heads"]) != n or len(sentence["relations"]) != n:
        raise ValueError("a sentence's heads or relations do not match its words")
    if len(sentence["word_of_token"]) != len(sentence["tokens"]):
        raise ValueError("a sentence's word_of_token does not match its tokens")
    within = lambda x: isinstance(x, int) and not isinstance(x, bool) and -1 <= x < n  # noqa: E731
    if not all(map(within, sentence["heads"] + sentence["word_of_token"])):
        raise ValueError("a sentence's heads or word_of_token point outside it")
    for mention, antecedents in sentence.get("coreference", []):
        if not all(within(x) and x >= 0 for x in [mention, *antecedents]):
            raise ValueError("a sentence's coreference links point outside it")
    if not all(isinstance(x, str) for x in lists["words"] + lists["tokens"] + lists["relations"]):
        raise ValueError("a sentence's words, tokens and relations must be text")


def _check_head(key: str, head: dict, n: int, n_layers: int | None, n_heads: int | None) -> None:
    """Raises ValueError unless a head's card names a head of the grid and sentences in range."""
    grid = re.fullmatch(r"(\d+)\.(\d+)", key)  # "layer.head"
    if grid is None:
        raise ValueError(f"head {key!r} is not named layer.head")
    layer, head_index = int(grid[1]), int(grid[2])
    if n_layers is not None and not (0 <= layer < n_layers and 0 <= head_index < n_heads):
        raise ValueError(f"head {key} is not in the {n_layers} x {n_heads} grid")
    if head["relation"] is not None and not isinstance(head["relation"], str):
        raise ValueError(f"head {key}'s relation is not text")
    if head["direction"] is not None:
        Direction(head["direction"])
    if not head["shown"] or not all(0 <= int(s["sentence"]) < n for s in head["shown"]):
        raise ValueError(f"head {key}'s example sentences are out of range")
    for shown in head["shown"]:
        if head["relation"] is not None and not all(
            isinstance(shown[k], int) for k in ("correct", "words")
        ):
            raise ValueError(f"head {key}'s counts are not whole numbers")
