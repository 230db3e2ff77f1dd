"""What the report says first: each head's behaviour in one line, and the overview's lead (heads
by role, the strongest syntactic and coreference heads, what the heads without a role look like).

Every line is read off ``heads.csv`` and the analyses' tables; a best relation appears only where
the syntax analysis named one (its margin held after the correction for every relation and head
tried), so nothing here selects among noisy numbers again.
"""

from __future__ import annotations

import math

import pandas as pd

from analyses.vocabulary import DESCRIBED_FIRST, Direction, Role
from probe.heads import HeadId
from probe.inference import FDR, MIN_CLUSTERS, MIN_EFFECT

# Where a head's attention goes, as the roles analysis measures it (shares of its attention).
DESTINATIONS = {
    "cls_like": "[CLS]-like tokens",
    "sep_like": "[SEP]-like tokens",
    "punct": "punctuation",
    "self": "itself",
    "previous": "the previous token",
    "next": "the next token",
}
SHOWN_SHARE = 0.10  # destinations under this share are left out of a head's line


def _pct(x) -> str:
    return f"{100 * x:.0f}%"


def _present(row: dict, column: str) -> bool:
    value = row.get(column)
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def _relation(row: dict) -> str:
    direction = Direction(row["best_relation_direction"]).label
    return (f"{row['best_relation']} ({direction}) {_pct(row['best_relation_accuracy'])}, "
            f"{100 * row['best_relation_margin']:+.1f} points over its best offset")  # fmt: skip


def _role_line(role: Role, row: dict) -> str | None:
    """The statistic behind ``role`` for this head, in words (None where it is not in the
    table)."""
    lines = {
        Role.SYNTACTIC: lambda: _relation(row),
        Role.COREFERENCE: lambda: (
            f"antecedent accuracy {_pct(row['coref_accuracy'])}, "
            f"{100 * row['coref_margin']:+.1f} points over the best baseline"
        ),
        Role.PREVIOUS_TOKEN: lambda: (
            f"its maximum on the previous token for {_pct(row['max_at_-1'])} of queries"
            if _present(row, "max_at_-1")
            else f"previous-token score {row['previous_token_score']:.2f} on repeated sequences"
        ),
        Role.NEXT_TOKEN: lambda: (
            f"its maximum on the next token for {_pct(row['max_at_+1'])} of queries"
        ),
        Role.SINK: lambda: (
            f"{_pct(row['sink_share'])} of its attention on special tokens and punctuation"
        ),
        Role.BROAD: lambda: f"normalised entropy {row['entropy_normalised']:.2f}",
        Role.INDUCTION: lambda: f"induction score {row['induction_score']:.2f}",
        Role.DUPLICATE_TOKEN: lambda: f"duplicate-token score {row['duplicate_token_score']:.2f}",
        Role.COPYING: lambda: f"copying score {row['copying_score']:.2f}",
        Role.RETRIEVAL: lambda: f"retrieval score {row['retrieval_score']:.2f}",
    }
    try:
        return lines[role]()
    except (KeyError, TypeError, ValueError):
        return None


def spread(row: dict) -> str:
    """Where the attention of a head goes, its largest destinations first."""
    shares = sorted(((row[c], name) for c, name in DESTINATIONS.items() if _present(row, c)),
                    reverse=True)  # fmt: skip
    shown = [f"{name} {_pct(share)}" for share, name in shares if share >= SHOWN_SHARE][:3]
    parts = ", ".join(shown) if shown else "many words, none above 10%"
    if _present(row, "entropy_normalised"):
        parts += f" (normalised entropy {row['entropy_normalised']:.2f})"
    return parts


def describe(row: dict, roles_tested: bool = True) -> str:
    """One line of what the head does: its first role's statistic, else "no role: attention
    spread over …" (without "no role" where the run tested no role: the circuit's alone). A line
    claims only what the page claims, a role: a best relation named without the syntactic role
    (a margin that held, but under the role's threshold) is given as a number, and said to be
    under the threshold."""
    roles = [Role(r) for r in str(row.get("roles", "")).split(";") if r]
    for role in sorted(roles, key=DESCRIBED_FIRST.index):
        line = _role_line(role, row)
        if line:
            return f"{role}: {line}"
    parts = []
    if any(_present(row, c) for c in DESTINATIONS):
        parts.append(f"attention spread over {spread(row)}")
    if str(row.get("best_relation") or ""):
        parts.append(f"best relation {_relation(row)}, under the syntactic role's threshold")
    if not roles_tested:
        return "; ".join(parts)
    return "no role: " + "; ".join(parts) if parts else "no role"


