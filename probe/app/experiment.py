"""``probe experiment heads``: train the variants of ``probe.experiment`` and write a folder with
``experiment.csv``, ``curves.csv``, ``run.json`` and a self-contained ``index.html``."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure as MplFigure

from analyses.figures import Figure
from probe import experiment as science
from probe.app.output import reserved
from probe.app.report import embed, environment
from probe.app.run import package_versions

COLOURS = {"narrow": "#2f5fd0", "wide": "#c2410c", "bilinear": "#15803d", "shared": "#9333ea"}


def run(
    out: Path,
    steps: int,
    seeds: list[int],
    overwrite: bool = False,
    progress: Callable[[science.Run], None] = lambda run: None,
) -> Path:
    """Train every (task, variant, seed) and write the folder ``out`` (replaced only if it is
    probe's and ``overwrite``); returns its path."""
    with reserved(out, overwrite) as folder:
        started = time.perf_counter()
        tables = science.run(steps, seeds, progress)
        seconds = time.perf_counter() - started
        for name, table in tables.items():
            table.to_csv(folder / f"{name}.csv", index=False, float_format="%.6g")
        card = {
            "experiment": "heads",
            "steps": steps,
            "seeds": seeds,
            "d_model": science.D_MODEL,
            "heads": science.N_HEADS,
            "keys": science.KEYS,
            "values": science.VALUES,
            "length": science.LENGTH,
            "batch": science.BATCH,
            "learning_rate": science.LEARNING_RATE,
            "variants": science.VARIANTS,
            "tasks": {t: [science.RELATION_NAMES[o] for o in r] for t, r in science.TASKS.items()},
            "train_seconds": round(seconds, 1),
            "packages": package_versions(),
            "command": " ".join(["probe", *sys.argv[1:]]) if sys.argv else "probe experiment",
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        (folder / "run.json").write_text(json.dumps(card, indent=2), encoding="utf-8")
        html = render(card, tables["experiment"], tables["curves"])
        (folder / "index.html").write_text(html, encoding="utf-8")
    return out


def render(card: dict, experiment: pd.DataFrame, curves: pd.DataFrame) -> str:
    env = environment()
    figures = [learning_curves(curves), trade_off(experiment), ranks(experiment),
               specialisation(experiment)]  # fmt: skip
    html = [{"figure": f, "html": embed(f)} for f in figures]
    summary = science.summary(experiment)
    return env.get_template("experiment.html.j2").render(
        run=card,
        answers=science.answers(experiment),
        figures=html,
        summary=summary.to_dict("records"),
    )


def learning_curves(curves: pd.DataFrame) -> Figure:
    tasks = list(science.TASKS)
    fig = MplFigure(figsize=(10, 3.2))
    margins = {"left": 0.07, "right": 0.99, "bottom": 0.16, "top": 0.88}
    axes = fig.subplots(1, len(tasks), sharey=True, gridspec_kw=margins)
    for ax, task in zip(axes, tasks, strict=True):
        part = curves[curves.task == task]
        for variant, colour in COLOURS.items():
            mean = part[part.variant == variant].groupby("step").loss.mean()
            ax.plot(mean.index, mean.to_numpy(), color=colour, label=variant)
        ax.set_yscale("log")
        ax.set_title(task.replace("_", " "))
        ax.set_xlabel("step")
    axes[0].set_ylabel("training loss (mean over seeds)")
    axes[0].legend(fontsize="small")
    alt = "Learning curves, one panel per task, one line per variant."
    return Figure("curves", "Learning curves", alt, fig, "svg")


def trade_off(experiment: pd.DataFrame) -> Figure:
    summary = science.summary(experiment)
    fig = MplFigure(figsize=(6, 3.6))
    ax = fig.subplots(gridspec_kw={"left": 0.13, "right": 0.97, "bottom": 0.15, "top": 0.9})
    markers = dict(zip(science.TASKS, "osD", strict=True))
    for row in summary.itertuples():
        ax.scatter(row.attention_parameters, row.accuracy, color=COLOURS[row.variant],
                   marker=markers[row.task], s=40)  # fmt: skip
    for variant, colour in COLOURS.items():
        ax.scatter([], [], color=colour, label=variant)
    for task, marker in markers.items():
        ax.scatter([], [], color="#888", marker=marker, label=task.replace("_", " "))
    ax.set_xscale("log")
    ax.set_xlabel("attention parameters")
    ax.set_ylabel("held-out accuracy")
    ax.set_title("Accuracy against parameters")
    ax.legend(fontsize="x-small", ncols=2)
    alt = "Scatter plot of held-out accuracy against attention parameters, per variant and task."
    return Figure("trade-off", "Accuracy against parameters", alt, fig, "svg")


def ranks(experiment: pd.DataFrame) -> Figure:
    summary = science.summary(experiment)
    fig = MplFigure(figsize=(6, 3.4))
    ax = fig.subplots(gridspec_kw={"left": 0.12, "right": 0.97, "bottom": 0.15, "top": 0.9})
    tasks, variants = list(science.TASKS), list(COLOURS)
    width = 0.8 / len(variants)
    for i, variant in enumerate(variants):
        rows = summary[summary.variant == variant].set_index("task").reindex(tasks)
        x = [t + (i - 1.5) * width for t in range(len(tasks))]
        ax.bar(x, rows.qk_effective_rank, width, color=COLOURS[variant], label=variant)
        ax.scatter(x, rows.qk_rank_possible, color="#222", marker="_", s=60)
    ax.set_xticks(range(len(tasks)), [t.replace("_", " ") for t in tasks])
    ax.set_ylabel("effective rank of W_i^Q W_i^Kᵀ")
    ax.set_title("Rank of the learned QK circuit (ticks: the most possible)")
    ax.legend(fontsize="x-small")
    alt = "Bar chart of the mean effective rank of each variant's learned QK circuit, per task."
    return Figure("ranks", "Rank of the learned W_i", alt, fig, "svg")


def specialisation(experiment: pd.DataFrame) -> Figure:
    """What each head of the first seed's four-relation models attends to."""
    part = experiment[(experiment.task == "four_relations")
                      & (experiment.seed == experiment.seed.min())]  # fmt: skip
    relations = [c for c in part.columns if c.startswith("attention_on_")]
    relations = [c for c in relations if part[c].notna().all()]
    fig = MplFigure(figsize=(10, 2.6))
    axes = fig.subplots(1, len(COLOURS), gridspec_kw={"left": 0.1, "right": 0.99, "bottom": 0.3,
                                                      "top": 0.85, "wspace": 0.1})  # fmt: skip
    labels = [c.removeprefix("attention_on_").replace("_", " ") for c in relations]
    for ax, variant in zip(axes, COLOURS, strict=True):
        grid = part[part.variant == variant].set_index("head")[relations].to_numpy()
        ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_title(variant, fontsize="medium")
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize="x-small")
        ax.set_yticks(range(len(grid)), [f"head {h}" for h in range(len(grid))] if ax is axes[0]
                      else [], fontsize="x-small")  # fmt: skip
    alt = "Heatmaps of each head's mean attention on each relation's target, per variant."
    return Figure("heads", "What each head attends to (four relations, first seed)", alt, fig)
