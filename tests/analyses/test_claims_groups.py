"""Claims that survive redundancy and their own baseline (issue #63): heads sharing a role
ablated together, each head's Shapley share of the joint effect, and the within-head control.

On the trained induction model, with layer 0's previous-token and duplicate-token heads claimed,
the four layer-1 induction heads draw their baseline from layer 0's two unclaimed heads, and
ablated alone, two of them do not beat it (the others carry on); ablated together, they do, and
each head's line says alone or only with its group. A decoy (W_O zeroed) in the group has a share
of 0 and is confirmed in no form. The group's joint effect equals one computed with plain
PyTorch hooks; the exact Shapley shares sum to it; a large group's sampled shares too."""

import copy
import itertools
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import transformers as tf
from induction import MODEL

sys.path.insert(0, str(Path(__file__).parent))
from models import CONFIGS, padded_batch, small_model
from test_claims import claims_of, gpt2_lm, heads_table, replaced, z_of, zero_head_output

from analyses.claims import Claims
from probe.interventions import shapley
from probe.interventions.ablation import ablate, head_means
from probe.interventions.ablation_rows import (
    _branched,
    ablation_effects,
    difference,
    hidden_state,
    next_token_loss,
    relative_change,
)

INDUCTION_HEADS = [(1, h) for h in range(4)]
# Layer 0's previous-token head and a duplicate-token claim on 0-1: the induction heads'
# baseline is layer 0's other two heads (every layer-1 head holds a claim).
ROLES = {(0, 0): "previous-token", (0, 1): "duplicate-token",
         **dict.fromkeys(INDUCTION_HEADS, "induction")}  # fmt: skip


@pytest.fixture(scope="module")
def induction_model():
    model = tf.AutoModelForCausalLM.from_pretrained(MODEL).eval()
    return model, tf.AutoTokenizer.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def tables(induction_model):
    model, tokenizer = induction_model
    return claims_of(model, tokenizer, heads_table(2, 4, ROLES)).finish()


def test_redundant_induction_heads_are_confirmed_as_a_group(tables):
    table = tables["claims"].set_index(["layer", "head"])
    induction = table.loc[INDUCTION_HEADS]
    # alone, some do not beat their neighbours (the others carry on) ...
    assert (induction.p > 0.05).sum() >= 2, induction[["effect", "baseline", "p"]]
    assert not induction.confirmed.all()
    # ... together they do, against the neighbours and the control
    assert induction.group.eq("1-0 1-1 1-2 1-3").all() and induction.group_heads.eq(4).all()
    assert induction.group_confirmed.all()
    row = induction.iloc[0]
    assert row.group_effect > 3 * row.group_baseline and row.group_effect_low > row.group_control
    assert (induction.shares_by == "exact Shapley").all()
    # each head's share and its verdict: alone where it beats both alone, else with its group
    assert (induction.share_low > 0).all()
    assert set(induction.verdict) == {"confirmed alone", "only with its group"}
    assert (induction.verdict == "confirmed alone").eq(induction.confirmed).all()
    # the shares sum to the joint effect (each input's do, so their means do)
    assert math.isclose(induction.share.sum(), row.group_effect, rel_tol=1e-9, abs_tol=1e-12)
    # the control is reported for every claim, and a claim alone must beat it too
    assert table.control.notna().all() and table.p_control.notna().all()
    assert (table.control_on == "the first copy of the same sequences").all()
    assert (table.loc[table.confirmed, "effect"] > table.loc[table.confirmed, "control"]).all()
    words = Claims.heads(tables, None).set_index(["layer", "head"]).claim_verdicts
    grouped = induction.index[induction.verdict == "only with its group"]
    assert all(words[h] == "induction: confirmed with its group (1-0 1-1 1-2 1-3)"
               for h in grouped)  # fmt: skip


def test_a_decoy_in_the_group_has_no_share_and_no_verdict(induction_model, tables):
    model, tokenizer = induction_model
    decoy = copy.deepcopy(model)
    zero_head_output(decoy, 1, 2)  # its pattern, and so its claim, unchanged; it does nothing
    table = claims_of(decoy, tokenizer, heads_table(2, 4, ROLES)).finish()["claims"]
    table = table.set_index(["layer", "head"])
    row = table.loc[(1, 2)]
    assert abs(row.share) < 1e-6 and abs(row.effect) < 1e-6 and math.isnan(row.share_p)
    assert not row.confirmed and row.verdict == "not confirmed"
    others = table.loc[[(1, 0), (1, 1), (1, 3)]]
    assert others.group_confirmed.all()
    assert math.isclose(table.loc[INDUCTION_HEADS].share.sum(), row.group_effect,
                        rel_tol=1e-9)  # fmt: skip


