"""The claims' ablation test: each claimed head ablated alone on its claim's inputs, beside a
baseline of its layer's unclaimed heads drawn afresh for every input, and the paired difference
tested one-sided per input (the cluster).

``AblationTest`` runs one kind of input's claims: the baseline pools and draws, the ablated
passes (``probe.interventions.ablation.ablation_effects``, a row per (head, input) pair a claim
reads, in passes of at most ``MAX_TOKENS`` tokens), each claim's change per input, and its
``statistics``. The Benjamini–Hochberg correction over every claim is the analysis's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from analyses.claims.inputs import ON_REPEATS, ON_SENTENCES, Group
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
            "inputs": inputs, "measure": self.measure,
            "positions": 0, "baseline_heads": 0, "baseline_from": "none",
        } for claim in mine.itertuples(index=False)])  # fmt: skip
        return Tested(table, 0, 0, 0, 0)

    def run(self, mine: pd.DataFrame, claims: pd.DataFrame, inputs: str, groups: list[Group],
            samples: dict[str, set[int]] | None) -> Tested:  # fmt: skip
        """Each claim of ``mine`` (of every claim, ``claims``) measured on its ``inputs`` of
        ``groups`` (its relation's sample of ``samples``; every input where that is None),
        beside its layer's unclaimed heads."""
        from probe.interventions.ablation import (
            difference,
            hidden_state,
            next_token_loss,
            relative_change,
        )

        pools = self.baselines(mine, claims)
        draw = self.draws(pools, inputs)
        ablated = sorted(set(zip(mine.layer, mine["head"], strict=True))
                         | {h for pool, _ in pools.values() for h in pool})  # fmt: skip
        lm = self.lm
        readout, change = (next_token_loss, difference) if lm else (hidden_state, relative_change)
        effects = self.effects(mine, groups, samples, draw, ablated, readout, change)
        slot = {h: i for i, h in enumerate(ablated)}
        rows, positions_total = [], 0
        for claim in mine.itertuples(index=False):
            per_input, positions = per_input_changes(claim, groups, samples, effects, draw, slot,
                                                     lm)  # fmt: skip
            positions_total += positions
            rows.append(claim._asdict() | statistics(per_input) | {
                "inputs": inputs,
                "measure": self.measure, "positions": positions,
                "baseline_from": pools[claim.layer][1],
            })  # fmt: skip
        count = sum(len(indices) for *_, indices in groups)
        ran = sum((~e[:, :, 0].isnan()).sum(1) for e in effects)  # [heads]: rows ablated
        return Tested(pd.DataFrame(rows), int((ran > 0).sum()), count, positions_total,
                      int(ran.sum()))  # fmt: skip

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

    def effects(self, mine, groups, samples, draw, ablated, readout, change) -> list:
        """Per group of inputs, every ablated head's change ``[heads, batch, pos]``, run only on
        the inputs a claim reads it on (NaN elsewhere, never read): a claimed head on its claim's
        inputs, a baseline head on the inputs of its layer's claims it was drawn for."""
        from probe.interventions.ablation import ablation_effects, head_means
        from probe.pipeline import helper

        model, slot = self.model, {h: i for i, h in enumerate(ablated)}
        effects = []
        with torch.no_grad():
            means = None
            if self.ablation != "zero":  # resample takes the mean where its source is padded
                means = head_means(model, [inputs for inputs, *_ in groups])
            for inputs, tags, indices in groups:
                helper.poll()  # the helper done writing the others' tables: both cores here
                needed = torch.zeros(len(ablated), len(indices), dtype=torch.bool)
                for claim in mine.itertuples(index=False):
                    for b, i in enumerate(indices.tolist()):
                        if reads(claim, i, samples):
                            for h in [(claim.layer, claim.head), *draw(claim.layer, i)]:
                                needed[slot[h], b] = True
                effect = torch.full((len(ablated), *tags.shape), math.nan, dtype=torch.float64)
                if needed.any():
                    found = ablation_effects(model, inputs, ablated, readout, change,
                                             mode=self.ablation, means=means, needed=needed,
                                             max_rows=max_rows(tuple(tags.shape)))  # fmt: skip
                    effect = found.cpu().double()
                effects.append(effect)
        return effects


def per_input_changes(claim, groups, samples, effects, draw, slot, lm: bool):
    """Per input (the cluster) of the claim's that holds its tokens, the claimed head's mean
    change there and each of its baseline heads' (by head); and the positions read."""
    target = RELATIONS.index(claim.relation) if claim.claim in ON_SENTENCES else 0
    per_input, positions = [], 0
    for (inputs, tags, indices), effect in zip(groups, effects, strict=True):
        read = torch.tensor([reads(claim, i, samples) for i in indices.tolist()])
        where = (tags == target).to(effect.device) & inputs["attention_mask"].bool().cpu()
        where &= read[:, None]
        if lm:  # the loss read at t is of token t + 1, which must be real
            where[:, -1] = False
            where[:, :-1] &= inputs["attention_mask"][:, 1:].bool().cpu()
            if claim.claim in ON_REPEATS:  # t and t + 1 in the second copy: its tokens after
                where &= torch.roll(tags == target, -1, dims=1)  # its first, each predictable
        count = where.sum(1)
        positions += int(count.sum())
        at = torch.where(where, effect, 0.0).sum(-1) / count.clamp(min=1)  # [heads, batch]
        for b in torch.nonzero(count).flatten().tolist():
            others = {h: float(at[slot[h], b]) for h in draw(claim.layer, int(indices[b]))}
            per_input.append((float(at[slot[(claim.layer, claim.head)], b]), others))
    return per_input, positions


def max_rows(shape: tuple[int, int]) -> int:
    """The rows of one ablated pass over a group of ``shape`` ``[inputs, pos]``: ``MAX_TOKENS``
    of its tokens, and at least the group's own rows and one more."""
    inputs, width = shape
    return max(inputs + 1, MAX_TOKENS // max(1, width))


def reads(claim, index: int, samples: dict[str, set[int]] | None) -> bool:
    """Whether ``claim`` is measured on input ``index``: a syntactic claim on its relation's
    sample of sentences, the others on every input of theirs."""
    return samples is None or index in samples[claim.relation]


def statistics(per_input: list[tuple[float, dict]]) -> dict:
    """The claimed head's mean effect over inputs with its 95% t-interval; the baseline (the mean
    over inputs of its heads' mean effect there), the heads it drew on and the spread of their
    own means; and the one-sided p-value of the paired difference (head − baseline) being above
    0. No interval or p-value on fewer than ``MIN_CLUSTERS`` inputs or without a baseline head."""
    n = len(per_input)
    nan = math.nan
    out = {"clusters": n, "effect": nan, "effect_low": nan, "effect_high": nan, "baseline": nan,
           "baseline_spread": nan, "baseline_heads": 0, "p": nan, "tested": False}  # fmt: skip
    if not n:
        return out
    effect = np.array([e for e, _ in per_input])
    out["effect"] = float(effect.mean())
    has_baseline = all(others for _, others in per_input)
    if has_baseline:
        baseline = np.array([np.mean(list(others.values())) for _, others in per_input])
        out["baseline"] = float(baseline.mean())
        by_head: dict = {}
        for _, others in per_input:
            for head, value in others.items():
                by_head.setdefault(head, []).append(value)
        out["baseline_heads"] = len(by_head)
        if len(by_head) > 1:
            out["baseline_spread"] = float(np.std([np.mean(v) for v in by_head.values()], ddof=1))
    if n < MIN_CLUSTERS:
        return out
    out["effect_low"], out["effect_high"] = t_interval(out["effect"], effect.std(ddof=1), n)
    if not has_baseline:
        return out
    out["p"] = t_test_above(effect - baseline)
    out["tested"] = True
    return out
