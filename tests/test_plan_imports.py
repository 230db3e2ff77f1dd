"""Heavy imports an analysis's ``finish`` needs are made when it finishes, never at plan time,
where the contract check runs every analysis's ``heads()`` on empty tables."""

from __future__ import annotations

import subprocess
import sys

PLAN_ONLY = """
import sys
import analyses
for name in analyses.REGISTRY:
    analyses.check_analysis(analyses.get(name), name, full=True)
heavy = sorted(m for m in sys.modules if m.partition(".")[0] in ("sklearn", "torch", "seaborn"))
assert not heavy, heavy
"""


def test_the_full_contract_check_imports_no_heavy_module():
    """Plan time (every analysis's full check, heads() on empty tables included) stays light:
    scikit-learn is imported when the analyses finish."""
    done = subprocess.run([sys.executable, "-c", PLAN_ONLY], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
