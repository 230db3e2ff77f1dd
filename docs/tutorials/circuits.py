# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Circuits: found by attribution, confirmed by patching
#
# The [head-types tutorial](../head_types/) found an induction circuit in the small GPT-2 of
# `tests/data/induction-gpt2` from attention patterns and confirmed it by ablation. Here the same
# circuit is found without looking at any pattern: from **prompt pairs** that differ in what the
# circuit needs, a **metric** of the output, gradient **attribution** to rank every head and every
# edge between components, and **exact patching** to confirm what the gradients suggest.

# %%
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import probe

MODEL = Path(probe.__file__).parents[1] / "tests" / "data" / "induction-gpt2"
model, tokenizer = probe.load(str(MODEL), lm_head=True)

# %% [markdown]
# ## A task of prompt pairs
#
# Clean: BOS, A, A (A is 20 random tokens); corrupted: BOS, A′, A, whose first half is other
# tokens, so the second copy cannot be predicted. The metric, per pair, is the mean
# log-probability of the second copy's predictable tokens. This is what `probe analyze
# --analyses circuit --lm-head` does by default (`--task repeats`).
#
# The inputs and the metric are as TransformerLens takes them: token ids `[pairs, pos]` (a dict
# of the model's keyword arguments works too, for a padded batch), and `metric(logits)`. A
# metric that returns one value per pair, as this one does, gives every estimate a 95% interval
# over the pairs; TransformerLens's usual batch mean, `metric(logits).mean()`, gives the same
# estimates without them (the results' `attrs["metric"]` says which).
# Memory is bounded by `max_bytes`, not by the pairs. It is by default the share
# <!-- generated: circuits.free_share -->50%<!-- end --> of the memory free on the model's device when the call starts (and
# <!-- generated: circuits.max_bytes -->1 GiB<!-- end --> where that cannot be read); the result's `attrs["max_bytes"]` says
# what was used. Where the pairs do not fit at
# once, the runs take a chunk of pairs at a time, and a metric that reads data of its own per
# pair, as this one reads `targets`, takes them as `metric(logits, pairs)`, `targets[pairs]`;
# one of the logits alone is refused then, in one line, rather than given the wrong pairs' data.

# %%
n, pairs = 20, 16
g = torch.Generator().manual_seed(0)
A = torch.randint(1, 64, (pairs, n), generator=g)
A_other = torch.randint(1, 64, (pairs, n), generator=g)
bos = torch.zeros(pairs, 1, dtype=torch.long)
clean = torch.cat([bos, A, A], dim=1)  # token ids, [pairs, pos]
corrupted = torch.cat([bos, A_other, A], dim=1)
targets = clean[:, n + 2 :]  # the second copy's tokens after its first


def metric(logits):
    """[pairs]: mean log-probability of the second copy's predictable tokens."""
    logp = logits.log_softmax(-1)[:, n + 1 : -1]  # positions that predict them
    return logp.gather(-1, targets[..., None])[..., 0].mean(-1)


# %% [markdown]
# ## Every head: attribution beside exact patching
#
# Patching a head means running the corrupted input with that head's output (`hook_z`) taken
# from the clean run: its `effect` is how much of the metric comes back. `probe.patch` does this
# exactly, one forward pass per head; `probe.attribute` estimates every head's effect at once
# from one forward and one backward pass (attribution patching, AtP), which is what makes large
# models affordable. Both give means over pairs with 95% intervals.

# %%
attributed = probe.attribute(model, clean, corrupted, metric)
patched = probe.patch(model, clean, corrupted, metric)
print(f"metric: clean {patched.attrs['clean']:.2f}, corrupted {patched.attrs['corrupted']:.2f}")
both = patched[["layer", "head", "effect", "effect_low", "effect_high"]].assign(
    attribution=attributed.attribution
)
both.round(3)

# %%
fig, ax = plt.subplots(figsize=(4, 3.5))
ax.scatter(both.attribution, both.effect)
for row in both.itertuples():
    ax.annotate(f"{row.layer}-{row.head}", (row.attribution, row.effect), fontsize=8)
ax.axline((0, 0), slope=1, color="grey", lw=0.5)
ax.set(xlabel="attribution (AtP)", ylabel="exact patching effect")
plt.show()

