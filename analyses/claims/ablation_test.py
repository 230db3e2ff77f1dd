"""The claims' ablation test: each claimed head ablated alone on its claim's inputs, beside a
baseline of its layer's unclaimed heads drawn afresh for every input and beside its control
(``groups``), each paired difference tested one-sided per input (the cluster); the heads sharing
a claim ablated together, on every subset their Shapley shares need.

``AblationTest`` runs one kind of input's claims: the baseline pools and draws, the ablated
passes (``probe.interventions.ablation_rows.ablation_effects``, a row per (head, input) pair a claim
reads, in passes of at most ``MAX_TOKENS`` tokens), each claim's change per input, and its
``statistics``. The Benjamini–Hochberg correction over every claim is the analysis's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

from analyses.claims.groups import CONTROLS, read_at, role_groups, shuffled, with_group
from analyses.claims.inputs import ON_SENTENCES, Group
from probe.inference import MIN_CLUSTERS, t_interval, t_test_above
from probe.inputs.treebank import RELATIONS
from probe.keys import uniform
from probe.lazy import lazy

np = lazy("numpy")
pd = lazy("pandas")
torch = lazy("torch")

# Tokens (rows × padded length) in one ablated forward pass: what bounds its memory, whatever
# the inputs' lengths (a sentence's rows, a window's); a pass holds at least its group's own rows
# and one more.
MAX_TOKENS = 16_384


class Tested(NamedTuple):
    """One kind of input's claims tested: their rows of the claims table, and for the run's
    record the heads ablated, the inputs, the positions read and the ablated rows run."""

    table: pd.DataFrame
    heads_ablated: int
    count: int
    positions: int
    ablated_rows: int


@dataclass(frozen=True)
class AblationTest:
    """How the claims are tested on ``model`` (``n_layers`` × ``n_heads`` heads): by ``ablation``
    (``mean``, ``zero`` or ``resample``), against ``n_neighbours`` baseline heads an input (0:
    all), drawn by keys of ``seed``; the change measured as the loss rise (``lm``) or the
    relative change of the last hidden state."""

    model: object
    n_layers: int
    n_heads: int
    seed: int
    ablation: str
    n_neighbours: int
    lm: bool

    @property
    def measure(self) -> str:
        """The measure's name in a claim's row."""
        return "loss rise" if self.lm else "relative change"

    def untested(self, mine: pd.DataFrame, inputs: str) -> Tested:
        """``mine``'s claims with no input to test them on: untested, with no effect."""
        table = pd.DataFrame([claim._asdict() | statistics([]) | {
            "inputs": inputs, "measure": self.measure, "control_on": CONTROLS[inputs],
            "positions": 0, "baseline_heads": 0, "baseline_from": "none",
        } for claim in mine.itertuples(index=False)])  # fmt: skip
        return Tested(table, 0, 0, 0, 0)

    def run(self, mine: pd.DataFrame, claims: pd.DataFrame, inputs: str, groups: list[Group],
            samples: dict[str, set[int]] | None) -> Tested:  # fmt: skip
        """Each claim of ``mine`` (of every claim, ``claims``) measured on its ``inputs`` of
        ``groups`` (its relation's sample of ``samples``; every input where that is None),
        beside its layer's unclaimed heads and its control; the heads sharing a claim ablated
        together too, each head's share of the joint effect beside its row."""
        from probe.interventions.ablation import head_means
        from probe.interventions.ablation_rows import (
            difference,
            hidden_state,
            next_token_loss,
            relative_change,
        )

        pools = self.baselines(mine, claims)
        draw = self.draws(pools, inputs)
        roles = role_groups(mine, self.seed)
        singles = sorted(set(zip(mine.layer, mine["head"], strict=True))
                         | {h for pool, _ in pools.values() for h in pool})  # fmt: skip
        every = [int(i) for *_, indices in groups for i in indices.tolist()]
        joint = (item for g in roles for index in every for item in g.joint_items(index))
        items = [*singles, *dict.fromkeys(joint)]  # a large group's subsets differ by input
        slot = {item: k for k, item in enumerate(items)}
        lm = self.lm
        readout, change = (next_token_loss, difference) if lm else (hidden_state, relative_change)
        with torch.no_grad():
            means = None
            if self.ablation != "zero":  # resample takes the mean where its source is padded
                every_input = [model_inputs for model_inputs, *_ in groups]
                # the groups' heads are claimed: singles too; no block above theirs runs
                means = head_means(self.model, every_input, layers={k for k, _ in singles})
        wanted = self.wanted(mine, roles, samples, draw, slot)
        claimed = set(zip(mine.claim, mine.relation, strict=True))
        on_repeats = (False, True) if inputs == "repeats" else (False,)
        at = read_positions(claimed, samples, lm, on_repeats)
        effects, ran = self.effects(groups, items, wanted, means, readout, change, at)
        control, control_effects = groups, effects  # the repeats' first copy: the same passes
        if inputs != "repeats":
            control = shuffled(groups, self.seed, inputs)
            own = self.wanted(mine, roles, samples, None, slot)
            at = read_positions(claimed, samples, lm, (True,))
            control_effects, also = self.effects(control, items, own, means, readout, change, at)
            ran = ran + also
        cache: dict = {}

        def read(claim: str, relation: str, on_control: bool):
            if (claim, relation, on_control) not in cache:
                chosen = (control, control_effects) if on_control else (groups, effects)
                cache[claim, relation, on_control] = per_input(claim, relation, *chosen, samples,
                                                               lm, on_control)  # fmt: skip
            return cache[claim, relation, on_control]

        table, positions_total = self.rows(mine, inputs, read, pools, draw, slot)
        for g in roles:
            real, _ = read(g.claim, g.relation, False)
            controls, _ = read(g.claim, g.relation, True)
            table = with_group(table, g, real, controls, slot, draw)
        count = sum(len(indices) for *_, indices in groups)
        heads_ablated = int((ran[: len(singles)] > 0).sum())
        return Tested(table, heads_ablated, count, positions_total, int(ran.sum()))

    def rows(self, mine, inputs: str, read, pools, draw, slot) -> tuple[pd.DataFrame, int]:
        """Each claim's row of statistics (``statistics``: alone, against its neighbours and its
        control), from ``read(claim, relation, control)``; and the positions read in all."""
        rows, positions_total = [], 0
        for claim in mine.itertuples(index=False):
            (real, positions), (controls, _) = (read(claim.claim, claim.relation, c)
                                                for c in (False, True))  # fmt: skip
            positions_total += positions
            h = slot[(claim.layer, claim.head)]
            measured = [(float(v[h]), {o: float(v[slot[o]]) for o in draw(claim.layer, i)},
                         float(controls[i][h]) if i in controls else math.nan)
                        for i, v in real.items()]  # fmt: skip
            rows.append(claim._asdict() | statistics(measured) | {
                "inputs": inputs, "measure": self.measure, "positions": positions,
                "baseline_from": pools[claim.layer][1], "control_on": CONTROLS[inputs],
            })  # fmt: skip
        return pd.DataFrame(rows), positions_total

    def baselines(self, mine: pd.DataFrame, claims: pd.DataFrame) -> dict:
        """Per layer of ``mine``'s claims, the heads its baselines are drawn from and where they
        come from: the layer's unclaimed heads, or the nearest layers' where it has none."""
        H, L = self.n_heads, self.n_layers
        claimed = set(zip(claims.layer, claims["head"], strict=True))
        unclaimed = {layer: [(layer, h) for h in range(H) if (layer, h) not in claimed]
                     for layer in range(L)}  # fmt: skip
        pools = {}
        for layer in sorted(set(mine.layer)):
            pool, kind = unclaimed[layer], "unclaimed"
            if not pool:  # every head of the layer holds a claim: the nearest layers' unclaimed
                near = [k for k in range(L) if unclaimed[k]]
                nearest = min((abs(k - layer) for k in near), default=None)
                pool = [h for k in near if abs(k - layer) == nearest for h in unclaimed[k]]
                kind = "nearest layers' unclaimed" if pool else "none"
            pools[layer] = (pool, kind)
        return pools

    def draws(self, pools: dict, inputs: str):
        """``draw(layer, index)``: the baseline's heads on input ``index``: ``n_neighbours`` of
        the layer's pool drawn afresh for each input by a key of the seed, the head and the
        input (every head of the pool for 0, or where it holds no more), so that over the inputs
        the baseline is the pool's heads, each as likely as the others, not a chosen few."""
        cache: dict[tuple[int, int], list[tuple[int, int]]] = {}
        seed, n = self.seed, self.n_neighbours

        def draw(layer: int, index: int) -> list[tuple[int, int]]:
            if (layer, index) not in cache:
                pool = pools[layer][0]
                chosen = pool
                if n and len(pool) > n:
                    at = [np.array([k for k, _ in pool]), np.array([h for _, h in pool])]
                    drawn = uniform(seed, f"claims-baseline-{inputs}", *at,
                                    np.full(len(pool), index))  # fmt: skip
                    chosen = sorted(pool[i] for i in np.argsort(drawn, kind="stable")[:n])
                cache[(layer, index)] = chosen
            return cache[(layer, index)]

        return draw

    def wanted(self, mine, roles, samples, draw, slot):
        """``wanted(indices)``: the items ``[items, batch]`` a group of inputs ``indices`` needs:
        a claimed head on its claim's inputs, a baseline head on the inputs of its layer's claims
        it was drawn for (none without ``draw``: the control's), a group's subsets on its
        claim's inputs (only the whole group without ``draw``)."""

        claims = list(zip(mine.layer, mine["head"], mine.relation, strict=True))

        def wanted(indices) -> torch.Tensor:
            at: list[tuple[int, int]] = []  # (item's slot, input's column)
            for b, i in enumerate(indices.tolist()):
                for layer, head, relation in claims:
                    if reads(relation, i, samples):
                        at.append((slot[(layer, head)], b))
                        at += [(slot[h], b) for h in (draw(layer, i) if draw else ())]
                for g in roles:
                    if reads(g.relation, i, samples):
                        at += [
                            (slot[item], b) for item in (g.joint_items(i) if draw else [g.whole])
                        ]
            needed = torch.zeros(len(slot), len(indices), dtype=torch.bool)
            if at:
                needed[tuple(torch.tensor(at).T)] = True
            return needed

        return wanted

    def effects(self, groups, items, wanted, means, readout, change, read) -> tuple[list, Any]:
        """Per group of inputs, every item's change ``[items, batch, pos]`` (an item: a head
        ablated alone, or heads ablated together), run only on the inputs ``wanted`` names that
        hold a position ``read(group)`` ``[batch, pos]`` names, and read there (NaN elsewhere,
        never read); and the rows run per item ``[items]``."""
        from probe.interventions.ablation_rows import ablation_effects
        from probe.pipeline import helper

        effects, ran = [], torch.zeros(len(items), dtype=torch.long)
        with torch.no_grad():
            for model_inputs, tags, indices in groups:
                helper.poll()  # the helper done writing the others' tables: both cores here
                where = read((model_inputs, tags, indices))
                needed = wanted(indices) & where.any(1)  # an input read nowhere: nothing to run
                effect = torch.full((len(items), *tags.shape), math.nan, dtype=torch.float64)
                if needed.any():
                    found = ablation_effects(self.model, model_inputs, items, readout, change,
                                             mode=self.ablation, means=means, needed=needed,
                                             max_rows=max_rows(tuple(tags.shape)),
                                             read=where)  # fmt: skip
                    effect = found.cpu().double()
                effects.append(effect)
                ran += needed.sum(1)
        return effects, ran


