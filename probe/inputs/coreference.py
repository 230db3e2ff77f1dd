"""Coreference in CorefUD CoNLL-U: mentions, documents, windows of whole sentences, the gold
antecedents of a mention and the baselines of Clark et al. (2019, §4.3).

A mention is read from the ``Entity=`` brackets of the MISC column; its head word is the first
word of its span whose syntactic head lies outside the span. A document is cut into windows of
consecutive whole sentences that fit the model; inside a window, a mention linked by ``coref``
or ``ana`` is scored when an earlier mention of its entity (one that ends before it starts) is
in the window too, and its gold answers are the head words of those earlier mentions.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import accumulate, groupby, islice
from typing import TYPE_CHECKING

from probe.errors import ProbeError
from probe.inputs.treebank import ENTITY_BRACKETS_ITEM, Sentence

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Links to an antecedent that are identity coreference ("" where the treebank declares no link).
SCORED_LINKS = frozenset({"coref", "ana", ""})
MENTION_TYPES = ("all", "pronoun", "proper", "nominal")
BASELINES = ("nearest", "head_match", "rules")


@dataclass(frozen=True)
class Mention:
    """One mention: word positions are 0-based in its document or window, ``end`` included."""

    entity: str
    start: int
    end: int
    head: int
    link: str = ""
    kind: str = "nominal"  # pronoun, proper or nominal, from the head word's UPOS
    text: str = ""  # the span's words, lowercased, joined by spaces
    head_text: str = ""  # the head word, lowercased
    agreement: tuple[str, str, str] = ("", "", "")  # Number, Person, Gender; "" unknown
    size: int = 1  # mentions of its entity in the document

    def shifted(self, offset: int) -> Mention:
        return replace(self, start=self.start - offset, end=self.end - offset,
                       head=self.head - offset)  # fmt: skip


@dataclass
class Document:
    """A document's sentences and its mentions (positions over the document's words)."""

    id: str
    index: int  # 0-based among the documents of the treebank
    sentences: list[Sentence]
    mentions: list[Mention]  # ordered by start, then end

    @cached_property
    def offsets(self) -> list[int]:
        """The document position of each sentence's first word, then the number of words."""
        return [0, *accumulate(len(s.words) for s in self.sentences)]

    @cached_property
    def starts(self) -> list[int]:
        return [m.start for m in self.mentions]


@dataclass
class Window(Sentence):
    """Consecutive whole sentences of one document, joined as one input to the model.

    The joined tree keeps each sentence's root (head -1); ``mentions`` are those wholly inside
    the window, at window positions."""

    document_index: int = 0
    first_sentence: int = 0  # the position of the window's first sentence in its document
    mentions: list[Mention] = field(default_factory=list)


def documents(sentences: Iterable[Sentence]) -> Iterator[Document]:
    """The documents of a stream of sentences (consecutive sentences of one ``# newdoc``),
    with their mentions; a file without ``# newdoc`` is one document."""
    for index, (_, group) in enumerate(groupby(sentences, lambda s: (s.source, s.document))):
        group = list(group)
        yield Document(group[0].document, index, group, mentions(group))


def brackets(value: str) -> list[tuple[str, str, bool]]:
    """The items of one word's ``Entity=`` value, in order: ``("open", fields, closes_here)``
    for ``(fields`` or ``(fields)``, ``("close", entity, True)`` for ``entity)``."""
    items = []
    for m in ENTITY_BRACKETS_ITEM.finditer(value):
        opened, closed = m.group("open"), m.group("close")
        items.append(("open", opened, bool(m.group("end"))) if opened else ("close", closed, True))
    return items


