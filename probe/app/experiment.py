"""``probe experiment heads``: train the variants of ``probe.app.training`` and write a folder with
``experiment.csv``, ``curves.csv``, ``run.json`` and a self-contained ``index.html``."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd

from analyses import svg
from analyses.figures import Figure
from probe.app import training as science
from probe.app.answers import PLATEAU, SAME_WITHIN, SOLVED, convergence
from probe.app.card import package_versions
from probe.app.output import reserved, write_file
from probe.app.page import environment
from probe.app.report import embed

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
    with reserved(out, overwrite, kind="experiment") as folder:
        started = time.perf_counter()
        tables = science.run(steps, seeds, progress)
        seconds = time.perf_counter() - started
        for name, table in tables.items():
            write_file(
                folder / f"{name}.csv",
                lambda tmp, t=table: t.to_csv(tmp, index=False, float_format="%.6g"),
            )
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
        write_file(folder / "run.json", json.dumps(card, indent=2))
        write_file(folder / "index.html", render(card, tables["experiment"], tables["curves"]))
    return out


def render(card: dict, experiment: pd.DataFrame, curves: pd.DataFrame) -> str:
    env = environment()
    figures = [learning_curves(curves), trade_off(experiment), ranks(experiment),
               specialisation(experiment)]  # fmt: skip
    html = [{"figure": f, "html": embed(f)} for f in figures]
    summary = science.summary(experiment)
    return env.get_template("experiment.html.j2").render(
        run=card,
        answers=science.answers_from(experiment, curves),
        convergence=convergence(experiment, curves).to_dict("records"),
        rules={"solved": SOLVED, "plateau": PLATEAU, "same_within": SAME_WITHIN},
        figures=html,
        summary=summary.to_dict("records"),
    )


def learning_curves(curves: pd.DataFrame) -> Figure:
    tasks = list(science.TASKS)
    panels = []
    for k, task in enumerate(tasks):
        part = curves[curves.task == task]
        lines = []
        for variant, colour in COLOURS.items():
            mean = part[part.variant == variant].groupby("step").loss.mean()
            lines.append(svg.Series(variant, mean.index, mean.to_numpy(), colour, markers=False))
        panels.append(svg.Chart(task.replace("_", " "), lines, "step",
                                "training loss (mean over seeds)", log_y=True,
                                legend=k == len(tasks) - 1))  # fmt: skip
    alt = "Learning curves, one panel per task, one line per variant."
    return Figure("curves", "Learning curves", alt, svg.charts(panels, alt=alt, size=(260, 200)))


def trade_off(experiment: pd.DataFrame) -> Figure:
    summary = science.summary(experiment)
    shapes = dict(zip(science.TASKS, svg.SHAPES, strict=False))
    points = [
        svg.Series(f"{row.variant}, {row.task.replace('_', ' ')}", [row.attention_parameters],
                   [row.accuracy], COLOURS[row.variant], line=False, shape=shapes[row.task])
        for row in summary.itertuples()
    ]  # fmt: skip
    chart = svg.Chart("Accuracy against parameters", points, "attention parameters",
                      "held-out accuracy", log_x=True)  # fmt: skip
    alt = "Scatter plot of held-out accuracy against attention parameters, per variant and task."
    drawing = svg.charts([chart], alt=alt, size=(420, 240))
    return Figure("trade-off", "Accuracy against parameters", alt, drawing)


def ranks(experiment: pd.DataFrame) -> Figure:
    summary = science.summary(experiment)
    tasks, variants = list(science.TASKS), list(COLOURS)
    width = 0.8 / len(variants)  # the variants side by side around each task
    points, possible = [], ([], [])
    for i, variant in enumerate(variants):
        rows = summary[summary.variant == variant].set_index("task").reindex(tasks)
        x = [t + (i - (len(variants) - 1) / 2) * width for t in range(len(tasks))]
        points.append(svg.Series(variant, x, rows.qk_effective_rank, COLOURS[variant],
                                 line=False))  # fmt: skip
        possible[0].extend(x)
        possible[1].extend(rows.qk_rank_possible)
    points.append(svg.Series("most possible", *possible, "currentColor", line=False,
                             shape="dash"))  # fmt: skip
    chart = svg.Chart("Rank of the learned QK circuit", points, "task",
                      "effective rank of W_i^Q W_i^Kᵀ",
                      x_labels=[t.replace("_", " ") for t in tasks])  # fmt: skip
    alt = (
        "Dot plot of the mean effective rank of each variant's learned QK circuit, per task, "
        "with a dash at the most each variant's rank can be."
    )
    drawing = svg.charts([chart], alt=alt, size=(420, 240))
    return Figure("ranks", "Rank of the learned W_i", alt, drawing)


def specialisation(experiment: pd.DataFrame) -> Figure:
    """What each head of the first seed's four-relation models attends to: one heatmap per
    variant, heads by relation, the relation named by its steps along the chain (σ: +1, σ⁻¹: -1,
    σ²: +2, σ⁻²: -2)."""
    part = experiment[(experiment.task == "four_relations")
                      & (experiment.seed == experiment.seed.min())]  # fmt: skip
    steps = {f"attention_on_{name}": offset for offset, name in science.RELATION_NAMES.items()}
    relations = [c for c in part.columns if c in steps and part[c].notna().all()]
    labels = [f"{steps[c]:+d}" for c in relations]
    grids = []
    for variant in COLOURS:
        grid = part[part.variant == variant].set_index("head")[relations]
        grid.columns = labels
        grids.append(svg.Grid(variant, grid, axes=("head", "relation (steps along the chain)")))
    alt = "Heatmaps of each head's mean attention on each relation's target, per variant."
    drawing = svg.heatmaps(grids, vmin=0, vmax=1, anchors=svg.VIRIDIS, label="mean attention",
                           alt=alt, name="experiment-heads", size=(170, 110))  # fmt: skip
    return Figure("heads", "What each head attends to (four relations, first seed)", alt, drawing)
