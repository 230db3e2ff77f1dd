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
# # Head types in a decoder
#
# A decoder that has learned to continue repeated text usually does it with two heads in
# series (Olsson et al. 2022): a **previous-token head** writes "the token before me was A" into
# each position, and an **induction head** in a later layer looks, from the second copy of A,
# for the position whose previous token was A, and copies the token it finds there.
#
# This tutorial finds both in a small GPT-2 that was trained on repeated random sequences
# (`tests/data/induction-gpt2`, 2 layers × 4 heads, a vocabulary of 64 symbols; it ships with
# probe's source), scores every head with `probe.head_types`, reads each head's copying score
# from its weights with `probe.copying_scores`, and confirms the induction head by ablating it:
# if it does what its attention suggests, the loss on the second copy must rise when it is gone.

# %%
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import probe

MODEL = Path(probe.__file__).parents[1] / "tests" / "data" / "induction-gpt2"
model, tokenizer = probe.load(str(MODEL), lm_head=True)  # GPT-2 with its language-model head
print(type(model).__name__, "layers:", model.config.n_layer, "heads:", model.config.n_head)

# %% [markdown]
# ## Repeated sequences, and their null
#
# Each sequence is a BOS token (id 0), `n` random tokens, and the same `n` tokens again. On the
# second copy a head can find where each token came before; on the *null* (a second half of
# fresh tokens) it cannot. A score means something only beside its null.

# %%
n, batch = 20, 64
g = torch.Generator().manual_seed(0)
first = torch.randint(1, 64, (batch, n), generator=g)
fresh = torch.randint(1, 64, (batch, n), generator=g)
bos = torch.zeros(batch, 1, dtype=torch.long)
repeats = torch.cat([bos, first, first], dim=1)  # [batch, 1 + 2n]
nulls = torch.cat([bos, first, fresh], dim=1)
print(tokenizer.decode(repeats[0, :8]), "…")

# %% [markdown]
# ## Every head's scores
#
# `probe.head_types` traces the model on the sequences and averages, per head:
#
# - **previous-token**: the attention from each position i to i − 1;
# - **duplicate-token**: from the second copy's tokens to the same token in the first copy,
#   i − n;
# - **induction**: from the second copy's tokens to the token *after* their first occurrence,
#   i − n + 1.

# %%
scores = probe.head_types(model, repeats, n=n, nulls=nulls)
scores.round(3)

# %%
previous = scores.loc[scores.previous_token.idxmax()]
induction = scores.loc[scores.induction.idxmax()]
layer, head = int(induction.layer), int(induction["head"])
before_layer, before_head = int(previous.layer), int(previous["head"])
print(f"previous-token head: {before_layer}-{before_head} ({previous.previous_token:.2f})")
print(f"induction head: {layer}-{head} "
      f"({induction.induction:.2f}, null {induction.induction_null:.2f})")  # fmt: skip
# The circuit needs the previous-token head below the induction head, and the score must stand
# far above its null: the head attends there because the text repeats, not by position.
assert before_layer < layer
assert induction.induction > 0.5 > 10 * induction.induction_null

# %% [markdown]
# The induction head's attention on one sequence shows the stripe one below the diagonal of the
# second copy's block: each query looks n − 1 positions back.

# %%
with probe.trace(model, "hook_pattern") as cache:
    model(repeats[:1])
pattern = cache["pattern", layer][0, head]  # [q_pos, k_pos]
fig, ax = plt.subplots(figsize=(4.2, 4))
ax.imshow(pattern, cmap="Blues")
ax.set(title=f"head {layer}-{head} on a repeated sequence", xlabel="key", ylabel="query")
plt.show()

# %% [markdown]
# ## Copying, from the weights
#
# An induction head must also *copy*: the token it attends to should raise that same token's
# logit. The copying score reads this from the weights alone: the eigenvalues λ of the full OV
# circuit W_E W_V W_O W_U, Σ Re λ / Σ |λ|, near 1 for a head whose OV circuit maps each token
# onto itself.

# %%
copying = probe.copying_scores(model)
copying.round(3)

# %%
ours = copying.query("layer == @layer and head == @head").copying.item()
print(f"copying score of head {layer}-{head}: {ours:.2f}")
assert ours > 0.7  # the taxonomy's threshold for the role `copying`

# %% [markdown]
# ## Confirmed by ablation
#
# Attention and weights suggest a mechanism; an intervention tests it. The loss on the first copy
# is that of guessing among 63 tokens (ln 63 ≈ 4.14): nothing can be predicted. On the second
# copy's predictable tokens it is low, because of the circuit. `probe.ablate` zeroes the head's
# output (its `hook_z`) while the `with` block runs.


# %%
def copy_losses(ids):
    """Mean next-token loss over the first copy, and over the second copy's predictable tokens."""
    with torch.no_grad():
        logp = model(ids).logits.log_softmax(-1)
    loss = -logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]  # position i predicts i + 1
    return loss[:, :n].mean().item(), loss[:, n + 1 :].mean().item()


before = copy_losses(repeats)
with probe.ablate(model, [(layer, head)]):
    without_head = copy_losses(repeats)
with probe.ablate(model, [(before_layer, before_head)]):
    without_previous = copy_losses(repeats)
print(f"second copy's loss: {before[1]:.3f}; without head {layer}-{head}: {without_head[1]:.3f}; "
      f"without the previous-token head: {without_previous[1]:.3f}")  # fmt: skip
assert without_head[1] > 2 * before[1]  # the induction head carries the repeat's prediction
assert without_previous[1] > 5 * before[1]  # and it needs the previous-token head below it
assert abs(without_head[0] - before[0]) < 0.1  # the first copy was never predictable

# %% [markdown]
# The second copy's loss rises when the induction head is gone, and much more when the
# previous-token head is: the other layer-1 heads do the same work less well (their induction
# scores are close behind), so one head's ablation leaves part of the circuit standing, while
# every layer-1 head depends on the one previous-token head below them.
#
# The same scores come out of the command line, with intervals, nulls and roles:
# `probe analyze --model tests/data/induction-gpt2 --analyses taxonomy` writes `taxonomy.csv`
# (where head 0-0 holds the previous-token role: its score, 0.38 at the default n = 50, past the
# lengths it was trained on, and 0.86 at n = 20, lies far above the 0.04 and 0.08 that a head
# attending uniformly over the keys it sees would give the previous position)
# and a card per head (see the [analysis reference](../../reference/analyses/#taxonomy)). The
# [circuits tutorial](../circuits/) finds the same circuit by attribution and patching.