def mentions(sentences: list[Sentence]) -> list[Mention]:
    """The mentions of a document's sentences, ordered by start then end.

    Raises
    ------
    ProbeError
        For a bracket that closes a mention never opened, or one left open at the document's end.
    """
    if not any(any(s.entity) for s in sentences):  # no brackets (all of EWT): nothing to join
        return []
    joined = join(sentences)
    words, heads, upos, feats = (joined[k] for k in ("words", "heads", "upos", "feats"))
    where = [(s.source, s.sent_id, i + 1) for s in sentences for i in range(len(s.words))]
    fields_ = sentences[0].entity_fields if sentences else ()
    link_at = fields_.index("link") if "link" in fields_ else None
    open_: dict[str, list[tuple[int, str]]] = {}
    spans = []

    def close(name: str, end: int, i: int) -> None:
        if not open_.get(name):
            source, sent_id, number = where[i]
            raise ProbeError(
                f"{source}: sentence {sent_id}, word {number}: Entity bracket {name}) closes a "
                "mention that was never opened"
            )
        start, link = open_[name].pop()
        spans.append((name, start, end, link))

    for i, value in enumerate(joined["entity"]):
        for kind, text, closes in brackets(value):
            if kind == "close":
                close(text, i, i)
                continue
            parts = text.split("-")
            link = parts[link_at] if link_at is not None and link_at < len(parts) else ""
            open_.setdefault(parts[0], []).append((i, link))
            if closes:
                close(parts[0], i, i)
    left = [name for name, stack in open_.items() if stack]
    if left:
        source, sent_id, _ = where[-1]
        raise ProbeError(
            f"{source}: document ending at sentence {sent_id}: mention of entity {left[0]} is "
            "never closed"
        )
    size = Counter(name for name, *_ in spans)
    found = []
    for name, start, end, link in sorted(spans, key=lambda s: (s[1], s[2], s[0])):
        head = next((j for j in range(start, end + 1) if not start <= heads[j] <= end), start)
        features = dict(f.partition("=")[::2] for f in feats[head].split("|") if "=" in f)
        person = features.get("Person", "3" if upos[head] in ("NOUN", "PROPN") else "")
        found.append(
            Mention(
                entity=name,
                start=start,
                end=end,
                head=head,
                link=link,
                kind=mention_type(upos[head]),
                text=" ".join(words[start : end + 1]).lower(),
                head_text=words[head].lower(),
                agreement=(features.get("Number", ""), person, features.get("Gender", "")),
                size=size[name],
            )
        )
    return found


def mention_type(upos: str) -> str:
    """pronoun (PRON), proper (PROPN) or nominal (anything else)."""
    return {"PRON": "pronoun", "PROPN": "proper"}.get(upos, "nominal")


def scored(window_mentions: list[Mention]) -> list[tuple[Mention, list[Mention]]]:
    """The mentions to score in a window, each with its antecedents there: the earlier mentions
    (ending before it starts) of its entity. Only identity links (``coref``, ``ana``) count."""
    found = []
    for m in window_mentions:
        if m.link in SCORED_LINKS:
            earlier = [a for a in window_mentions if a.entity == m.entity and a.end < m.start]
            if earlier:
                found.append((m, earlier))
    return found


def baselines(mention: Mention, window_mentions: list[Mention]) -> dict[str, Mention]:
    """Each baseline's choice of antecedent for ``mention``.

    Candidates are the earlier mentions in the window (ending before it starts) of entities
    with at least two mentions in the document. ``nearest``: the one with the largest end, then
    the latest start. ``head_match``: the nearest whose head word (lowercased) is the mention's,
    else the nearest. ``rules``: the nearest of the first non-empty of exact string match, head
    match, agreement in number, person and gender, and all candidates (Clark et al.'s sieve).
    """
    candidates = [c for c in window_mentions if c.end < mention.start and c.size >= 2]
    if not candidates:
        return {}
    same_head = [c for c in candidates if c.head_text == mention.head_text]

    def sieve() -> Iterator[list[Mention]]:  # lazily: most mentions stop at a string match
        yield [c for c in candidates if c.text == mention.text]
        yield same_head
        yield [c for c in candidates if agree(c, mention)]
        yield candidates

    return {
        "nearest": nearest(candidates),
        "head_match": nearest(same_head or candidates),
        "rules": nearest(next(step for step in sieve() if step)),
    }


def nearest(candidates: list[Mention]) -> Mention:
    return max(candidates, key=lambda c: (c.end, c.start))


def agree(a: Mention, b: Mention) -> bool:
    """No feature of Number, Person, Gender that both head words mark differs. English marks
    animacy only through gender (he, she against it), so gender stands for it."""
    return all(x == y or not x or not y for x, y in zip(a.agreement, b.agreement, strict=True))


