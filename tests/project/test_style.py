"""Project style rules that a linter does not check."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("probe", "analyses")
MAX_BODY_LINES = 60


def _body_length(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement after the docstring to the end of the function.

    A function whose body is only a docstring has length 0.
    """
    body = function.body
    if ast.get_docstring(function, clean=False) is not None:
        body = body[1:]  # the docstring is documentation, not code
    if not body:
        return 0
    return function.end_lineno - body[0].lineno + 1


def _long_functions(max_lines: int) -> list[str]:
    """``path:line name length`` for every function (nested ones and methods included) in
    ``PACKAGES`` whose body is longer than ``max_lines``."""
    offenders = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    length = _body_length(node)
                    if length > max_lines:
                        where = path.relative_to(ROOT).as_posix()
                        offenders.append(f"{where}:{node.lineno} {node.name} {length}")
    return offenders


def test_no_function_body_is_longer_than_the_limit():
    offenders = _long_functions(MAX_BODY_LINES)
    assert not offenders, (
        f"function bodies longer than {MAX_BODY_LINES} lines (docstring excluded):\n"
        + "\n".join(offenders)
    )
