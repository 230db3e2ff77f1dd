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
# # From TransformerLens to probe
#
# probe's hook points are TransformerLens's: the same names, shapes and meanings, and a cache
# with the same indexing and methods. The difference is where they live: TransformerLens
# wraps a model in its own classes (`HookedTransformer`, or in version 4 `TransformerBridge`),
# while probe mirrors its points onto the Hugging Face model you already have, only while a
# `with` block runs, and leaves the model untouched otherwise.
#
# Here both run side by side on one model, a small GPT-2 (`tests/data/induction-gpt2`, shipped
# with probe's source), so every line of TransformerLens can be checked against its probe
# counterpart.
#
# It needs TransformerLens, probe's `parity` extra: `pip install -e '.[parity]'`. Without it
# the first cell stops in one line saying so.
#
# | TransformerLens | probe |
# |---|---|
# | `logits, cache = model.run_with_cache(tokens)` | `with probe.trace(model) as cache: logits = model(tokens).logits` |
# | `utils.get_act_name("pattern", 1)` | `probe.capture.names.act_name("pattern", 1)` |
# | `cache["pattern", 1]` | `cache["pattern", 1]` |
# | `model.run_with_hooks(tokens, fwd_hooks=[(name, fn)])` | `with probe.hooks(model, [(name, fn)]): model(tokens)` |
# | `cache.accumulated_resid()`, `decompose_resid()`, `stack_head_results()`, `logit_attrs()` | the same methods on probe's cache |
# | `model.cfg.n_layers` | `probe.capture.spec.describe(model).n_layers` |
# | `patching.get_act_patch_attn_head_out_all_pos(model, corrupted_tokens, clean_cache, metric)` | `probe.patch(model, clean_tokens, corrupted_tokens, metric)` |

# %%
import copy
from pathlib import Path

import torch

try:
    from transformer_lens.model_bridge import TransformerBridge
    from transformer_lens.utilities import get_act_name
except ImportError as missing:
    raise SystemExit(
        f"this tutorial runs TransformerLens beside probe ({missing}): "
        "install probe's parity extra, pip install -e '.[parity]'"
    ) from None

import probe
from probe.capture.names import act_name
from probe.capture.spec import describe

MODEL = Path(probe.__file__).parents[1] / "tests" / "data" / "induction-gpt2"
model, tokenizer = probe.load(str(MODEL), lm_head=True)  # a Hugging Face GPT2LMHeadModel
bridge = TransformerBridge.boot_transformers(
    "gpt2", hf_model=copy.deepcopy(model), tokenizer=tokenizer, device="cpu"
)  # TransformerLens's wrapper of the same weights
tokens = torch.tensor([[0, 5, 9, 12, 7, 5, 9, 12, 7]])  # BOS, then a sequence repeated
print(describe(model))

# %% [markdown]
# ## Names
#
# TransformerLens builds every name with `get_act_name`; probe's `act_name` takes the same short
# forms and gives the same names (`hook_name` and `parse` build and split them by parts).

# %%
for short in [("pattern", 1), ("z", 0), ("resid_pre", 1), ("scale", 0, "ln1"), ("pre", 1)]:
    print(f"{short!s:22} {get_act_name(*short):28} {act_name(*short)}")
    assert get_act_name(*short) == act_name(*short)

# %% [markdown]
# ## Caching: run_with_cache becomes probe.trace
#
# Where TransformerLens's `run_with_cache` runs the model and returns its cache, `probe.trace`
# caches while the body runs the model as usual; the model's own output is
# unchanged (a trace that edits nothing leaves it bit for bit as it was). Give names or suffixes
# to cache only some points (`probe.trace(model, ["hook_pattern", "hook_z"])`).

# %%
logits_tl, cache_tl = bridge.run_with_cache(tokens)
with probe.trace(model) as cache:
    logits = model(tokens).logits

name = get_act_name("pattern", 1)
print(name, tuple(cache[name].shape), "[batch, head, q_pos, k_pos]")
difference = (cache_tl[name] - cache["pattern", 1]).abs().max().item()
print(f"largest difference, pattern: {difference:.1e}; logits: "
      f"{(logits_tl - logits).abs().max().item():.1e}")  # fmt: skip
assert difference < 1e-5
# float32 sums of many terms: a tolerance scaled to the largest logit, not to each one
torch.testing.assert_close(logits, logits_tl, rtol=1e-5, atol=1e-5 * logits_tl.abs().max().item())
shared = [n for n in cache_tl.keys() if n in cache]  # noqa: SIM118 (not a dict)
assert all(cache_tl[n].shape == cache[n].shape for n in shared)
print(f"{len(shared)} points of TransformerLens's cache are in probe's, with the same shapes")

# %% [markdown]
# ## The cache's methods
#
# The residual stream, layer by layer and component by component, and each head's output, as
# TransformerLens's `ActivationCache` gives them.