def test_the_joint_effect_is_plain_hooks_ablating_the_heads_together():
    """``ablation_effects`` with a group item against every head's z replaced by its mean through
    plain pre-hooks on the output projections, at once; a group across layers too."""
    model = gpt2_lm()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 250, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[2, 7:] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    means = head_means(model, [inputs])
    groups = [((1, 0), (1, 2)), ((0, 1), (1, 3), (1, 0)), (0, 2)]
    got = ablation_effects(model, inputs, groups, next_token_loss, difference, means=means)
    real = mask.bool() & torch.roll(mask.bool(), -1, 1)
    real[:, -1] = False
    with torch.no_grad():
        intact = next_token_loss(model(**inputs), inputs)
        for k, item in enumerate(groups):
            heads = [item] if isinstance(item[0], int) else list(item)
            handles = [mean_hook(model, layer, head, means[layer][head]) for layer, head in heads]
            try:
                ablated = next_token_loss(model(**inputs), inputs)
            finally:
                for h in handles:
                    h.remove()
            expected = difference(ablated[None], intact)[0]
            torch.testing.assert_close(got[k][real], expected[real], atol=1e-5, rtol=1e-4)


def test_a_subsets_row_is_copied_where_it_parts_from_another_row_of_its_input():
    """Worked by hand, three layers, two inputs after the batch's 2 rows: a row starts at the
    first layer where it ablates other heads than a row of its input appended lower, copying
    that row; else at its lowest layer, copying its input's own row."""
    members = [
        [(0, 1)],  # 0: from its input's row, at block 0
        [(0, 1), (1, 2)],  # 1: parts from 0 at layer 1
        [(0, 1), (1, 2), (2, 0)],  # 2: parts from 1 at layer 2
        [(0, 1), (2, 0)],  # 3: parts from 0 at layer 2 (from 1 at layer 1, lower)
        [(1, 3)],  # 4: nothing below it: from its input's row, at block 1
        [(0, 2), (1, 2)],  # 5: parts from every other row at layer 0
        [(1, 2), (1, 3)],  # 6: parts from 4 at layer 1, where 4 starts: from its input's row
    ]
    chunk = [(i, 0) for i in range(len(members))] + [(1, 1), (2, 1)]
    rows = _branched(members, chunk, rows=2, n_layers=3)
    start = {(i, b): (block, source) for i, b, block, source in rows}
    position = {(i, b): 2 + k for k, (i, b, *_) in enumerate(rows)}
    assert [block for *_, block, _ in rows] == sorted(block for *_, block, _ in rows)
    assert start[(0, 0)] == (0, 0) and start[(5, 0)] == (0, 0) and start[(4, 0)] == (1, 0)
    assert start[(1, 0)] == (1, position[(0, 0)])
    assert start[(2, 0)] == (2, position[(1, 0)])
    assert start[(3, 0)] == (2, position[(0, 0)])
    assert start[(6, 0)] == (1, 0)
    # input 1 has no row of item 0: item 1 starts from its own row; item 2 parts from it
    assert start[(1, 1)] == (0, 1) and start[(2, 1)] == (2, position[(1, 1)])
    # no blocks of their own (ALBERT): every row from its lowest layer, its input's row
    assert all(
        source == b and block == members[i][0][0]
        for i, b, block, source in _branched(members, chunk, rows=2, n_layers=0)
    )


# ALBERT's one block for every layer has no hook of its own per layer: mean ablation through
# probe's own hook points there, and its rows all start from the input (no branching) anyway
@pytest.mark.parametrize(("kind", "mode"), [(kind, mode) for kind in sorted(CONFIGS)
                                            for mode in ("mean", "resample")
                                            if kind != "albert" or mode == "mean"])  # fmt: skip
def test_rows_copied_from_another_ablated_row_are_plain_hooks_ablating_the_heads(kind, mode):
    """Items whose rows copy another item's row where they part (a head's row, a subset's), on
    every architecture, padded, some pairs only, in one pass or many: the same as each item's
    heads ablated together with plain PyTorch hooks."""
    model = small_model(kind)
    inputs = padded_batch(kind)
    items = [(0, 1), [(0, 1), (1, 3)], [(0, 1), (0, 2)], [(0, 1), (0, 2), (1, 0)], (1, 3),
             [(1, 0), (1, 3)], [(0, 2), (1, 0)]]  # fmt: skip
    means = head_means(model, [inputs])
    real = inputs["attention_mask"].bool()
    rows = real.shape[0]
    needed = torch.rand(len(items), rows, generator=torch.Generator().manual_seed(3)) < 0.7
    needed[:4, 0] = True  # a chain of subsets on one input at least
    every = ablation_effects(model, inputs, items, hidden_state, relative_change, mode=mode,
                             means=means, needed=needed)  # fmt: skip
    zs = z_of(model, inputs)
    with torch.no_grad():
        intact = hidden_state(model(**inputs), inputs)
        for k, item in enumerate(items):
            heads = [item] if isinstance(item[0], int) else list(item)
            if kind == "albert":
                with ablate(model, heads, "mean", means):
                    ablated = hidden_state(model(**inputs), inputs)
            else:
                handles = [replaced(model, layer, head, ablated_z(zs, means, real, mode, layer,
                                                                  head))
                           for layer, head in heads]  # fmt: skip
                try:
                    ablated = hidden_state(model(**inputs), inputs)
                finally:
                    for handle in handles:
                        handle.remove()
            expected = relative_change(ablated[None], intact)[0]
            asked = needed[k][:, None] & real
            torch.testing.assert_close(every[k][asked], expected[asked], atol=1e-5, rtol=1e-4)
            assert every[k][~needed[k]].isnan().all()
    for max_rows in (rows + 1, rows + 3):  # the subsets split over passes: the same numbers
        split = ablation_effects(model, inputs, items, hidden_state, relative_change, mode=mode,
                                 means=means, needed=needed, max_rows=max_rows)  # fmt: skip
        torch.testing.assert_close(split, every, atol=1e-6, rtol=1e-5, equal_nan=True)