def read_positions(claimed: set[tuple[str, str]], samples, lm: bool, controls: tuple[bool, ...]):
    """``read(group)``: where ``per_input`` reads any of the ``claimed`` (claim, relation) pairs
    on a group of inputs ``[batch, pos]`` bool, as a claim (``controls`` holding False) or as its
    control (True)."""

    def read(group) -> torch.Tensor:
        model_inputs, tags, indices = group
        mask = model_inputs["attention_mask"].bool().cpu()
        where = torch.zeros_like(mask)
        for claim, relation in claimed:
            target = RELATIONS.index(relation) if claim in ON_SENTENCES else 0
            measured = torch.tensor([reads(relation, i, samples) for i in indices.tolist()])
            for control in controls:
                where |= read_at(claim, tags, target, mask, lm, control) & measured[:, None]
        return where

    return read


def per_input(claim: str, relation: str, groups, effects, samples, lm: bool, control: bool):
    """Per input (the cluster) of a claim (``claim``, ``relation``) that holds its tokens, every
    item's mean change there ``[items]`` (by input number: NaN for items not run on it); and the
    positions read. On the claim's control where ``control``."""
    target = RELATIONS.index(relation) if claim in ON_SENTENCES else 0
    out, positions = {}, 0
    for (model_inputs, tags, indices), effect in zip(groups, effects, strict=True):
        mask = model_inputs["attention_mask"].bool().cpu()
        where = read_at(claim, tags, target, mask, lm, control)
        where &= torch.tensor([reads(relation, i, samples) for i in indices.tolist()])[:, None]
        count = where.sum(1)
        positions += int(count.sum())
        at = torch.where(where, effect, 0.0).sum(-1) / count.clamp(min=1)  # [items, batch]
        for b in torch.nonzero(count).flatten().tolist():
            out[int(indices[b])] = at[:, b]
    return out, positions


