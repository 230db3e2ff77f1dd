"""Heavy imports an analysis's ``finish`` needs are made on a thread while the model streams
(``Analysis.imports``), never at plan time, and a failing one costs the run nothing."""

from __future__ import annotations

import subprocess
import sys
import threading

import analyses
from probe.app.run import _import_beside

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
    scikit-learn's import is left to the thread beside the forward passes."""
    done = subprocess.run([sys.executable, "-c", PLAN_ONLY], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_declared_imports_are_modules_and_load_on_a_thread():
    declared = {m for name in analyses.REGISTRY for m in analyses.get(name).imports}
    assert {"sklearn.linear_model", "sklearn.manifold"} <= declared
    for module in declared:
        assert module.replace(".", "").replace("_", "").isalnum()
    _import_beside({"sklearn.manifold", "no_such_module_anywhere"})
    beside = [t for t in threading.enumerate() if t.name == "probe-imports"]
    assert beside, "no import thread was started"
    for thread in beside:
        thread.join(timeout=120)
    assert "sklearn.manifold" in sys.modules and "no_such_module_anywhere" not in sys.modules
