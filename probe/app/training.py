"""Three questions about multi-head attention, answered by training small transformers built from
``probe.MultiHeadAttention`` on synthetic tasks (``probe experiment heads``):

1. Why learn W_i^Q and W_i^K rather than one W_i = W_i^Q W_i^Kᵀ? ("narrow" against "bilinear")
2. What changes between narrow heads (d_head = d_model / h) and wide ones (d_head = d_model),
   and why do heads end up different? ("narrow" against "wide", and what each head attends to)
3. Why separate queries from keys? With W_i^Q = W_i^K the scores are symmetric ("shared").

Every task is a set of (key, value) tokens in random order, without positions: each key is
drawn from a fixed relation over ``KEYS`` key tokens, each value at random, and a position must
output the value of the position its key is related to. The answer is in the context, never in
the token itself, so only attention can find it:

- ``successor``: keys form a chain x, σ(x), σ²(x)… of a fixed cycle σ; output the value of σ(x).
  Asymmetric: σ(x) and σ⁻¹(x) are both present, and symmetric scores cannot tell them apart.
- ``partner``: keys come in pairs of a fixed involution τ; output the value of τ(x). Symmetric.
- ``four_relations``: a chain, with four outputs: the values of σ(x), σ⁻¹(x), σ²(x), σ⁻²(x),
  several distinct relations at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from probe.app import answers
from probe.attention import MultiHeadAttention
from probe.capture.hookpoints import trace
from probe.numerics import pairwise_js
from probe.weights.spectra import spectra

D_MODEL, N_HEADS = 32, 4
KEYS, VALUES, LENGTH = 64, 16, 12  # key tokens, value tokens, pairs per sequence
BATCH, LEARNING_RATE, EVAL_SEQUENCES = 64, 3e-3, 1024
CURVE_EVERY = 10  # steps between points of the learning curves
VARIANTS: dict[str, dict] = {
    "narrow": {"qk": "factored"},
    "wide": {"qk": "factored", "d_head": D_MODEL},
    "bilinear": {"qk": "bilinear"},
    "shared": {"qk": "shared"},
}
# Each task's relations, as offsets along the chain (None: the partner of a pair).
TASKS: dict[str, tuple[int | None, ...]] = {
    "successor": (1,),
    "partner": (None,),
    "four_relations": (1, -1, 2, -2),
}
RELATION_NAMES = {1: "successor", -1: "predecessor", 2: "second_successor",
                  -2: "second_predecessor", None: "partner"}  # fmt: skip


def _generator(*key: int) -> torch.Generator:
    """A generator seeded by a tuple of small integers (the same numbers, the same stream)."""
    seed = 0
    for k in key:
        seed = (seed * 1_000_003 + k) % 2**62
    return torch.Generator().manual_seed(seed)


def relation(task: str, seed: int) -> torch.Tensor:
    """The task's fixed relation over the key tokens: a single cycle σ (``relation[x]`` is
    σ(x)) for chain tasks, an involution τ without fixed points for ``partner``."""
    order = torch.randperm(KEYS, generator=_generator(seed, 1))
    mapping = torch.empty(KEYS, dtype=torch.long)
    if TASKS[task] == (None,):
        mapping[order[0::2]], mapping[order[1::2]] = order[1::2], order[0::2]
    else:
        mapping[order] = order.roll(-1)
    return mapping


@dataclass
class Batch:
    keys: torch.Tensor  # [batch, pos]
    values: torch.Tensor  # [batch, pos]
    targets: torch.Tensor  # [relation, batch, pos]: the value to output, -100 where none
    where: torch.Tensor  # [relation, batch, pos]: the position holding it, -1 where none


def sample(task: str, mapping: torch.Tensor, size: int, generator: torch.Generator) -> Batch:
    """``size`` sequences of ``LENGTH`` (key, value) pairs, in random order."""
    if TASKS[task] == (None,):  # LENGTH / 2 distinct pairs (x, τ(x))
        firsts = torch.stack([_distinct_pairs(mapping, generator) for _ in range(size)])
        keys = torch.stack([firsts, mapping[firsts]], -1).flatten(1)  # x, τ(x), y, τ(y)…
        source = [torch.arange(LENGTH) ^ 1]  # each position's partner
    else:  # a chain x, σ(x), σ²(x)…
        start = torch.randint(0, KEYS, (size, 1), generator=generator)
        keys = [start]
        for _ in range(LENGTH - 1):
            keys.append(mapping[keys[-1]])
        keys = torch.cat(keys, 1)
        source = [torch.arange(LENGTH) + offset for offset in TASKS[task]]
    values = torch.randint(0, VALUES, (size, LENGTH), generator=generator)
    order = torch.argsort(torch.rand(size, LENGTH, generator=generator), 1)
    rank = torch.argsort(order, 1)  # where each chain position lands
    targets, where = [], []
    for positions in source:
        present = (positions >= 0) & (positions < LENGTH)
        p = positions.clamp(0, LENGTH - 1).expand(size, -1)
        targets.append(values.gather(1, p).masked_fill(~present, -100).gather(1, order))
        where.append(rank.gather(1, p).masked_fill(~present, -1).gather(1, order))
    return Batch(keys.gather(1, order), values.gather(1, order), torch.stack(targets),
                 torch.stack(where))  # fmt: skip


def _distinct_pairs(mapping: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One key of each of LENGTH / 2 distinct pairs."""
    firsts = torch.nonzero(torch.arange(KEYS) < mapping).squeeze(1)  # one key per pair
    return firsts[torch.randperm(len(firsts), generator=generator)[: LENGTH // 2]]


class Model(nn.Module):
    """Embeddings of keys and values, one attention layer with a residual connection, and a
    linear read-out per relation."""

    def __init__(self, variant: str, outputs: int) -> None:
        super().__init__()
        self.key = nn.Embedding(KEYS, D_MODEL)
        self.value = nn.Embedding(VALUES, D_MODEL)
        self.attn = MultiHeadAttention(D_MODEL, N_HEADS, **VARIANTS[variant])
        self.read = nn.ModuleList(nn.Linear(D_MODEL, VALUES) for _ in range(outputs))

    def forward(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Logits ``[relation, batch, pos, value]``."""
        x = self.key(keys) + self.value(values)
        y = x + self.attn(x)
        return torch.stack([read(y) for read in self.read])


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 2), targets.flatten(), ignore_index=-100)


@dataclass
class Run:
    """One trained model: its learning curve and what it learned, per head."""

    task: str
    variant: str
    seed: int
    curve: pd.DataFrame  # step, loss
    heads: pd.DataFrame  # one row per head


def train(task: str, variant: str, seed: int, steps: int) -> Run:
    """Train one model (Adam, ``BATCH`` fresh sequences per step) and measure it on
    ``EVAL_SEQUENCES`` held-out sequences."""
    torch.manual_seed(seed)
    mapping = relation(task, seed)
    model = Model(variant, len(TASKS[task]))
    optimiser = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    data = _generator(seed, 2, len(task))
    curve, recent = [], []
    for step in range(1, steps + 1):
        batch = sample(task, mapping, BATCH, data)
        loss = loss_of(model(batch.keys, batch.values), batch.targets)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        recent.append(loss.item())
        if step % CURVE_EVERY == 0 or step == steps:
            curve.append({"step": step, "loss": float(np.mean(recent))})
            recent = []
    heads = measure(model, task, mapping, seed)
    heads.insert(0, "final_loss", curve[-1]["loss"])
    return Run(task, variant, seed, pd.DataFrame(curve), heads)


@torch.no_grad()
def measure(model: Model, task: str, mapping: torch.Tensor, seed: int) -> pd.DataFrame:
    """Per head: accuracy of the model, its parameters, the effective rank of the head's
    learned W_i^Q W_i^Kᵀ, its mean attention on each relation's target, and its mean
    Jensen-Shannon divergence from the other heads' attention (0: the same, ln 2: disjoint)."""
    batch = sample(task, mapping, EVAL_SEQUENCES, _generator(seed, 3))
    attention = model.attn
    with trace(model, "hook_pattern") as cache:
        logits = model(batch.keys, batch.values)
    pattern = cache.stack("hook_pattern")[0]  # its one layer: [batch, head, query, key]
    scored = batch.targets >= 0
    accuracy = float((logits.argmax(-1) == batch.targets)[scored].float().mean())
    counts = attention.parameter_counts()
    ranks = spectra(attention).query("circuit == 'QK'").effective_rank.to_numpy()
    rows = {
        "accuracy": accuracy,
        "attention_parameters": sum(counts.values()),
        "qk_parameters": counts["QK"],
        "head": np.arange(N_HEADS),
        "qk_effective_rank": ranks,
        "qk_rank_possible": min(D_MODEL, attention.W_Q.shape[-1]),
        "head_similarity": _mean_js(pattern),
    }
    for r, offset in enumerate(TASKS[task]):
        where = batch.where[r]  # [batch, query]
        present = where >= 0
        on_target = pattern.gather(
            3, where.clamp(min=0)[:, None, :, None].expand(-1, N_HEADS, -1, 1)
        )
        on_target = on_target.squeeze(-1).transpose(1, 2)[present]  # [queries, head]
        rows[f"attention_on_{RELATION_NAMES[offset]}"] = on_target.mean(0).numpy()
    return pd.DataFrame(rows)


def _mean_js(pattern: torch.Tensor) -> np.ndarray:
    """Each head's mean Jensen-Shannon divergence from the other heads, over every query."""
    p = pattern.transpose(0, 1).flatten(1, 2).double()  # [head, queries, keys]
    js = pairwise_js(p) / p.shape[1]  # [head, head], mean over the queries
    return (js.sum(1) / max(N_HEADS - 1, 1)).numpy()


def runs(steps: int, seeds: list[int]) -> Iterator[Run]:
    """Every (task, variant, seed), in a fixed order."""
    for task in TASKS:
        for variant in VARIANTS:
            for seed in seeds:
                yield train(task, variant, seed, steps)


def tables(done: list[Run]) -> dict[str, pd.DataFrame]:
    """``experiment`` (one row per task, variant, seed and head) and ``curves``."""
    experiment = pd.concat(
        [r.heads.assign(task=r.task, variant=r.variant, seed=r.seed) for r in done],
        ignore_index=True,
    )
    first = ["task", "variant", "seed", "head"]
    experiment = experiment[first + [c for c in experiment.columns if c not in first]]
    curves = pd.concat(
        [r.curve.assign(task=r.task, variant=r.variant, seed=r.seed) for r in done],
        ignore_index=True,
    )[["task", "variant", "seed", "step", "loss"]]
    return {"experiment": experiment, "curves": curves}


def summary(experiment: pd.DataFrame) -> pd.DataFrame:
    """Per (task, variant): means over seeds (and heads, for head measures)."""
    per_run = experiment.groupby(["task", "variant", "seed"]).agg(
        accuracy=("accuracy", "first"),
        final_loss=("final_loss", "first"),
        attention_parameters=("attention_parameters", "first"),
        qk_parameters=("qk_parameters", "first"),
        qk_effective_rank=("qk_effective_rank", "mean"),
        qk_rank_possible=("qk_rank_possible", "first"),
        head_similarity=("head_similarity", "mean"),
    )
    return per_run.groupby(["task", "variant"], sort=False).mean().reset_index()


def _factored_answer(s: pd.DataFrame, status: pd.DataFrame) -> str:
    """Question 1: one learned W_i per head (bilinear) against W_i^Q W_i^Kᵀ (narrow), by
    parameters, accuracy and the effective rank the learned W_i actually use.

    Parameters
    ----------
    s : ``summary`` indexed by (task, variant)
    status : ``probe.app.answers.convergence``
    """
    # Parameter counts do not depend on the task: read them off any one.
    qk = s.xs("successor", level="task").qk_parameters
    rank = s.xs("bilinear", level="variant").qk_effective_rank.mean()
    found = answers.difference(status, "bilinear", "narrow", list(TASKS))
    verdict = {
        "higher": " Here the extra rank bought accuracy, at the price of its parameters.",
        "lower": " Here the full matrix did not buy accuracy: factored heads did better, with "
        "fewer parameters.",
        "the same": " Factoring reached the same accuracy with fewer parameters.",
    }.get(found.verdict, "")
    return (
        f"One W_i per head (bilinear) costs {qk['bilinear']:,.0f} QK parameters; "
        f"narrow factored heads cost {qk['narrow']:,.0f} "
        f"({qk['bilinear'] / qk['narrow']:.0f}x fewer). Mean accuracy over the tasks: "
        f"bilinear {_accuracy(s, 'bilinear'):.1%}, narrow {_accuracy(s, 'narrow'):.1%}; "
        f"{found.words('bilinear', 'narrow')}. The learned W_i have an effective rank of "
        f"{rank:.1f} of a possible {D_MODEL}, against "
        f"{s.xs('narrow', level='variant').qk_effective_rank.mean():.1f} of at most "
        f"{D_MODEL // N_HEADS} for a factored W_i^Q W_i^Kᵀ." + verdict
    )


def _accuracy(s: pd.DataFrame, variant: str, task: str | None = None) -> float:
    """A variant's accuracy on one task, or its mean over the tasks when ``task`` is None.

    Parameters
    ----------
    s : ``summary`` indexed by (task, variant)
    variant, task : str
    """
    if task is None:
        return s.xs(variant, level="variant").accuracy.mean()
    return s.accuracy[task, variant]


def _specialisation(experiment: pd.DataFrame) -> tuple[int, int, float]:
    """How narrow heads divide four relations among themselves.

    A head is specialised when it puts more than half of its attention on one relation's
    target.

    Parameters
    ----------
    experiment : one row per task, variant, seed and head (``tables``)

    Returns
    -------
    specialised : int
        Narrow heads on ``four_relations`` that are specialised, over every seed.
    heads : int
        Narrow heads on ``four_relations``, over every seed.
    relations_per_model : float
        Distinct relations the specialised heads of one model cover, mean over seeds (0 when
        no head is specialised).
    """
    four = experiment.query("task == 'four_relations' and variant == 'narrow'")
    relations = [c for c in four.columns if c.startswith("attention_on_")]
    specialised = four[relations].max(axis=1) > 0.5
    best = four[relations].idxmax(axis=1)[specialised]
    per_seed = best.groupby(four.seed[specialised]).nunique()
    per_model = per_seed.reindex(four.seed.unique(), fill_value=0).mean()
    return int(specialised.sum()), len(four), float(per_model)


def _heads_answer(s: pd.DataFrame, experiment: pd.DataFrame, status: pd.DataFrame) -> str:
    """Question 2: wide heads against narrow ones, and how far heads specialise.

    Parameters
    ----------
    s : ``summary`` indexed by (task, variant)
    experiment : one row per task, variant, seed and head (``tables``)
    status : ``probe.app.answers.convergence``
    """
    narrow, wide = (s.xs(v, level="variant") for v in ("narrow", "wide"))
    found = answers.difference(status, "wide", "narrow", list(TASKS))
    specialised, heads, relations_per_model = _specialisation(experiment)
    similarity = experiment[experiment.variant == "narrow"].pivot_table(
        index="seed", columns="task", values="head_similarity", aggfunc="mean")  # fmt: skip
    narrow_status = status[(status.variant == "narrow")
                           & status.task.isin(["four_relations", "successor"])]  # fmt: skip
    apart = answers.paired(
        (similarity["four_relations"] - similarity["successor"]).to_numpy(),
        bool((narrow_status.status != "not converged").all()),
    )
    differ = {
        "higher": " Heads differ more when the task needs several relations at once.",
        "lower": " Heads differ less when the task needs several relations at once.",
    }.get(apart.verdict, "")
    return (
        f"Wide heads (d_head = {D_MODEL}) have {wide.attention_parameters.mean():,.0f} attention "
        f"parameters against {narrow.attention_parameters.mean():,.0f} for narrow ones "
        f"(d_head = {D_MODEL // N_HEADS}); mean accuracy {_accuracy(s, 'wide'):.1%} against "
        f"{_accuracy(s, 'narrow'):.1%}; {found.words('wide', 'narrow')}. On four relations at "
        f"once, {specialised} of {heads} narrow heads put most of their weight on one "
        f"relation's target, covering {relations_per_model:.1f} distinct relations per model "
        f"of 4. Their mean Jensen-Shannon divergence from each other is "
        f"{s.head_similarity['four_relations', 'narrow']:.2f} nats (ln 2 = 0.69 is disjoint), "
        f"against {s.head_similarity['successor', 'narrow']:.2f} when one relation suffices "
        f"({_nats(apart)})." + differ
    )


def _nats(found: answers.Difference) -> str:
    """A difference of divergences, with its interval across seeds where there is one."""
    text = f"a difference of {found.mean:+.2f} nats"
    if found.seeds >= 2:
        text += f", 95% interval across seeds {found.low:+.2f} to {found.high:+.2f}"
    return text if found.verdict in ("higher", "lower") else f"{text}; no conclusion: " + (
        "the same within 0.02" if found.verdict == "the same" else found.verdict)  # fmt: skip


def _symmetric_answer(s: pd.DataFrame, status: pd.DataFrame) -> str:
    """Question 3: shared heads (symmetric scores) against narrow ones, task by task.

    Parameters
    ----------
    s : ``summary`` indexed by (task, variant)
    status : ``probe.app.answers.convergence``
    """
    acc = partial(_accuracy, s)  # acc(variant, task)
    four = answers.difference(status, "shared", "narrow", ["four_relations"])
    verdict = {
        "lower": " A symmetric score cannot serve a relation and its reverse at once (that "
        "needs q_i·k_j ≠ q_j·k_i), so separate W^Q and W^K are needed wherever direction "
        "matters.",
        "the same": " Here symmetric scores did not cost accuracy.",
        "higher": " Here symmetric scores did not cost accuracy.",
    }.get(four.verdict, "")
    return (
        f"With W_i^Q = W_i^K (shared) the scores are symmetric. On the symmetric partner task "
        f"shared heads reach {acc('shared', 'partner'):.1%} (narrow: "
        f"{acc('narrow', 'partner'):.1%}); on the asymmetric successor task "
        f"{acc('shared', 'successor'):.1%} (narrow: {acc('narrow', 'successor'):.1%}); with four "
        f"relations, two of them the reverse of the other two, "
        f"{acc('shared', 'four_relations'):.1%} (narrow: {acc('narrow', 'four_relations'):.1%}): "
        f"{four.words('shared', 'narrow')}." + verdict
    )


def answers_from(experiment: pd.DataFrame, curves: pd.DataFrame) -> dict[str, str]:
    """A plain-words answer to each question, and a word on convergence, every sentence drawn
    from the measured numbers (``probe.app.answers``)."""
    s = summary(experiment).set_index(["task", "variant"])
    status = answers.convergence(experiment, curves)
    return {
        "convergence": answers.convergence_sentence(status),
        "factored": _factored_answer(s, status),
        "heads": _heads_answer(s, experiment, status),
        "symmetric": _symmetric_answer(s, status),
    }


def run(steps: int, seeds: list[int], progress: Callable[[Run], None] = lambda run: None):
    """Train every model and return the tables (see ``tables``)."""
    done = []
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is fastest, and the same every time
    try:
        for r in runs(steps, seeds):
            done.append(r)
            progress(r)
    finally:
        torch.set_num_threads(previous)
    return tables(done)
