"""The words the analyses, their tables and the report share: roles, directions, thresholds.

Imports nothing heavy, so the command line can check a user's options before loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import StrEnum


class Direction(StrEnum):
    """Which way a head's attention is read as a dependency arc (Clark et al. 2019)."""

    # Both predict each dependent's head (Clark et al.'s code): dependent -> head, the word the
    # dependent attends to most is its head; head -> dependent, the word that attends most to
    # the dependent is its head.
    DEPENDENT_TO_HEAD = "dependent_to_head"
    HEAD_TO_DEPENDENT = "head_to_dependent"

    @property
    def index(self) -> int:
        """Position along the direction axis of ``LayerCapture.predictions``."""
        return list(Direction).index(self)

    @property
    def label(self) -> str:
        return self.value.replace("_", " ")


class Role(StrEnum):
    """What a head does, as the report and ``heads.csv`` name it; a head may hold several."""

    PREVIOUS_TOKEN = "previous-token"
    NEXT_TOKEN = "next-token"
    SINK = "sink"
    BROAD = "broad"
    SYNTACTIC = "syntactic"
    COREFERENCE = "coreference"
    INDUCTION = "induction"
    DUPLICATE_TOKEN = "duplicate-token"
    COPYING = "copying"
    RETRIEVAL = "retrieval"

    @property
    def code(self) -> str:
        """One letter for the overview grid."""
        return _STYLE[self][0]

    @property
    def colour(self) -> str:
        """The colour of the role in the report (a CSS colour)."""
        return _STYLE[self][1]


_STYLE = {
    Role.PREVIOUS_TOKEN: ("P", "#e07b39"),
    Role.NEXT_TOKEN: ("N", "#d6b23a"),
    Role.SINK: ("S", "#7b61c4"),
    Role.BROAD: ("B", "#54a37c"),
    Role.SYNTACTIC: ("Y", "#d0457a"),
    Role.COREFERENCE: ("C", "#3a7fc1"),
    Role.INDUCTION: ("I", "#1b9e9e"),
    Role.DUPLICATE_TOKEN: ("D", "#8c6d31"),
    Role.COPYING: ("O", "#5a5a5a"),
    Role.RETRIEVAL: ("R", "#2e8b3e"),
}

# The order in which a head's roles are described, the most telling first (``findings``): a
# head's one line names its first role here.
DESCRIBED_FIRST = (Role.SYNTACTIC, Role.COREFERENCE, Role.RETRIEVAL, Role.INDUCTION,
                   Role.DUPLICATE_TOKEN, Role.PREVIOUS_TOKEN, Role.NEXT_TOKEN, Role.COPYING,
                   Role.SINK, Role.BROAD)  # fmt: skip


def unknown_to_report(role: str) -> list[str]:
    """What the report lacks to show ``role`` (a role column an analysis gives): its letter and
    colour, its rule in words, its place in the order of description; empty when it lacks
    nothing."""
    try:
        role = Role(role)
    except ValueError:
        return ["the role itself (it is no Role)"]
    lacks = []
    if role not in _STYLE:
        lacks.append("a letter and colour (vocabulary._STYLE)")
    if role not in Thresholds().describe():
        lacks.append("a rule in words (Thresholds.describe)")
    if role not in DESCRIBED_FIRST:
        lacks.append("a place in vocabulary.DESCRIBED_FIRST")
    return lacks


@dataclass(frozen=True)
class Thresholds:
    """When a head gets a role; a head may hold several roles, or none."""

    previous_token: float = 0.9  # share of queries whose maximum is on the previous token
    next_token: float = 0.9  # share of queries whose maximum is on the next token
    sink: float = 0.6  # mean attention on special tokens and punctuation
    broad: float = 0.9  # mean entropy / log(number of keys)
    syntactic: float = 0.10  # best relation accuracy above its best offset baseline
    relation_min_words: int = 20  # relations scored for roles have at least this many words
    relation_min_share: float = 0.01  # … and at least this share of all scored words
    # repeated sequences: the 95% interval's lower end above the null by at least this much
    induction: float = 0.2
    duplicate_token: float = 0.2
    previous_token_repeats: float = 0.2  # above a head attending uniformly over its keys
    copying: float = 0.7  # Σ Re λ / Σ |λ| of the full OV circuit's eigenvalues
    retrieval: float = 0.1  # share of a needle's answer tokens copied from it (Wu et al. 2024)

    def __post_init__(self) -> None:
        """Each threshold in its range (a share in [0, 1], a count a whole number ≥ 1)."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" or f.type is int:
                if not (
                    isinstance(value, int | float) and value >= 1 and float(value).is_integer()
                ):
                    raise ValueError(f"threshold {f.name} must be a whole number ≥ 1, not {value}")
                object.__setattr__(self, f.name, int(value))
            elif not (isinstance(value, int | float) and 0 <= value <= 1):  # NaN fails too
                raise ValueError(f"threshold {f.name} must be between 0 and 1, not {value}")

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def describe(self) -> dict[Role, str]:
        """Each role's rule, in words, with this run's numbers."""
        return {
            Role.PREVIOUS_TOKEN: f"maximum on the previous token for ≥ {self.previous_token:.0%} "
            "of queries (roles); or, on repeated random sequences, the 95% interval of the "
            f"attention to the previous token lies ≥ {self.previous_token_repeats:.2f} above a "
            "head attending uniformly over the keys it sees (head types)",
            Role.NEXT_TOKEN: f"maximum on the next token for ≥ {self.next_token:.0%} of queries",
            Role.SINK: f"≥ {self.sink:.0%} of attention on special tokens and punctuation",
            Role.BROAD: f"normalised entropy ≥ {self.broad:.2f}",
            Role.SYNTACTIC: f"best relation accuracy ≥ {self.syntactic * 100:.0f} points above "
            f"its best offset baseline, among relations with ≥ {self.relation_min_words} words "
            f"and ≥ {self.relation_min_share:.0%} of all words, the margin holding after the "
            "Benjamini–Hochberg correction (5% false discovery rate) over every relation, "
            "direction and head",
            Role.COREFERENCE: "antecedent accuracy (all mentions) above the best baseline's, "
            "the margin holding after the Benjamini–Hochberg correction (5% false discovery "
            "rate) over every head and mention type, on at least 10 documents",
            Role.INDUCTION: "on repeated random sequences, the 95% interval of the attention "
            "to the token after the earlier copy lies ≥ "
            f"{self.induction:.2f} above its null (no repeat)",
            Role.DUPLICATE_TOKEN: "on repeated random sequences, the 95% interval of the "
            f"attention to the earlier copy of the same token lies ≥ {self.duplicate_token:.2f} "
            "above its null",
            Role.COPYING: "eigenvalues of the full OV circuit: Σ Re λ / Σ |λ| ≥ "
            f"{self.copying:.2f}",
            Role.RETRIEVAL: "top-1 attention on the needle's copy of the answer token for > "
            f"{self.retrieval:.0%} of answer tokens, over haystack lengths and needle depths",
        }