# %%
# The four layer-1 heads carry the effect, by exact patching and by attribution alike.
top_patched = set(both.nlargest(4, "effect")[["layer", "head"]].itertuples(index=False))
top_attributed = set(both.nlargest(4, "attribution")[["layer", "head"]].itertuples(index=False))
assert top_patched == top_attributed == {(1, h) for h in range(4)}
assert (both.query("layer == 1").effect_low > 0).all()  # each one's interval above 0

# %% [markdown]
# ## Edges, and the circuit
#
# A head's effect does not say *how* it gets its information. `probe.edges` scores every edge
# from a sender's output (the embeddings, a head, an MLP) into a receiver's input (a head's
# query, key or value, an MLP, the logits) by edge attribution: the estimated change of the
# metric when that edge alone is restored to its clean value in the corrupted run. Its methods,
# and which it takes by default, are in [its reference](../../reference/api/#probe.interventions.edge_scores.edges).

# %%
scores = probe.edges(model, clean, corrupted, metric)
strongest = scores.reindex(scores.score.abs().sort_values(ascending=False).index)
strongest.head(12).round(3)

# %% [markdown]
# `probe.circuit` keeps the fewest top edges whose circuit reaches the asked faithfulness
# (0.8: 80% of the way from the corrupted metric to the clean one), and measures every circuit
# **exactly**: the edges outside it are patched to their corrupted values in one run, so the
# faithfulness curve is no estimate.

# %%
circuit, curve = probe.circuit(model, clean, corrupted, metric, faithfulness=0.8, scores=scores)
print(f"{len(circuit)} of {len(scores)} edges reach {curve.attrs['target']:.0%} faithfulness")
fig, ax = plt.subplots(figsize=(4, 3))
ax.plot(curve.edges, curve.faithfulness, marker=".")
ax.axhline(0.8, color="grey", lw=0.5)
ax.set(xlabel="top edges kept", ylabel="faithfulness (exact)")
plt.show()
circuit.round(3)

# %%
reached = curve.set_index("edges").faithfulness[len(circuit)]
assert reached >= 0.8 and len(circuit) < len(scores) / 2
# The induction circuit's signature: the previous-token head 0-0 feeds the *keys* of the
# layer-1 heads (K-composition), and the layer-1 heads write the answer into the logits.
keys = circuit.query("sender == '0-0' and input == 'k'").receiver
assert {"1-0", "1-1", "1-2", "1-3"} <= set(keys)
assert {"1-0", "1-1", "1-2", "1-3"} <= set(circuit.query("receiver == 'logits'").sender)

# %% [markdown]
# ## How far to trust it
#
# A circuit is one draw from the pairs, measured under one choice of what the edges left out
# carry. `probe.circuit` says how far either matters, in `curve.attrs["trust"]` (a `Trust`),
# with no extra run for the first part:
#
# - **Stability.** The pairs are resampled (`resamples`, 100 by default: a Poisson bootstrap
#   keyed by `seed`) and the edges re-ranked on each resample from the per-pair scores that
#   `probe.edges` already summed. `trust.stability` gives each edge's *inclusion*, the share of
#   resampled circuits (of this circuit's size) that hold it, and `stable` at 90% or more;
#   `trust.jaccard` is the mean overlap of the resampled circuits with this one, with a 95%
#   interval. Circuits found on GPT-2 small's IOI overlap by a mean Jaccard of only 0.67
#   (Méloux et al. 2025): a low Jaccard says the edges beyond the stable ones are one draw.
# - **Each ablation.** Faithfulness moves with what the edges left out carry (Miller et al.
#   2024): the corrupted run's values (patching, the default), their mean over the clean runs,
#   zero, or another pair's clean run (resample ablation). `trust.ablations` measures every
#   one at MIB's circuit sizes and at the circuit's, each normalised by its own run with no edge
#   kept, with a 95% interval over 10 bootstrap resamples; `ablation=` chooses which one
#   searches for the circuit, and `trust.disagreement` is a sentence where two intervals do not
#   overlap.
# - **MIB's scores.** `trust.scores` gives each ablation's CPR, the area under its faithfulness
#   curve (higher is better), and CMD, the area between the curve and 1 (0 is best), as the MIB
#   benchmark defines them (Mueller et al. 2025, arXiv 2504.13151): the trapezoidal rule over
#   the circuit sizes `MIB_SIZES`, the share of edges kept from 0.1% to 100%, on that share
#   itself as the axis.
# - **The worst pairs.** `trust.pairs` is each pair's faithfulness under the chosen ablation;
#   a mean of 0.8 can hide pairs the circuit does not explain at all.

