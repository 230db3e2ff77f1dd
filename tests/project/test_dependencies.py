"""Every third-party module that probe's code imports is a runtime dependency: a ``pip install``
without extras must be able to run every command (the ``dev`` extra, which CI installs, pulls in
much more, and would hide a missing one)."""

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("probe", "analyses")
# Calls that import the module their first argument names: probe.lazy.lazy, importlib's own.
IMPORTING_CALLS = {"lazy", "import_module"}


def _imported(tree: ast.AST) -> set[str]:
    """The top-level names of the modules a module imports, also lazily."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Call) and node.args:
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            first = getattr(node.args[0], "value", None)  # a literal's value
            if name in IMPORTING_CALLS and isinstance(first, str) and not first.startswith("."):
                found.add(first)
    return {name.partition(".")[0] for name in found}


def third_party_imports() -> dict[str, list[str]]:
    """Each third-party module the packages import, with the files that import it."""
    modules: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for name in _imported(ast.parse(path.read_text(encoding="utf-8"))):
                if name in sys.stdlib_module_names or name in PACKAGES or name == "__future__":
                    continue
                modules.setdefault(name, []).append(path.relative_to(ROOT).as_posix())
    return modules


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {_normal(re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0]) for r in project["dependencies"]}


def test_the_reader_sees_imports_of_every_form():
    tree = ast.parse("import a.b\nfrom c import d\nfrom . import e\nx = lazy('f.g')\n"
                     "importlib.import_module('h')\n")  # fmt: skip
    assert _imported(tree) == {"a", "c", "f", "h"}


def test_every_third_party_import_is_a_runtime_dependency():
    distributions = packages_distributions()
    runtime = declared()
    missing = {
        module: files
        for module, files in third_party_imports().items()
        if not {_normal(d) for d in distributions.get(module, [module])} & runtime
    }
    assert not missing, "imported but not in [project.dependencies]: " + "; ".join(
        f"{module} (by {', '.join(files[:3])})" for module, files in sorted(missing.items())
    )
