"""Heavy imports an analysis's ``finish`` needs are made when it finishes, never at plan time,
where the contract check runs every analysis's ``heads()`` on empty tables."""

from __future__ import annotations

import subprocess
import sys

import pytest

PLAN_ONLY = """
import sys
import analyses
for name in analyses.REGISTRY:
    analyses.check_analysis(analyses.get(name), name, full=True)
heavy = sorted(m for m in sys.modules if m.partition(".")[0] in ("sklearn", "torch", "seaborn"))
assert not heavy, heavy
"""


@pytest.mark.slow
def test_the_full_contract_check_imports_no_heavy_module():
    """Plan time (every analysis's full check, heads() on empty tables included) stays light:
    scikit-learn is imported when the analyses finish."""
    done = subprocess.run([sys.executable, "-c", PLAN_ONLY], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr


PLAN_OF_A_RUN = """
import sys
from probe.app.plan import Settings, plan
plan(Settings("minilm", treebank=["sample"], out={out!r}))
heavy = sorted({{m.partition(".")[0] for m in sys.modules}} & {{"pandas", "sklearn", "torch"}})
assert not heavy, heavy
"""


def test_a_run_of_probes_own_analyses_is_planned_without_pandas(tmp_path):
    """The run needs pandas only once its batches are done, while its helper process fits:
    planning it imports none (probe's own analyses pass the full check in
    tests/analyses/test_contract.py, which a run of them skips)."""
    code = PLAN_OF_A_RUN.format(out=str(tmp_path / "r"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_only_the_analyses_probe_ships_are_shipped():
    import analyses
    from analyses.syntax import Syntax

    assert all(analyses.shipped(analyses.get(name)) for name in analyses.REGISTRY)

    class Imitation(Syntax):  # the same name, another class: checked in full
        pass

    assert not analyses.shipped(Imitation)