# %%
trust = curve.attrs["trust"]
print(
    f"Jaccard {trust.jaccard:.2f} [{trust.jaccard_low:.2f}, {trust.jaccard_high:.2f}];",
    f"{int(trust.stability.stable.iloc[circuit.index].sum())} of {len(circuit)} edges stable",
)
print(trust.disagreement)
trust.scores.round(3)

# %%
fig, ax = plt.subplots(figsize=(4, 3))
for name, part in trust.ablations.groupby("ablation", sort=False):
    ax.plot(part.edges, part.faithfulness, marker=".", label=name)
    ax.fill_between(part.edges, part.low, part.high, alpha=0.2)
ax.set(xlabel="top edges kept", ylabel="faithfulness")
ax.legend(title="ablation")
plt.show()

# %%
# The previous-token head's edges into the induction heads' keys are in every resampled circuit.
s = trust.stability
into_keys = s.query("sender == '0-0' and input == 'k' and receiver.str.startswith('1-')")
assert (into_keys.inclusion >= 0.9).all()
# Each ablation keeps its ends: 1 with every edge, 0 with none (its own normaliser).
ends = trust.ablations[trust.ablations.edges.isin([0, len(scores)])]
assert ((ends.faithfulness - (ends.edges > 0)).abs() < 1e-6).all()
print("worst pairs:", trust.worst.worst, "share below 0.5:", trust.worst.below_half)

# %% [markdown]
# Read them together: the circuit holds where its edges are stable and its faithfulness under
# corrupted patching is high with a narrow interval. That the mean and zero ablations give far
# less here is no fault of the circuit: the mean of the induction heads' inputs over random
# tokens, or zero, is nothing the model ever saw, so the edges left out then break the model
# rather than remove information; the resample ablation, a real run of another pair, falls
# between. The page of `probe analyze -a circuit` says all of this in one sentence.

# %% [markdown]
# The circuit is the one the patterns showed: embeddings into the layer-0 heads' values, the
# previous-token head 0-0 into every layer-1 head's key (it tells each position which token came
# before it, so that a query can find "the position after my earlier copy"), and the layer-1
# heads' copies into the logits.
#
# From the command line, `probe analyze --model tests/data/induction-gpt2 --lm-head --analyses
# circuit` writes the same tables (`circuit_heads.csv`, `circuit_edges.csv`,
# `circuit_faithfulness.csv`, the trust's `circuit_stability.csv`, `circuit_ablations.csv`,
# `circuit_scores.csv` and `circuit_pairs.csv`, with Q-, K- and V-composition from the weights beside random
# baselines in `circuit_composition.csv`) and draws the graph; `--task pairs.jsonl` takes pairs
# of your own ([analysis reference](../../reference/analyses/#circuit)).

# %% [markdown]
# ## Why a layer-1 head attends where it does
#
# The circuit says that 0-0 feeds the layer-1 heads' keys; `probe.qk_attribution` says how much
# of each attention score it writes. Each score at the induction positions (from the second
# copy's token to the token after its first copy) is split into query-side source times
# key-side source, with the norms' scales frozen at the clean run's, and the terms sum to the
# score ([the Python guide](../../guide/python/#why-a-head-attends-where-it-does)). Summed over
# the query side, the key's largest source is 0-0; the query's is the layer-0 MLP, through
# which this small GPT-2 carries the current token's identity. Composition scores
# (`probe.composition_scores`) say the same from the weights alone, over every input.

# %%
induction = {i: i - n + 1 for i in range(n + 1, 2 * n + 1)}
terms = probe.qk_attribution(model, clean, heads=[(1, 1)], key_positions=induction)
key_side = probe.qk_means(terms, side="key")
key_side.head(4).round(2)

# %%
assert key_side.key_source.iloc[0] == "0-0"
assert (terms.attrs["scores"].key_top == "0-0").mean() >= 0.9