def pack(lengths: list[int], budget: int) -> tuple[list[range], list[int]]:
    """Greedy windows of consecutive items whose lengths sum to at most ``budget``.

    Returns the windows (ranges of item positions) and the items longer than the budget alone,
    which are skipped and end the window before them."""
    windows, skipped, start, used = [], [], 0, 0
    for i, n in enumerate(lengths):
        if n > budget:
            if i > start:
                windows.append(range(start, i))
            skipped.append(i)
            start, used = i + 1, 0
        elif used + n > budget:
            windows.append(range(start, i))
            start, used = i, n
        else:
            used += n
    if len(lengths) > start:
        windows.append(range(start, len(lengths)))
    return windows, skipped


class Windows:
    """The windows of a treebank's documents, streamed one document at a time.

    Parameters
    ----------
    sentences : iterable of Sentence
        Read lazily; a document is held in memory while it is cut.
    tokenizer : PreTrainedTokenizerBase
    limit : int
        Model tokens per window, special tokens included.
    shard : (int, int)
        ``(rank, size)``: only the documents whose index is ``rank`` modulo ``size`` (one
        process's share, ``probe.distributed``).

    Documents without mentions give no window. Counters (of the shard's documents):
    ``documents``, ``windows``, ``mentions``, and ``skipped`` (sentences longer than the limit
    alone).
    """

    def __init__(
        self,
        sentences: Iterable[Sentence],
        tokenizer: PreTrainedTokenizerBase,
        limit: int,
        *,
        shard: tuple[int, int] = (0, 1),
    ) -> None:
        self.sentences = sentences
        from probe.inputs.alignment import word_tokenizer

        self.tokenizer = word_tokenizer(tokenizer)
        self.limit = limit
        self.shard = shard
        self.documents = self.windows = self.mentions = self.skipped = 0

    def __iter__(self) -> Iterator[Window]:
        self.documents = self.windows = self.mentions = self.skipped = 0
        budget = self.limit - self.tokenizer.num_special_tokens_to_add(pair=False)
        rank, size = self.shard
        for document in islice(documents(self.sentences), rank, None, size):
            self.documents += 1
            if not document.mentions:
                continue
            self.mentions += len(document.mentions)
            encoded = self.tokenizer(
                [s.words for s in document.sentences],
                is_split_into_words=True,
                add_special_tokens=False,
                return_attention_mask=False,
                return_token_type_ids=False,
            )
            ranges, skipped = pack([len(ids) for ids in encoded["input_ids"]], budget)
            self.skipped += len(skipped)
            for sentences in ranges:
                yield window(document, sentences)
                self.windows += 1


def window(document: Document, sentences: range) -> Window:
    """The window of ``document`` made of the sentences at positions ``sentences``."""
    first, stop = document.offsets[sentences.start], document.offsets[sentences.stop]
    parts = document.sentences[sentences.start : sentences.stop]
    starting = document.mentions[bisect_left(document.starts, first) :
                                 bisect_left(document.starts, stop)]  # fmt: skip
    return Window(
        **join(parts),
        sent_id=f"{parts[0].sent_id}…{parts[-1].sent_id}" if len(parts) > 1 else parts[0].sent_id,
        source=parts[0].source,
        document=document.id,
        document_index=document.index,
        first_sentence=sentences.start,
        mentions=[m.shifted(first) for m in starting if m.end < stop],
    )


def join(sentences: list[Sentence]) -> dict[str, list]:
    """Consecutive sentences as one sequence of words: each column concatenated, heads moved to
    the joined positions (each sentence keeps its root, -1)."""
    joined: dict[str, list] = {
        "words": [], "heads": [], "relations": [], "upos": [], "feats": [], "entity": []
    }  # fmt: skip
    for s in sentences:
        n, offset = len(s.words), len(joined["words"])
        joined["words"] += s.words
        joined["heads"] += [h + offset if h >= 0 else -1 for h in s.heads]
        joined["relations"] += s.relations
        joined["upos"] += s.upos or ["X"] * n
        joined["feats"] += s.feats or [""] * n
        joined["entity"] += s.entity or [""] * n
    return joined
