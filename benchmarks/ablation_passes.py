"""The claims' ablated passes of `probe analyze --model minilm` over EWT dev, replayed in one
process: a change to them measured without the noise of whole processes.

    python benchmarks/ablation_passes.py [--rounds 8] [--against REV]

The default run is made once, in this process, and every ``ablation_effects`` call its claims
make is recorded (the model, the inputs, the items, the pairs and positions read). The calls are
then replayed ``--rounds`` times and their total time is given (the median and each round's).
With ``--against``, ``probe/interventions/ablation_rows.py`` as it is at that git revision is
replayed too, alternating with the working tree's round by round, and the two's effects are
compared (the largest relative difference, and whether NaN falls in the same places). A whole
run varies by a tenth from process to process on a shared machine; the replays, back to back in
one process, separate changes of 1-2%.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ewt_dev

ROOT = Path(__file__).resolve().parents[1]
MODULE = "probe/interventions/ablation_rows.py"


def recorded_calls(out: Path) -> list[tuple]:
    """Every ``ablation_effects`` call of the default run (its arguments), the run written to
    ``out``."""
    import probe.interventions.ablation_rows as rows
    from probe.app.analyze import analyze
    from probe.app.plan import Settings

    calls, original = [], rows.ablation_effects

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    rows.ablation_effects = recording  # the claims import it from the module when they run
    try:
        analyze(Settings(model="minilm", treebank=[str(ewt_dev())], out=out, overwrite=True))
    finally:
        rows.ablation_effects = original
    return calls


def module_at(revision: str, scratch: Path):
    """``ablation_rows`` as it is at ``revision``, imported under a name of its own."""
    text = subprocess.run(["git", "show", f"{revision}:{MODULE}"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout  # fmt: skip
    path = scratch / "ablation_rows_at_revision.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("ablation_rows_at_revision", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def replay(function, calls: list[tuple]) -> tuple[float, list]:
    """Seconds to make every call with ``function``, and what each returned."""
    import torch

    started, found = time.perf_counter(), []
    with torch.no_grad():
        for args, kwargs in calls:
            found.append(function(*args, **kwargs))
    return time.perf_counter() - started, found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--against", help="a git revision whose ablation_rows.py to replay too")
    args = parser.parse_args()
    import probe.interventions.ablation_rows as rows

    with tempfile.TemporaryDirectory(prefix="probe-bench-") as scratch:
        calls = recorded_calls(Path(scratch) / "run")
        versions = {"working tree": rows.ablation_effects}
        if args.against:
            versions[args.against] = module_at(args.against, Path(scratch)).ablation_effects
        if len(versions) == 2:
            (_, ours), (_, theirs) = (replay(f, calls) for f in versions.values())
            worst = max(float(((a - b).abs() / b.abs().clamp(min=1e-6)).nan_to_num(0).max())
                        for a, b in zip(ours, theirs, strict=True))  # fmt: skip
            same = all(bool((a.isnan() == b.isnan()).all())
                       for a, b in zip(ours, theirs, strict=True))  # fmt: skip
            print(f"effects: largest relative difference {worst:.2e}, NaN in the same places: "
                  f"{same}")  # fmt: skip
        times = {name: [] for name in versions}
        for _ in range(args.rounds):  # alternating, so that a slow spell slows both
            for name, function in versions.items():
                times[name].append(replay(function, calls)[0])
    rows_run = sum(int(kwargs["needed"].sum()) for _, kwargs in calls)
    print(f"{len(calls)} calls, {rows_run} ablated rows; medians of {args.rounds} replays:")
    for name, seconds in times.items():
        print(
            f"  {name:>14}: {statistics.median(seconds):.3f} s   "
            + " ".join(f"{s:.2f}" for s in seconds)
        )


if __name__ == "__main__":
    sys.exit(main())
