"""Imports point one way: the app over the analyses over the library, and inside the library a
stated order of parts, each importing only itself and the parts below it. Package ``__init__``
files count as their package's modules; lazy imports (``lazy("…")``, ``importlib``) and the
registries' ``"module:Class"`` strings count as imports."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Lowest first. A module belongs to the first part whose name is its name or a prefix of it.
LAYERS = (
    ("foundation", ("probe.errors", "probe.lazy", "probe.options", "probe.files", "probe.heads",
                    "probe.keys", "probe.numerics", "probe.inference", "probe.distributed")),
    ("capture", ("probe.capture",)),
    ("inputs", ("probe.inputs",)),
    ("attention", ("probe.attention",)),
    ("weights", ("probe.weights",)),
    ("interventions", ("probe.interventions",)),
    ("run", ("probe.run",)),
    ("patterns", ("probe.patterns",)),
    ("front door", ("probe",)),  # probe/__init__.py: the public names, imported on first use
    ("analyses", ("analyses",)),
    # ``probe.plot``, the notebook figures, draws what the analyses declare from report folders:
    # a module of the app's, at the package's top level so that ``from probe import plot`` finds
    # it without the front door naming it.
    ("app", ("probe.app", "probe.plot")),
)  # fmt: skip
# Imports against the order that are allowed: none.
ALLOWED: set[tuple[str, str]] = set()
OURS = re.compile(r"(probe|analyses)(\.\w+)*")


def layer(module: str) -> int:
    """The index in ``LAYERS`` of the part that holds ``module``."""
    best = max(
        ((len(prefix), k) for k, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
         if module == prefix or module.startswith(prefix + ".")),
        default=None,
    )  # fmt: skip
    assert best is not None, f"{module} is in no part of LAYERS: add it"
    return best[1]


def module_name(path: Path, root: Path = ROOT) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def imports(path: Path, root: Path = ROOT) -> set[str]:
    """Every module of ours that ``path`` imports, anywhere in it, relative imports resolved and
    ``from package import module`` read as the module."""
    package = path.relative_to(root).parts[:-1]
    names = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    # An f-string's text ("probe: {why}") is a message, not a "module:Class" string.
    formatted = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr)
                 for part in node.values}  # fmt: skip
    for node in ast.walk(tree):
        if id(node) in formatted:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.add(module)
            for alias in node.names:  # a submodule, where there is one
                candidate = root.joinpath(*f"{module}.{alias.name}".split("."))
                if candidate.with_suffix(".py").is_file() or candidate.is_dir():
                    names.add(f"{module}.{alias.name}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value.split(":")[0]
            if OURS.fullmatch(text) and (text.startswith("probe.") or ":" in node.value):
                names.add(text)
    return {n for n in names if OURS.fullmatch(n) and n.split(".")[0] in ("probe", "analyses")}


def upward(root: Path = ROOT) -> list[str]:
    """``importer -> imported`` for every import against the order."""
    found = []
    for package in ("probe", "analyses"):
        for path in sorted((root / package).rglob("*.py")):
            me = module_name(path, root)
            for target in sorted(imports(path, root)):
                if target == me or (me, target) in ALLOWED:
                    continue
                if layer(target) > layer(me):
                    found.append(f"{me} ({LAYERS[layer(me)][0]}) -> {target} "
                                 f"({LAYERS[layer(target)][0]})")  # fmt: skip
    return found


def test_imports_point_down_the_layers():
    wrong = upward()
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_every_package_says_what_it_holds_and_may_import():
    for init in sorted((ROOT / "probe").rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert doc, f"{init.relative_to(ROOT)} has no docstring"
        if init.parent.name not in ("probe", "units"):
            assert "May import" in doc, f"{init.relative_to(ROOT)} does not say what it may import"


def test_the_top_level_holds_at_most_twelve_modules():
    modules = sorted(p.name for p in (ROOT / "probe").glob("*.py"))
    assert len(modules) <= 12, modules


def test_the_check_fails_on_an_upward_import(tmp_path):
    """A new upward import is caught: in a module, in a package's ``__init__``, relative, lazy."""
    for where, source in (
        ("probe/capture/x.py", "from probe.run import loading\n"),
        ("probe/capture/__init__.py", "from ..patterns import viewer\n"),
        (
            "probe/inputs/y.py",
            "from probe.lazy import lazy\nrows = lazy('probe.patterns.viewer')\n",
        ),
        ("probe/weights/z.py", "def f():\n    import analyses.syntax\n"),
        ("probe/__init__.py", "def __getattr__(name):\n    import probe.plot\n"),
    ):
        root = tmp_path / where.replace("/", "_")
        for package in ("probe", "analyses", "probe/capture", "probe/run", "probe/patterns",
                        "probe/inputs", "probe/weights"):  # fmt: skip
            (root / package).mkdir(parents=True, exist_ok=True)
            (root / package / "__init__.py").write_text('"""May import: x."""\n')
        for module in ("probe/run/loading.py", "probe/patterns/viewer.py", "probe/lazy.py",
                       "probe/capture/rows.py", "analyses/syntax.py", "probe/plot.py"):  # fmt: skip
            (root / module).write_text("")
        (root / where).write_text(source)
        wrong = upward(root)
        assert wrong and all(w.startswith(module_name(root / where, root)) for w in wrong), (
            where,
            wrong,
        )