def lead(heads: pd.DataFrame, tables: dict[str, pd.DataFrame]) -> dict:
    """The overview's lead: heads by role (most held first), the strongest syntactic heads (the
    relations whose best head beats its offset baseline, largest margin first), the best
    coreference head where one is called, and the heads without a role."""
    by_role = []
    for role in Role:
        held = [HeadId(r.layer, r.head) for r in heads.itertuples()
                if str(role) in str(r.roles).split(";")]  # fmt: skip
        if held:
            by_role.append({"role": role, "heads": held, **_confirmed(tables, role)})
    by_role.sort(key=lambda r: -len(r["heads"]))
    syntactic = []
    best = tables.get("syntax_best")
    if best is not None and len(best):
        beating = best[best.beats_baseline & (best.relation != "all")]
        beating = beating.assign(margin=beating.accuracy - beating.baseline_accuracy)
        syntactic = beating.sort_values("margin", ascending=False).head(5).to_dict("records")
    coreference, note = _coreference(tables.get("coref"))
    none = heads[heads.roles.fillna("") == ""]
    return {"by_role": by_role, "syntactic": syntactic, "coreference": coreference,
            "coreference_note": note, "unassigned": unassigned(none),
            "rules": {"fdr": FDR, "min_effect": MIN_EFFECT, "min_clusters": MIN_CLUSTERS},
            "layers": {layer: _tally(part) for layer, part in heads.groupby("layer")}}  # fmt: skip


def _confirmed(tables: dict[str, pd.DataFrame], role: Role) -> dict:
    """Of the heads holding ``role``, how many were tested by ablation, how many of those
    confirmed alone and how many only with their group (``analyses.claims``); nothing where the
    run tested none."""
    claims = tables.get("claims")
    if claims is None or not len(claims):
        return {}
    own = claims[claims.claim == str(role)]
    if not own.tested.any():
        return {}
    confirmed = own[own.confirmed.astype(bool)]
    ids = [HeadId(layer, head) for layer, head in zip(confirmed.layer, confirmed["head"],
                                                      strict=True)]  # fmt: skip
    grouped = int((own.verdict == "only with its group").sum()) if "verdict" in own else 0
    return {"tested": int(own.tested.sum()), "confirmed": len(ids), "confirmed_heads": ids,
            "grouped": grouped}  # fmt: skip


def _tally(heads: pd.DataFrame) -> str:
    """How many of these heads hold each role, and how many none, in words."""
    counts = {}
    for roles in heads.roles.fillna(""):
        for role in roles.split(";") if roles else ["no role"]:
            counts[role] = counts.get(role, 0) + 1
    return ", ".join(f"{n} {role}" for role, n in sorted(counts.items(), key=lambda c: -c[1]))


def _coreference(coref: pd.DataFrame | None) -> tuple[dict | None, str | None]:
    """The most accurate head whose margin over the baselines is called (over all mentions),
    or why there is none."""
    if coref is None:
        return None, None
    if coref.empty:
        return None, "skipped (the treebank has no coreference annotation)"
    every = coref[coref.mention_type == "all"]
    called = every[every.margin_called & (every.margin > 0)]
    if len(called):
        return called.sort_values("accuracy", ascending=False).iloc[0].to_dict(), None
    documents = int(every.documents.iloc[0])
    if documents < MIN_CLUSTERS:
        return None, (f"{documents} documents, fewer than {MIN_CLUSTERS}: too few to call any "
                      "head better than the baselines")  # fmt: skip
    return None, "no head is called better than the baselines"


def unassigned(none: pd.DataFrame) -> dict:
    """The heads without a role: how many, their mean attention profile, and how many of them
    send most of their attention to each destination."""
    columns = [c for c in DESTINATIONS if c in none]
    if none.empty or not columns:
        return {"n": len(none), "profile": "", "groups": []}
    profile = spread(none[columns + [c for c in ["entropy_normalised"] if c in none]].mean())
    dominant = none[columns].idxmax(axis=1).map(DESTINATIONS).value_counts()
    return {"n": len(none), "profile": profile,
            "groups": [(name, int(n)) for name, n in dominant.items()]}  # fmt: skip
