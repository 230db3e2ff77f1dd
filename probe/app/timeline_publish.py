"""``probe timeline``'s own outputs, from its steps' reports: ``timeline.csv``,
``roles_by_step.csv``, ``onsets.csv`` and ``steps.csv`` (each checkpoint's name, revision,
weights hash and loss), ``run.json`` (the checkpoints and the warnings) and the page, each file
written whole (``write_file``: temp-then-rename).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from probe.app.output import write_file
from probe.app.plan import Plan
from probe.app.timeline import Checkpoint, checkpoint_records, duplicate_weights
from probe.app.timeline_page import render_page
from probe.app.timeline_tables import onsets, roles_by_step, sentences, timeline_table
from probe.errors import ProbeError

LOSS_OF = "the second copy of repeated tokens"


def read_steps(out: Path, planned: list[Checkpoint]) -> tuple[dict[int, pd.DataFrame], dict]:
    """Each step's ``heads.csv`` and ``run.json``, by step."""
    heads, cards = {}, {}
    for c in planned:
        folder = Path(out) / c.folder
        try:
            heads[c.step] = pd.read_csv(folder / "heads.csv", keep_default_na=False,
                                        na_values=[""])  # fmt: skip
            cards[c.step] = json.loads((folder / "run.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            why = str(error).splitlines()[0]
            raise ProbeError(f"cannot read the report of step {c.step} in {folder} ({why}): "
                             "run again with --resume") from None  # fmt: skip
    return heads, cards


def step_table(planned: list[Checkpoint], hashes: dict[int, str], cards: dict) -> pd.DataFrame:
    """``steps.csv``: a row per checkpoint: ``step, name, source, revision, weights_sha256``,
    and ``loss_first_copy``, ``loss_second_copy`` where measured (``--lm-head``)."""
    rows = []
    for record in checkpoint_records(planned, hashes):
        loss = cards[record["step"]].get("loss") or {}
        rows.append(record | {"loss_first_copy": loss.get("first_copy"),
                              "loss_second_copy": loss.get("second_copy")})  # fmt: skip
    return pd.DataFrame(rows)


def write_timeline(
    out: Path, planned: list[Checkpoint], hashes: dict[int, str], base: Plan
) -> Path:
    """Write the timeline's tables, ``run.json`` and ``index.html`` into ``out``, whose
    ``steps/`` hold every checkpoint's report; returns ``out``."""
    heads, cards = read_steps(out, planned)
    hashes = {step: hashes.get(step) or cards[step].get("weights_sha256") for step in heads}
    hashes = {step: h for step, h in hashes.items() if h}
    timeline = timeline_table(heads)
    by_step, onset = roles_by_step(timeline), onsets(timeline)
    steps = step_table(planned, hashes, cards)
    losses = {int(s): float(v) for s, v in zip(steps.step, steps.loss_second_copy, strict=True)
              if v is not None and v == v}  # fmt: skip
    warnings = duplicate_weights(hashes)
    said = sentences(timeline, losses, LOSS_OF, warnings)
    for name, table in (("timeline", timeline), ("roles_by_step", by_step), ("onsets", onset),
                        ("steps", steps)):  # fmt: skip
        write_file(out / f"{name}.csv", table.to_csv(index=False))
    last = cards[planned[-1].step]
    card = {
        "command": "probe timeline",
        "source": base.settings.model if not planned[0].revision else planned[0].source,
        "revisions": [c.revision for c in planned] if planned[0].revision else None,
        "checkpoints": checkpoint_records(planned, hashes),
        "warnings": warnings,
        "sentences": said,
        "loss_of": LOSS_OF if losses else None,
        "analyses": last.get("analyses"),
        "options": last.get("options"),
        "thresholds": last.get("thresholds"),
        "seed": last.get("seed"),
    }
    write_file(out / "run.json", json.dumps(card, indent=2))
    write_file(out / "index.html", render_page(card, timeline, onset, by_step, losses, LOSS_OF))
    return out
