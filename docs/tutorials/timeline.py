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
# # Watching induction heads form
#
# Induction heads appear in a phase change, together with a sudden fall of the loss on text that
# repeats (Olsson et al. 2022). `probe timeline` shows it on a model's checkpoints: it runs the
# analyses on each checkpoint in turn, in one process (the inputs read and tokenized once, one
# model in memory at a time), and writes when each head gained each role.
#
# The checkpoints here are those of the small GPT-2 of the *Head types* tutorial (2 layers × 4
# heads, a vocabulary of 64 symbols), saved along its training on repeated random sequences:
# the initialisation, step 2000, every 250 steps through the fall of the loss, and step 4500,
# ten `checkpoint-N/` folders as a trainer writes them (`tests/data/induction-gpt2-steps`, made
# by `tests/support/make_induction_checkpoints.py`, which trains the model again from its seed
# in a few minutes). A folder of your own trainer's checkpoints, or a hub model's revisions
# (`--revisions step{0..143000..1000}`), is read the same way.
#
# The command is the one you would type in a terminal, run here by this Python (`python -m
# probe.app.cli` is the `probe` command) so that the notebook also runs as a script:
#
#     probe timeline tests/data/induction-gpt2-steps -a taxonomy -t sample --lm-head \
#         --repeat-length 20 --out timeline
#
# `-a taxonomy` scores every head's previous-token, induction, duplicate-token and copying
# behaviour on repeated random sequences (20 tokens a copy, within the lengths trained on);
# `--lm-head` loads the language-model head too, so that the timeline also measures the loss
# on the second copy of those sequences, the loss an induction head lowers.

# %%
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

import probe
from probe import plot

STEPS = Path(probe.__file__).parents[1] / "tests" / "data" / "induction-gpt2-steps"
out = Path(tempfile.mkdtemp()) / "timeline"
command = [sys.executable, "-m", "probe.app.cli"]  # the probe command
done = subprocess.run(
    [*command, "timeline", str(STEPS), "-a", "taxonomy", "-t", "sample", "--lm-head",
     "--repeat-length", "20", "--out", str(out), "--quiet"],
    capture_output=True, text=True,
)  # fmt: skip
print(done.stdout, done.stderr)
assert done.returncode == 0

# %% [markdown]
# The folder holds each checkpoint's own report under `steps/` (as `probe analyze` writes it),
# the timeline's tables, `run.json` and a page (`index.html`).

# %%
print(sorted(p.name for p in out.iterdir()))
print(sorted(p.name for p in (out / "steps").iterdir()))

# %% [markdown]
# ## The loss on repeated tokens
#
# `steps.csv` has a row per checkpoint: its weights' SHA-256 (two identical checkpoints would be
# flagged) and, with `--lm-head`, the mean loss on each copy of the repeated sequences. The
# first copy is random: no head can predict it, and its loss stays near log 63 ≈ 4.14. The
# second copy can be predicted by looking back; its loss falls from step 2000 on.

# %%
steps = pd.read_csv(out / "steps.csv")
steps[["step", "loss_first_copy", "loss_second_copy"]].round(2)

# %%
loss = steps.set_index("step").loss_second_copy
falls = -loss.diff()
steepest = int(falls.idxmax())
print(f"the loss on the second copy falls most in the 250 steps before step {steepest}: "
      f"from {loss.shift(1)[steepest]:.2f} to {loss[steepest]:.2f}")  # fmt: skip

# %% [markdown]
# ## When each head's role formed
#
# `onsets.csv` has a row per head and role: the first step from which the head holds the role
# at every later checkpoint (`onset`), and the step at which its score rose most.

# %%
onsets = pd.read_csv(out / "onsets.csv")
onsets

# %%
induction = onsets[onsets.role == "induction"]
print("induction heads:", [f"{r.layer}-{r.head}" for r in induction.itertuples()],
      "from step", int(induction.onset.min()))  # fmt: skip
# The induction heads form exactly where the loss on the second copy falls most.
assert int(induction.onset.min()) == steepest

# %% [markdown]
# The page says the same in words, in the order the roles formed:

# %%
card = json.loads((out / "run.json").read_text())
for sentence in card["sentences"]:
    print(sentence)

# %% [markdown]
# ## The scores themselves
#
# A role is a threshold on a score; the scores show how the change happened. `timeline.csv` has
# a row per step and head with every per-head column of the steps' `heads.csv`. Layer 1's four
# heads gain their induction score together, between steps 2250 and 3000; layer 0's
# previous-token scores begin to rise in the same steps, but spread over its four heads at first
# (about 0.2 each at step 2750) and concentrate into two of them later, so the previous-token
# *role* (a threshold per head) is reached one checkpoint after the induction role here, while
# the previous-token *attention* of the layer as a whole rises with induction.

# %%
timeline = pd.read_csv(out / "timeline.csv")
wide = timeline.pivot_table(index="step", columns=["layer", "head"],
                            values=["previous_token_score", "induction_score"])  # fmt: skip
layer0 = wide["previous_token_score"][0].sum(axis=1)
layer1 = wide["induction_score"][1].sum(axis=1)
pd.DataFrame({"layer 0 previous-token (sum)": layer0, "layer 1 induction (sum)": layer1}).round(2)

# %%
fig, axes = plt.subplots(1, 3, figsize=(11, 3), layout="constrained")
plot.timeline(out, "previous-token", ax=axes[0])
plot.timeline(out, "induction", ax=axes[1])
plot.timeline_loss(out, ax=axes[2])
plt.show()

# %% [markdown]
# `probe figures` draws the same charts with seaborn for a paper
# (`probe figures timeline --format pdf`), one per role and one of the loss.