# %%
for method, kwargs in [
    ("accumulated_resid", {"incl_mid": True}),
    ("decompose_resid", {}),
    ("stack_head_results", {"layer": -1}),
]:
    theirs, labels = getattr(cache_tl, method)(return_labels=True, **kwargs)
    ours, our_labels = getattr(cache, method)(return_labels=True, **kwargs)
    gap = (theirs - ours).abs().max().item()
    print(f"{method}: {tuple(ours.shape)}, {our_labels[:4]}…, largest difference {gap:.1e}")
    assert labels == our_labels and gap < 1e-3

# %% [markdown]
# `logit_attrs` projects components onto the unembedding direction of a token: here each head's
# direct contribution, at the last position, to the logit of the token an induction head should
# predict there (the last token, 7, was followed by 5 the first time).

# %%
answer = tokens[0, 5]
heads, labels = cache.stack_head_results(layer=-1, return_labels=True, pos_slice=-1)
attrs = cache.logit_attrs(heads, tokens=answer, pos_slice=-1)
attrs_tl = cache_tl.logit_attrs(
    cache_tl.stack_head_results(layer=-1, pos_slice=-1), tokens=answer, pos_slice=-1
)
print(
    {label: round(value, 2) for label, value in zip(labels, attrs.flatten().tolist(), strict=True)}
)
torch.testing.assert_close(attrs, attrs_tl, rtol=1e-4, atol=1e-4 * attrs_tl.abs().max().item())
assert attrs.flatten()[4:].sum() > 0  # layer 1's heads, together, push the answer up

# %% [markdown]
# ## Hooks that edit
#
# A hook is called as TransformerLens calls it, `fn(activation, hook)`, and may return a
# replacement. `probe.hooks` takes a mapping of names to functions, or TransformerLens's list of
# `(name or predicate, fn)` pairs; the hooks are removed when the block ends, also on error.


# %%
def zero_head_1(z, hook):
    z[:, :, 1] = 0.0  # [batch, pos, head, d_head]
    return z


edited_tl = bridge.run_with_hooks(tokens, fwd_hooks=[(get_act_name("z", 1), zero_head_1)])
with probe.hooks(model, [(get_act_name("z", 1), zero_head_1)]):
    edited = model(tokens).logits
torch.testing.assert_close(edited, edited_tl, rtol=1e-5, atol=1e-5 * edited_tl.abs().max().item())
assert (edited - logits).abs().max() > 1e-2 * logits.abs().max()  # the edit reached the output
print(f"largest change of a logit from zeroing head 1-1: {(edited - logits).abs().max():.2f}")
assert torch.equal(model(tokens).logits, logits)  # outside the block, the model is as it was

# %% [markdown]
# ## Patching with a TransformerLens metric
#
# probe's patching, attribution, edges and circuits take prompts and metrics as TransformerLens
# does: token tensors (or a dict of the model's keyword arguments, for a padded batch), and
# `metric(logits)`. A metric that returns the batch mean, TransformerLens's habit, gives the
# estimates alone; one that returns a value per pair gives the same estimates with a 95%
# interval over the pairs (`attrs["metric"]` says which form ran).

# %%
clean_tokens = torch.tensor([[0, 5, 9, 12, 7, 5, 9, 12], [0, 3, 8, 30, 2, 3, 8, 30]])
corrupted_tokens = torch.tensor([[0, 40, 41, 42, 43, 5, 9, 12], [0, 50, 51, 52, 53, 3, 8, 30]])
answers = torch.tensor([7, 2])  # what follows the repeated tokens in the first copy


def metric(logits):  # as written for TransformerLens: one scalar, the mean over the batch
    return logits[:, -1].log_softmax(-1).gather(-1, answers[:, None]).mean()


def per_pair(logits):  # the same, one value per pair
    return logits[:, -1].log_softmax(-1).gather(-1, answers[:, None])[:, 0]


scalar = probe.patch(model, clean_tokens, corrupted_tokens, metric)
each = probe.patch(model, clean_tokens, corrupted_tokens, per_pair)
# The same effects to float32 rounding, which scales with the largest effect, not with each one
largest = scalar.effect.abs().max()
torch.testing.assert_close(
    torch.tensor(each.effect.values),
    torch.tensor(scalar.effect.values),
    rtol=1e-5,
    atol=1e-5 * largest,
)
each.sort_values("effect", ascending=False).head(3).round(3)

# %% [markdown]
# What probe adds on top of the shared vocabulary: the points on many architectures
# ([Hook points](../../reference/hooks/)), analyses with intervals and nulls
# ([Analyses](../../guide/analyses/)), patching, attribution and circuits
# ([Circuits](../circuits/)). Where TransformerLens 4's bridge departs from TransformerLens's own
# definitions (on BERT, say, its `hook_attn_scores` is after the softmax), probe keeps the
# documented ones; `tests/capture/test_tl_parity.py` lists each departure.
