"""``probe analyze``: one model, its inputs, the chosen analyses, one output folder.

The run has three stages, each a module of its own:

- ``probe.app.plan`` resolves the analyses (checking their contract), their options, the tables'
  schemas, the input and the output folder: everything that can be checked is checked there,
  before torch is imported, whether the settings come from the command line or from Python;
- ``probe.app.execute`` loads the model and streams every input unit a chosen analysis reads
  (``probe.inputs.units``) through it, handing each layer's captures to the analyses that read
  that unit, then merges the processes' states exactly (``probe.distributed``);
- ``probe.app.publish`` finishes the analyses into tables and writes them, the report and
  ``run.json`` (``probe.app.card``) into a staging folder that takes the output's place at once
  (``probe.app.output``).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

from probe.app.execute import Progress, execute
from probe.app.output import reserved
from probe.app.plan import Settings, plan
from probe.app.publish import publish


def analyze(
    settings: Settings,
    progress: Progress | None = None,
    status: Callable[[str], None] = lambda message: None,
) -> Path | None:
    """Plan, execute and publish a run; returns the report folder's path.

    Under torchrun every process runs this: each streams its share of the input, the states
    are merged into rank 0's (``probe.distributed``), and rank 0 alone writes the report; the
    others return None.

    Parameters
    ----------
    settings : Settings
    progress : callable, optional
        ``progress(description, total)`` returns a wrapper that shows progress over an
        iterable of batches (the CLI passes rich progress bars); None shows nothing.
    status : callable
        Receives one-line messages about the stage that starts.
    """
    planned = plan(settings)
    from probe.distributed import Ranks
    from probe.inputs.pipes import forget_copies

    ranks = Ranks.from_environment()
    paused = not gc.isenabled()  # see probe.app.execute._freeze
    try:
        if not ranks.leader:
            execute(planned, ranks, None, lambda message: None)
            return None
        # Reserved before any compute: a second run to the same place fails now, not at the end.
        with reserved(planned.output, settings.overwrite) as folder:
            outcome = execute(planned, ranks, progress, status)
            publish(planned, outcome, folder, status)
        return planned.output
    finally:
        forget_copies(planned.source.treebank)  # a pipe's copy is this run's alone
        if paused:  # as the caller left it, and what _freeze froze can be freed again
            gc.unfreeze()
            gc.disable()
