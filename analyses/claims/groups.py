"""The claims' groups and controls: heads sharing a role ablated together, each head's share of
the joint effect, and the within-head control a claim must beat beside its neighbours.

- A group: the heads of one kind of input's claims that hold the same claim (the same role, or
  the same relation), two or more. They are ablated together, and on every subset the shares
  need (``probe.interventions.shapley``: exact for at most ``EXACT`` heads, else over a few
  keyed orderings drawn for each input); each head's share is its Shapley value, the shares
  summing to the joint effect.
- The control: the same head (or group) measured where the claimed behaviour cannot happen.
  For previous-token, duplicate-token and induction claims, the first copy of the same repeated
  sequences (its tokens are random: nothing earlier predicts them, nothing is repeated yet), at
  the positions after its first, as many as the second copy's read. For a syntactic relation,
  coreference and retrieval, the same inputs shuffled (``shuffled``: the tokens between the first
  and the last in a keyed random order, each keeping its tag), read at the same tokens: no
  syntax, no coreference chain, no needle to copy from.
"""

from __future__ import annotations

from typing import NamedTuple

from analyses.claims.inputs import FIRST_COPY, ON_REPEATS, Group
from probe.interventions import shapley
from probe.keys import uniform
from probe.lazy import lazy

np = lazy("numpy")
pd = lazy("pandas")
torch = lazy("torch")

CONTROLS = {
    "repeats": "the first copy of the same sequences",
    "sentences": "the same sentences shuffled",
    "windows": "the same windows shuffled",
    "needles": "the same trials shuffled",
}


class RoleGroup(NamedTuple):
    """Heads sharing a claim: the claim, its relation, the heads in order, and the seed that
    keys the orderings a large group's shares average over on each input."""

    claim: str
    relation: str
    members: list[tuple[int, int]]
    seed: int

    @property
    def name(self) -> str:
        """The group in words: its heads, ``1-0 1-1 1-2``."""
        return " ".join(f"{layer}-{head}" for layer, head in self.members)

    def item(self, subset: frozenset[int]):
        """The ablation item of a subset of members: a head alone, or a tuple of heads."""
        chosen = tuple(self.members[i] for i in sorted(subset))
        return chosen[0] if len(chosen) == 1 else chosen

    def orderings(self, index: int) -> list[tuple[int, ...]] | None:
        """The orderings the shares average over on input ``index`` (None: exact)."""
        key = f"{self.claim}-{self.relation}"
        return shapley.orderings(len(self.members), self.seed, key, index)

    def joint_items(self, index: int) -> list:
        """The items of every subset of two members or more the shares need on input
        ``index``, the whole last."""
        subsets = shapley.subsets(len(self.members), self.orderings(index))
        return [self.item(s) for s in subsets]

    @property
    def whole(self):
        return self.item(frozenset(range(len(self.members))))


def role_groups(mine: pd.DataFrame, seed: int) -> list[RoleGroup]:
    """The groups of ``mine``'s claims: heads holding the same claim (and relation), two or more,
    in order of the claim, the relation and the heads."""
    found = []
    for (claim, relation), own in mine.groupby(["claim", "relation"], sort=True):
        members = sorted(set(zip(own.layer.astype(int), own["head"].astype(int), strict=True)))
        if len(members) > 1:
            found.append(RoleGroup(claim, relation, members, seed))
    return found


def shuffled(groups: list[Group], seed: int, inputs: str) -> list[Group]:
    """The control's inputs: each of ``groups``' inputs with its real tokens between the first
    and the last (a [CLS] or BOS, a [SEP] or the last word: kept in place) in an order drawn by a
    key of the seed and the input's number, each token keeping its tag."""
    out = []
    for model_inputs, tags, indices in groups:
        ids, tags = model_inputs["input_ids"].clone(), tags.clone()
        lengths = model_inputs["attention_mask"].sum(1).tolist()
        for b, (n, index) in enumerate(zip(lengths, indices.tolist(), strict=True)):
            inner = np.arange(1, max(1, int(n) - 1))
            if len(inner) < 2:
                continue
            keys = uniform(seed, f"claims-control-{inputs}", np.full(len(inner), index), inner)
            order = torch.as_tensor(inner[np.argsort(keys, kind="stable")])
            at = torch.as_tensor(inner)
            ids[b, at] = ids[b, order.to(ids.device)]
            tags[b, at] = tags[b, order]
        out.append(({**model_inputs, "input_ids": ids}, tags, indices))
    return out


