"""No library module (``probe/**``, ``analyses/**``) is over 500 lines unless the first paragraph
of its docstring says why it is one piece: the words "one piece" followed, in that paragraph, by
the reason (four words or more). For example::

    \"\"\"The hooks that capture and edit attention, and their registries. One piece: each hook
    closes over the registry it fills, and a split would pass the registries between modules.

A longer module without its reason holds several jobs: split it by job (docs/design.md), each
new module named for its job."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 500  # lines
REASON = re.compile(r"\bone piece\b\W+(\w+\W+){3,}\w", re.IGNORECASE)  # and four words or more


def first_paragraph(path: Path) -> str:
    """The module docstring's first paragraph, its lines joined."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    return " ".join(doc.split("\n\n")[0].split())


def oversized(root: Path = ROOT) -> list[str]:
    """``path: lines`` for each module over ``LIMIT`` lines that does not say why it is one
    piece."""
    found = []
    for package in ("probe", "analyses"):
        for path in sorted((root / package).rglob("*.py")):
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > LIMIT and not REASON.search(first_paragraph(path)):
                found.append(f"{path.relative_to(root)}: {lines} lines")
    return found


def test_no_module_is_over_500_lines_without_its_reason():
    found = oversized()
    assert not found, (
        f"over {LIMIT} lines without saying, in the docstring's first paragraph, why it is one "
        "piece:\n" + "\n".join(found)
    )


def test_the_check_fails_on_a_long_module_without_its_reason(tmp_path):
    """A long module is caught unless its first paragraph gives the reason; a short one never is;
    the reason in a later paragraph, or the bare words, are not enough."""
    body = "x = 1\n" * LIMIT
    modules = {
        "probe/short.py": '"""Short."""\n',
        "probe/silent.py": '"""Many jobs."""\n' + body,
        "probe/later.py": '"""Many jobs.\n\nOne piece: the hooks share their registries."""\n'
        + body,
        "probe/bare.py": '"""Kept as one piece."""\n' + body,
        "analyses/kept.py": '"""The hooks. One piece: each hook closes over the registry it\n'
        'fills."""\n' + body,
    }
    for name, text in modules.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = [line.partition(":")[0] for line in oversized(tmp_path)]
    assert found == ["probe/bare.py", "probe/later.py", "probe/silent.py"], found
