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
# # Long inputs without T × T patterns
#
# One layer of a 32-head model's attention at 32k tokens is 32 × 32,768² floats: 128 GiB. probe
# never needs that whole: the model runs its own fast kernel (sdpa), the queries and keys that
# meet in its scores are captured beside it, and patterns are computed from them a block of
# query rows at a time, each block within a memory budget.
#
# This tutorial does it on a model small enough to build here: a random Llama (rotary positions,
# grouped-query attention), on an input whose patterns would take 64 times the budget we give it.

# %%
import torch
import transformers as tf

import probe

torch.manual_seed(0)
config = tf.LlamaConfig(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=1000, max_position_embeddings=8192,
)  # fmt: skip
model = tf.LlamaForCausalLM(config).eval()

T = 4096
ids = torch.randint(0, config.vocab_size, (1, T), generator=torch.Generator().manual_seed(1))
whole = config.num_hidden_layers * config.num_attention_heads * T * T * 4  # float32 bytes
budget = "8MiB"
print(f"every layer's whole pattern: {whole / 2**20:,.0f} MiB; the budget: {budget}")
assert whole >= 64 * 8 * 2**20

# %% [markdown]
# ## Each head's statistics, streamed
#
# `probe.head_statistics` runs the model once and, layer by layer, computes each block of query
# rows from the captured queries and keys, keeps sums, and drops the block: per head, the mean
# over queries of the entropy of its attention, its largest weight (`confidence`), its weight on
# position 0 (`first`, the sink), on itself and on the previous token, and the attended distance.

# %%
stats = probe.head_statistics(model, ids, budget=budget)
stats.round(3)

# %% [markdown]
# A freshly initialised model's weights are small, so every head attends almost uniformly over
# the keys it may see: query i spreads over i + 1 keys. That gives two numbers to check the
# streamed statistics against, computed by hand: the mean entropy is the mean of ln(i + 1), and
# the mean attended distance the mean of i / 2.

# %%
positions = torch.arange(T, dtype=torch.float64)
uniform_entropy = torch.log(positions + 1).mean().item()
uniform_distance = (positions / 2).mean().item()
print(f"uniform attention: entropy {uniform_entropy:.3f} nats, distance {uniform_distance:.1f}")
assert (stats.entropy - uniform_entropy).abs().max() < 0.01
assert ((stats.distance - uniform_distance).abs() / uniform_distance).max() < 0.01
assert (stats.queries == T).all()

# %% [markdown]
# ## Any rows of any layer
#
# `probe.attention_rows` gives the pattern of chosen query rows, `[batch, head, rows, k_pos]`,
# here the last 64 queries of layer 1, without the 4,032 rows before them.

# %%
last = probe.attention_rows(model, ids, layer=1, rows=slice(T - 64, T))
print(tuple(last.shape), "rows sum to", last.sum(-1).mean().item())
assert last.shape == (1, config.num_attention_heads, 64, T)
torch.testing.assert_close(last.sum(-1), torch.ones(1, 4, 64), rtol=0, atol=1e-5)  # rows sum to 1

# %% [markdown]
# ## Exact, not approximate
#
# The rows are the model's own pattern, not an estimate. The model is causal, so the rows of
# queries 1000 to 1063 do not depend on anything after position 1063: a full trace of the first
# 1,064 tokens (small enough to hold whole) must give the same numbers.

# %%
rows = probe.attention_rows(model, ids, layer=1, rows=slice(1000, 1064))
with probe.trace(model, "hook_pattern") as cache:
    model(ids[:, :1064])
reference = cache["pattern", 1][:, :, 1000:1064]  # [batch, head, 64, 1064]
difference = (rows[..., :1064] - reference).abs().max().item()
print(f"largest difference from the full pattern: {difference:.1e}")
assert difference < 1e-6 and rows[..., 1064:].abs().max() == 0  # no weight on future keys

# %% [markdown]
# The same holds for the statistics: on an input short enough to trace whole, the streamed entropy
# equals the entropy computed from the full patterns.

# %%
short = ids[:, :512]
with probe.trace(model, "hook_pattern") as cache:
    model(short)
p = torch.stack([cache["pattern", layer][0] for layer in range(2)])  # [layer, head, q, k]
entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1).mean(-1).flatten()  # [layer·head]
streamed = probe.head_statistics(model, short, budget="64KiB").entropy
largest = entropy.abs().max().item()  # nats; float32 rounding scales with it
torch.testing.assert_close(
    entropy.double(), torch.tensor(streamed.to_numpy()), rtol=0, atol=1e-5 * largest
)
print(f"streamed and whole-pattern entropies agree within {1e-5 * largest:.0e} nats")

# %% [markdown]
# On the command line, the analyses that keep sums (roles, taxonomy) read long inputs the same
# way, each block within `--attention-budget`; a plain-text `--corpus` with a long `--context`
# is how to give them long inputs. See [Long inputs](../../guide/long-inputs/).