def ablated_z(zs, means, real, mode: str, layer: int, head: int) -> torch.Tensor:
    """The z a head is given: its mean, or (resample) the next input's z, its mean where that
    one is padded."""
    if mode == "mean":
        return means[layer][head]
    source = zs[layer][:, :, head].roll(-1, 0)
    return torch.where(real.roll(-1, 0)[..., None], source, means[layer][head])


def mean_hook(model, layer: int, head: int, value: torch.Tensor):
    """A plain PyTorch pre-hook on layer ``layer``'s output projection (GPT-2's Conv1D) setting
    head ``head``'s z to ``value`` ``[d_head]`` at every position."""
    o = model.transformer.h[layer].attn.c_proj
    d = model.config.n_embd // model.config.n_head

    def hook(_module, args):
        x = args[0].clone()
        x[..., head * d : (head + 1) * d] = value
        return (x, *args[1:])

    return o.register_forward_pre_hook(hook)


@pytest.mark.parametrize("n", [1, 2, 4, 6, 8])
def test_shapley_shares_sum_to_the_joint_effect(n):
    """Exact (n ≤ EXACT) by every subset, or over keyed orderings: the shares sum to v(whole) to
    float rounding; a member that adds nothing anywhere gets exactly 0; exact shares of an
    additive game are its terms."""
    rng = np.random.default_rng(n)
    noise = {frozenset(s): float(rng.normal()) for size in range(2, n + 1)
             for s in itertools.combinations(range(n), size)}  # fmt: skip
    single = rng.normal(size=n)
    dummy = n - 1

    def value(s: frozenset[int]) -> float:
        rest = s - {dummy} if n > 1 else s
        if not rest:
            return 0.0
        return float(single[list(rest)].sum()) if len(rest) == 1 else noise[frozenset(rest)]

    ordering = shapley.orderings(n, seed=0, name="test", index=3)
    assert (ordering is None) == (n <= shapley.EXACT)
    got = shapley.shares(n, value, ordering)
    whole = value(frozenset(range(n)))
    assert math.isclose(sum(got), whole, rel_tol=1e-12, abs_tol=1e-12)
    if n > 1:
        assert got[dummy] == 0.0
    additive = shapley.shares(n, lambda s: float(single[list(s)].sum()), ordering)
    np.testing.assert_allclose(additive, single, rtol=1e-12, atol=1e-12)
    needed = shapley.subsets(n, ordering)
    assert needed[-1] == frozenset(range(n)) and all(len(s) >= 2 for s in needed[:-1])
    if n > shapley.EXACT:  # n - 2 prefixes an ordering, and the whole
        assert len(needed) <= (n - 2) * shapley.ORDERINGS + 1
        assert shapley.orderings(n, 0, "test", 3) == ordering  # keyed: the same draw
        assert all(o[::-1] in ordering for o in ordering)  # antithetic
        assert shapley.orderings(n, 0, "test", 4) != ordering  # each input its own


def test_sampled_shares_average_to_the_exact_ones():
    """A large group's shares on one input are an estimate from a few orderings; drawn afresh
    for each input, their mean over inputs is the exact Shapley value's (here, one random game
    played on 400 inputs: within four standard errors), as the claims' mean over inputs
    needs."""
    n = 6
    rng = np.random.default_rng(0)
    game = {frozenset(s): float(rng.normal()) for size in range(1, n + 1)
            for s in itertools.combinations(range(n), size)}  # fmt: skip
    exact = np.array(shapley.shares(n, game.__getitem__, None))
    sampled = np.array([shapley.shares(n, game.__getitem__, shapley.orderings(n, 0, "g", i))
                        for i in range(400)])  # fmt: skip
    assert len(shapley.subsets(n, shapley.orderings(n, 0, "g", 0))) <= 17 < 57
    np.testing.assert_allclose(sampled.sum(1), game[frozenset(range(n))], rtol=1e-12)
    error = sampled.std(0, ddof=1) / np.sqrt(len(sampled))  # the mean's standard error
    assert (np.abs(sampled.mean(0) - exact) < 4 * error).all(), (sampled.mean(0), exact, error)
    assert (error < 0.1 * np.abs(exact).max()).all()  # and the mean is close


def test_the_table_has_the_new_columns_and_keeps_the_old(tables):
    columns = list(Claims.tables["claims"])
    assert list(tables["claims"].columns) == columns
    for old in ("effect", "baseline", "baseline_heads", "baseline_from", "p", "confirmed"):
        assert old in columns
    assert isinstance(tables["claims"], pd.DataFrame)
