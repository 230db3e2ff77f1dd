"""``probe`` as a torchrun worker whose rank 1 fails after its first batch (a ProbeError, as a
user's mistake found late would be), for the test that every process of the run stops."""

import os
import sys

import probe.pipeline.runner
from probe.app.cli import app
from probe.errors import ProbeError

FAILING_RANK = 1


def fail_after_first_batch(stream):
    def failing(model, batches, *args, **kwargs):
        def first_only():
            for i, batch in enumerate(batches):
                if i == 1:
                    raise ProbeError(f"the test's failure on rank {FAILING_RANK}")
                yield batch

        return stream(model, first_only(), *args, **kwargs)

    return failing


if int(os.environ["RANK"]) == FAILING_RANK:
    probe.pipeline.runner.stream = fail_after_first_batch(probe.pipeline.runner.stream)
sys.exit(app())