def max_rows(shape: tuple[int, int]) -> int:
    """The rows of one ablated pass over a group of ``shape`` ``[inputs, pos]``: ``MAX_TOKENS``
    of its tokens, and at least the group's own rows and one more."""
    inputs, width = shape
    return max(inputs + 1, MAX_TOKENS // max(1, width))


def reads(relation: str, index: int, samples: dict[str, set[int]] | None) -> bool:
    """Whether a claim of ``relation`` is measured on input ``index``: a syntactic claim on its
    relation's sample of sentences, the others on every input of theirs."""
    return samples is None or index in samples[relation]


def statistics(per_input: list[tuple[float, dict, float]]) -> dict:
    """The claimed head's mean effect over inputs with its 95% t-interval; the baseline (the mean
    over inputs of its heads' mean effect there), the heads it drew on and the spread of their
    own means; the control (the head's mean effect where the claim cannot happen); and the
    one-sided p-values of the paired differences (head − baseline, head − control) being above
    0. No interval or p-value on fewer than ``MIN_CLUSTERS`` inputs; no ``p`` without a baseline
    head. Tested where either p-value is."""
    n = len(per_input)
    nan = math.nan
    out = {"clusters": n, "effect": nan, "effect_low": nan, "effect_high": nan, "baseline": nan,
           "baseline_spread": nan, "baseline_heads": 0, "p": nan, "tested": False,
           "control": nan, "p_control": nan, "baseline_note": ""}  # fmt: skip
    if not n:
        return out
    effect = np.array([e for e, _, _ in per_input])
    control = np.array([c for _, _, c in per_input])
    out["effect"] = float(effect.mean())
    has_baseline = all(others for _, others, _ in per_input)
    if has_baseline:
        baseline = np.array([np.mean(list(others.values())) for _, others, _ in per_input])
        out["baseline"] = float(baseline.mean())
        by_head: dict = {}
        for _, others, _ in per_input:
            for head, value in others.items():
                by_head.setdefault(head, []).append(value)
        out["baseline_heads"] = len(by_head)
        if len(by_head) > 1:
            out["baseline_spread"] = float(np.std([np.mean(v) for v in by_head.values()], ddof=1))
    if out["baseline_heads"] < 2:
        out["baseline_note"] = WEAK
    has_control = np.isfinite(control)
    if has_control.any():
        out["control"] = float(control[has_control].mean())
    if n < MIN_CLUSTERS:
        return out
    out["effect_low"], out["effect_high"] = t_interval(out["effect"], effect.std(ddof=1), n)
    if has_control.sum() >= MIN_CLUSTERS:
        out["p_control"] = t_test_above(effect[has_control] - control[has_control])
    if has_baseline:
        out["p"] = t_test_above(effect - baseline)
    out["tested"] = not (math.isnan(out["p"]) and math.isnan(out["p_control"]))
    return out


# Where the neighbours cannot be a baseline (one head, or none), the control alone decides.
WEAK = "fewer than two heads: the control decides"
