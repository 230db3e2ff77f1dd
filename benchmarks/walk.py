"""Follow a run through the code: which modules call which, and how often facts about the
model are derived again.

Every call between two modules of probe or the analyses, in the run's own thread, during
``probe analyze --model minilm -t sample`` is recorded. Printed:

- the modules the run visits, and the distinct caller -> callee module pairs;
- climbs: pairs whose callee imports its caller (a call back up the layers: a callback);
- derivations: calls from outside ``architectures`` into the functions that derive a fact
  about the model from the Hugging Face model (head and layer counts, causal, encoder-decoder,
  its attentions), with the number of distinct places that make them.

Run from a checkout (it measures the code it imports): ``python benchmarks/walk.py``; the
numbers before and after a change are comparable when measured the same way on the same run.
"""

from __future__ import annotations

import argparse
import ast
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _common  # noqa: F401 (offline, quiet)

ROOT = Path.cwd()


def module_imports(root: Path) -> dict[str, set[str]]:
    """Each module of ``probe`` and ``analyses`` -> the modules of ours it imports."""
    graph = {}
    for package in ("probe", "analyses"):
        for path in (root / package).rglob("*.py"):
            name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            found = set()
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.module:
                    found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
                elif isinstance(node, ast.Import):
                    found |= {a.name for a in node.names}
            graph[name] = found
    return graph


DERIVATIONS = {"head_count", "head_dim", "is_causal", "is_encoder_decoder", "attentions",
               "blocks", "architecture", "rows_unsupported", "max_positions"}  # fmt: skip


def calls(analyses: list[str] | None) -> list[tuple[str, str, str, int]]:
    """(caller module, callee module, callee function, caller line) of every call between
    modules of ours during one run, in this thread."""
    import threading

    from probe.app.analyze import analyze
    from probe.app.plan import Settings

    out = Path(tempfile.mkdtemp()) / "report"
    settings = Settings("minilm", treebank=["sample"], out=out, analyses=analyses)
    found = []
    main_thread = threading.get_ident()

    def profile(frame, event, arg) -> None:
        if event != "call" or threading.get_ident() != main_thread:
            return
        callee = frame.f_globals.get("__name__", "")
        caller_frame = frame.f_back
        caller = caller_frame.f_globals.get("__name__", "") if caller_frame else ""
        if callee != caller and all(m.startswith(("probe", "analyses")) for m in (callee, caller)):
            found.append((caller, callee, frame.f_code.co_name, caller_frame.f_lineno))

    sys.setprofile(profile)
    try:
        analyze(settings)
    finally:
        sys.setprofile(None)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--analyses", default=None, help="comma-separated (default: the defaults)")
    args = parser.parse_args()
    found = calls(args.analyses.split(",") if args.analyses else None)
    graph = module_imports(ROOT)
    pairs = {(a, b) for a, b, _, _ in found}
    modules = {m for pair in pairs for m in pair}
    climbs = sorted((a, b) for a, b in pairs if a in graph.get(b, set()))
    derived = [(a, f, line) for a, b, f, line in found
               if b.endswith("architectures") and f in DERIVATIONS]  # fmt: skip
    print(f"{len(modules)} modules; {len(pairs)} caller -> callee module pairs; {len(climbs)} "
          "climb back up (the callee imports its caller)")  # fmt: skip
    for a, b in climbs:
        print(f"  climb: {a} -> {b}")
    sites = Counter((a, line) for a, _, line in derived)
    print(f"{len(derived)} derivations of a model fact from outside architectures, from "
          f"{len(sites)} places in {len({a for a, _ in sites})} modules")  # fmt: skip
    for (module, line), count in sorted(sites.items()):
        print(f"  {count:5d}  {module}:{line}")


if __name__ == "__main__":
    main()
