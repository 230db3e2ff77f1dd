"""Imports point one way: the app over the analyses over the library, and inside the library a
stated order of parts, each importing only itself and the parts below it. Package ``__init__``
files count as their package's modules; lazy imports (``lazy("…")``, ``importlib``) and the
registries' ``"module:Class"`` strings count as imports.

Nor do imports go round within a part: no module imports, through others or directly, a module
that imports it back, lazily or not (two modules that need each other are one job split in two, or
two jobs tangled). A registry's ``"module:Class"`` strings are left out of that check: an entry
imports the base class its registry declares, and the registry names the entry only to find it
by name, which is the extension point's shape, not a tangle."""

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
    ("pipeline", ("probe.pipeline",)),
    ("patterns", ("probe.patterns",)),
    ("front door", ("probe",)),  # probe/__init__.py: the public names, imported on first use
    ("analyses", ("analyses",)),
    # ``probe.plot``, the notebook figures, draws what the analyses declare from report folders:
    # a module of the app's, at the package's top level so that ``from probe import plot`` finds
    # it without the front door naming it. ``probe.__main__`` is the command (``python -m probe``).
    ("app", ("probe.app", "probe.plot", "probe.__main__")),
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


def imports(path: Path, root: Path = ROOT, registries: bool = True) -> set[str]:
    """Every module of ours that ``path`` imports, anywhere in it, relative imports resolved and
    ``from package import module`` read as the module; a registry's ``"module:Class"`` strings
    too unless ``registries`` is false."""
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
            registered = ":" in node.value
            if (OURS.fullmatch(text) and (text.startswith("probe.") or registered)
                    and (registries or not registered)):  # fmt: skip
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


def cycles(root: Path = ROOT) -> list[list[str]]:
    """Each set of our modules that import one another round in a circle (through any number of
    others), each as its names sorted, registries' strings left out; none when the imports
    form no cycle."""
    paths = [path for package in ("probe", "analyses") for path in (root / package).rglob("*.py")]
    modules = {module_name(path, root): path for path in paths}
    edges = {}
    for me, path in modules.items():
        imported = imports(path, root, registries=False)
        edges[me] = sorted(t for t in imported if t != me and t in modules)

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for target in edges[todo.pop()]:
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
        return seen

    reach = {module: reachable(module) for module in modules}
    # Modules each reachable from the other lie on one cycle; each set of them is listed once.
    found = {tuple(sorted(m for m in reach[module] if module in reach[m])) for module in modules}
    return sorted(list(cycle) for cycle in found if cycle)


def test_imports_point_down_the_layers():
    wrong = upward()
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_no_imports_go_round():
    """No cycle of imports, within a part or across parts (across, the order above already
    forbids one)."""
    found = cycles()
    assert not found, "modules that import one another round in a circle:\n" + "\n".join(
        " <-> ".join(cycle) for cycle in found
    )


def test_every_package_says_what_it_holds_and_may_import():
    for init in sorted((ROOT / "probe").rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert doc, f"{init.relative_to(ROOT)} has no docstring"
        if init.parent.name not in ("probe", "units"):
            assert "May import" in doc, f"{init.relative_to(ROOT)} does not say what it may import"


def test_the_top_level_holds_at_most_twelve_modules():
    # ``__main__.py`` is ``python -m probe``'s entry (the command's, in the app), not a module.
    modules = sorted(p.name for p in (ROOT / "probe").glob("*.py") if p.name != "__main__.py")
    assert len(modules) <= 12, modules


def test_the_check_fails_on_an_upward_import(tmp_path):
    """A new upward import is caught: in a module, in a package's ``__init__``, relative, lazy."""
    for where, source in (
        ("probe/capture/x.py", "from probe.pipeline import loading\n"),
        ("probe/capture/__init__.py", "from ..patterns import viewer\n"),
        (
            "probe/inputs/y.py",
            "from probe.lazy import lazy\nrows = lazy('probe.patterns.viewer')\n",
        ),
        ("probe/weights/z.py", "def f():\n    import analyses.syntax\n"),
        ("probe/__init__.py", "def __getattr__(name):\n    import probe.plot\n"),
    ):
        root = tmp_path / where.replace("/", "_")
        for package in ("probe", "analyses", "probe/capture", "probe/pipeline", "probe/patterns",
                        "probe/inputs", "probe/weights"):  # fmt: skip
            (root / package).mkdir(parents=True, exist_ok=True)
            (root / package / "__init__.py").write_text('"""May import: x."""\n')
        for module in ("probe/pipeline/loading.py", "probe/patterns/viewer.py", "probe/lazy.py",
                       "probe/capture/rows.py", "analyses/syntax.py", "probe/plot.py"):  # fmt: skip
            (root / module).write_text("")
        (root / where).write_text(source)
        wrong = upward(root)
        assert wrong and all(w.startswith(module_name(root / where, root)) for w in wrong), (
            where,
            wrong,
        )


def test_the_check_fails_on_a_cycle_within_a_part(tmp_path):
    """Two modules of one part that import each other (one lazily) are caught, and a cycle of
    three; a registry's entry importing its registry is not a cycle."""
    for package in ("probe", "probe/capture", "analyses"):
        (tmp_path / package).mkdir(parents=True, exist_ok=True)
        (tmp_path / package / "__init__.py").write_text('"""May import: x."""\n')
    (tmp_path / "probe/capture/a.py").write_text("from probe.capture import b\n")
    (tmp_path / "probe/capture/b.py").write_text("def f():\n    from probe.capture.a import g\n")
    (tmp_path / "probe/capture/c.py").write_text("from probe.capture.d import x\n")
    (tmp_path / "probe/capture/d.py").write_text(
        "from probe.lazy import lazy\ne = lazy('probe.capture.e')\n"
    )
    (tmp_path / "probe/capture/e.py").write_text("import probe.capture.c\n")
    (tmp_path / "probe/lazy.py").write_text("")
    (tmp_path / "analyses/__init__.py").write_text('REGISTRY = {"x": "analyses.x:X"}\n')
    (tmp_path / "analyses/x.py").write_text("from analyses import REGISTRY\n")
    assert cycles(tmp_path) == [
        ["probe.capture.a", "probe.capture.b"],
        ["probe.capture.c", "probe.capture.d", "probe.capture.e"],
    ]