def read_at(claim: str, tags, target: int, mask, lm: bool, control: bool):
    """Where a claim is read ``[batch, pos]``: its tagged tokens (``target``), or for a
    repeated-sequence claim's control the first copy's; with an LM head, where the next token is
    real, and on the repeats, t and t + 1 both in the copy (L + 1 … 2L − 1 of the second)."""
    tag = FIRST_COPY if control and claim in ON_REPEATS else target
    where = (tags == tag) & mask
    if lm:  # the loss read at t is of token t + 1, which must be real
        where[:, -1] = False
        where[:, :-1] &= mask[:, 1:]
        if claim in ON_REPEATS:  # t and t + 1 in the copy: its tokens after its first, each
            where &= torch.roll(tags == tag, -1, dims=1)  # predictable from the copy before
    return where


# A share within float rounding of 0, relative to the group's largest joint effect: none.
ROUNDING = 1e-5
NAN = float("nan")
GROUP_COLUMNS = {
    "group": "", "group_heads": 1, "shares_by": "", "group_effect": NAN, "group_effect_low": NAN,
    "group_effect_high": NAN, "group_baseline": NAN, "group_control": NAN, "group_p": NAN,
    "group_p_control": NAN, "group_note": "", "share": NAN, "share_low": NAN, "share_high": NAN,
    "share_p": NAN,
}  # fmt: skip


def with_group(table: pd.DataFrame, g: RoleGroup, real: dict, controls: dict, slot: dict,
               draw) -> pd.DataFrame:  # fmt: skip
    """``table`` with the group's columns on its members' rows: the joint effect per input (the
    members ablated together) with its interval, against the mean of the members' baselines and
    against the joint effect on the control, each paired over inputs (one-sided p); and each
    member's share (its Shapley value per input, averaged) with its interval and the p-value of
    its being above 0 (none for a share within float rounding of 0: ``ROUNDING``)."""
    from probe.inference import MIN_CLUSTERS, t_interval, t_test_above

    n, whole = len(g.members), frozenset(range(len(g.members)))
    joint, control, baseline, shares, drawn_heads = [], [], [], [], set()
    for i, v in real.items():

        def value(s: frozenset[int], v=v) -> float:
            return float(v[slot[g.item(s)]])

        shares.append(shapley.shares(n, value, g.orderings(i)))
        joint.append(value(whole))
        drawn = [draw(layer, i) for layer, _ in g.members]
        drawn_heads.update(h for heads in drawn for h in heads)
        means = [np.mean([float(v[slot[h]]) for h in heads]) for heads in drawn if heads]
        baseline.append(float(np.mean(means)) if means else NAN)
        control.append(float(controls[i][slot[g.whole]]) if i in controls else NAN)
    joint, control, baseline = np.array(joint), np.array(control), np.array(baseline)
    shares = np.array(shares).reshape(len(joint), n)  # [inputs, members]
    out = dict(GROUP_COLUMNS) | {"group": g.name, "group_heads": n,
                                 "shares_by": shapley.method(n)}  # fmt: skip
    if len(drawn_heads) < 2:
        out["group_note"] = "fewer than two heads: the control decides"
    member_shares = [dict.fromkeys(("share", "share_low", "share_high", "share_p"), NAN)
                     for _ in g.members]  # fmt: skip
    count = len(joint)
    if count:
        out["group_effect"] = float(joint.mean())
        out["group_baseline"] = float(baseline.mean())
        out["group_control"] = float(np.nanmean(control)) if np.isfinite(control).any() else NAN
        for k, mine in enumerate(member_shares):
            mine["share"] = float(shares[:, k].mean())
    if count >= MIN_CLUSTERS:
        out["group_effect_low"], out["group_effect_high"] = t_interval(
            out["group_effect"], joint.std(ddof=1), count
        )
        if np.isfinite(baseline).all():
            out["group_p"] = t_test_above(joint - baseline)
        real_control = np.isfinite(control)
        if real_control.sum() >= MIN_CLUSTERS:
            out["group_p_control"] = t_test_above(joint[real_control] - control[real_control])
        scale = float(np.abs(joint).max())
        for k, mine in enumerate(member_shares):
            column = shares[:, k]
            mine["share_low"], mine["share_high"] = t_interval(
                mine["share"], column.std(ddof=1), count
            )
            if abs(mine["share"]) > ROUNDING * scale:
                mine["share_p"] = t_test_above(column)
    table = table.copy()
    for column in GROUP_COLUMNS:
        if column not in table:
            table[column] = pd.Series([GROUP_COLUMNS[column]] * len(table), dtype=object)
    for (layer, head), mine in zip(g.members, member_shares, strict=True):
        at = (table.layer == layer) & (table["head"] == head) & (table.claim == g.claim)
        at &= table.relation == g.relation
        for column, value in (out | mine).items():
            table.loc[at, column] = value
    return table
