"""The docs' pages and facts that come from the code, generated at build time (a MkDocs hook).

Written once, in the code, and only shown here:

- ``reference/hooks.md``: every hook point ``probe.capture.names`` knows, with its shape and
  meaning (``probe.capture.names.describe``) and the architectures that have it, found by
  mirroring a small random model of each (``tests/support/models.py``'s configurations);
- ``reference/analyses.md``: each analysis of ``analyses.REGISTRY`` and each input unit of
  ``probe.inputs.units.UNITS``, from their declarations: what they read, their tables and
  columns, their ``heads.csv`` columns, options and roles;
- ``reference/cli.md``: every command of ``probe`` and its options, from the command line itself;
- ``reference/api.md``: the public names of ``probe`` (``probe._EXPORTS``), for mkdocstrings;
- facts in the pages (release numbers, sentence counts, defaults: ``facts()``), written into
  the Markdown files themselves, so that they read the same on GitHub as on the site. Each sits
  between markers that name it, ``<!-- generated: ewt_dev.sentences -->2,001<!-- end -->``
  (``(code)`` after the name puts it in backticks; a table or a paragraph goes on lines of its
  own). ``python docs/generate.py --write`` rewrites every marked region from the code;
  ``python docs/generate.py`` (``--check``) lists the files whose text is stale, and so do the
  tests (``tests/project/test_docs.py``) and the site's build.

``mkdocs.yml`` names this file under ``hooks``; the tests import it to check what it gives.
"""

from __future__ import annotations

import functools
import gzip
import inspect
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ("reference/hooks.md", "reference/analyses.md", "reference/cli.md", "reference/api.md")
# A fact's region: the name, "(code)" for backticks, the text the code gave when last written.
REGION = re.compile(r"<!-- generated: ([\w.]+)( \(code\))? -->(.*?)<!-- end -->", re.DOTALL)
# What the pages wrote before (a placeholder filled at build time), raw on GitHub: refused.
PLACEHOLDER = re.compile(r"\{\{\s*[\w.]+\s*\}\}")


def _sentences(path: Path) -> tuple[int, int]:
    """A CoNLL-U file's sentences, and its documents (``# newdoc``) with coreference
    (``Entity=``)."""
    opener = gzip.open if path.suffix == ".gz" else open
    sentences, documents, entities = 0, [0], set()
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            sentences += line.startswith("# sent_id")
            documents[0] += line.startswith("# newdoc")
            if "Entity=" in line and not line.startswith("#"):
                entities.add(documents[0])
    return sentences, len(entities)


@functools.cache
def facts() -> dict[str, str]:
    """Every fact a page may name, as the text it shows."""
    from analyses import REGISTRY, get
    from analyses.circuit import EDGE_METHOD
    from probe.app import examples
    from probe.capture.architectures import MODEL_TYPES
    from probe.inputs import download
    from probe.inputs import units as units_module
    from probe.inputs.treebank import EWT_DEV, SAMPLE, UD_TREEBANKS

    found: dict[str, str] = {}
    for name, spec in UD_TREEBANKS.items():
        found[f"ud.{name}.release"] = spec.release
        found[f"ud.{name}.repo"] = spec.repo
        found[f"ud.{name}.splits"] = ", ".join(spec.sha256)
        found[f"ud.{name}.mirror"] = f"<mirror>/{spec.repo}/{spec.release}/{name}-ud-dev.conllu"
    ewt, _ = _sentences(EWT_DEV)
    sample, documents = _sentences(SAMPLE)
    found["ewt_dev.sentences"] = f"{ewt:,}"
    found["sample.sentences"] = f"{sample:,}"
    found["sample.coref_documents"] = f"{documents:,}"
    found["cards.candidates"] = str(examples.N_CANDIDATES)
    found["cards.per_head"] = str(examples.PER_HEAD)
    found["cards.words"] = f"{examples.WORDS[0]} to {examples.WORDS[1]}"
    found["cards.max_tokens"] = str(examples.MAX_TOKENS)
    found["http.timeout"] = f"{download.TIMEOUT_S:g}"
    found["http.deadline"] = f"{download.DEADLINE_S:g}"
    found["http.min_rate"] = f"{download.MIN_RATE:g}"
    encoder_decoder = {kind for kind, row in MODEL_TYPES.items() if row.encoder_decoder}
    found["architectures"] = ", ".join(sorted(MODEL_TYPES.keys() - encoder_decoder))
    found["architectures.encoder_decoder"] = ", ".join(sorted(encoder_decoder))
    found["analyses"] = ", ".join(f"`{n}`" for n in REGISTRY)
    found["analyses.default"] = ",".join(n for n in REGISTRY if get(n).default)
    found["circuit.edge_method"] = EDGE_METHOD
    from probe.interventions.gradients import FREE_SHARE, MAX_BYTES

    found["circuits.max_bytes"] = f"{MAX_BYTES / 2**30:g} GiB"
    found["circuits.free_share"] = f"{FREE_SHARE:.0%}"
    declared = [o for n in REGISTRY for o in get(n).options]
    declared += [o for n in units_module.UNITS for o in units_module.get(n).options]
    for option in declared:
        found[f"option.{option.name}"] = _value(option.default)
    found["design.layers"] = layers_table()
    for name, param in _analyze_params().items():
        if param.default is not None and not callable(param.default):
            found[f"cli.{name}"] = _value(param.default)
    return found


def _cell(text: str) -> str:
    """Text for a Markdown table's cell, as written: on one line, no column breaks, no links."""
    text = " ".join((text or "").split())
    return text.replace("|", "\\|").replace("[", "\\[").replace("]", "\\]")


def _value(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _analyze_params() -> dict:
    command = _commands()["analyze"]
    return {p.name: p for p in command.params}


@functools.cache
def _commands() -> dict:
    """``probe``'s commands (click's), by name, with every analysis's and unit's option."""
    import typer

    from probe.app.cli import app

    group = typer.main.get_command(app)
    return dict(group.commands)


def fill(markdown: str, where: str) -> str:
    """``markdown`` with each marked region's text replaced by its fact, as the code gives it now.

    Raises
    ------
    KeyError
        Naming the page and the fact, for a name ``facts()`` does not know.
    ValueError
        For a region that starts a line inside a paragraph (Markdown would read it as a block of
        HTML and break the paragraph there) or sits inside a code span (its markers would show),
        or a ``{{ name }}`` placeholder.
    """
    known = facts()
    if found := PLACEHOLDER.search(markdown):
        raise ValueError(f"{where}: {found.group()} is shown as written; mark the fact instead")

    def region(match: re.Match) -> str:
        name, code, text = match.groups()
        if name not in known:
            raise KeyError(f"{where}: unknown fact {name}; known: {', '.join(known)}")
        fact = f"`{known[name]}`" if code else known[name]
        block = text.startswith("\n")
        start = match.start()
        if not block and not markdown[markdown.rfind("\n", 0, start) + 1 : start].strip():
            line = markdown.count("\n", 0, start) + 1
            raise ValueError(f"{where}:{line}: the fact {name} starts a line; put a word before it")
        if markdown.count("`", markdown.rfind("\n\n", 0, start) + 1, start) % 2:
            line = markdown.count("\n", 0, start) + 1
            raise ValueError(f"{where}:{line}: the fact {name} is inside a code span, which would "
                             "show its markers; mark the whole span, with (code)")  # fmt: skip
        fact = f"\n\n{fact}\n\n" if block else fact
        return f"<!-- generated: {name}{code or ''} -->{fact}<!-- end -->"

    return REGION.sub(region, markdown)


def unmarked(markdown: str) -> str:
    """``markdown`` without the regions' markers, their text left in place."""
    return REGION.sub(lambda match: match.group(3), markdown)


def marked_pages() -> list[Path]:
    """The files that may hold facts: every page of ``docs/``, the README and the tutorials (their
    Markdown cells, where a marker is an HTML comment the notebook does not show)."""
    tutorials = sorted((ROOT / "docs" / "tutorials").glob("*.py"))
    return [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md", *tutorials]


def stale(write: bool = False) -> list[Path]:
    """The pages whose marked text differs from what the code gives now; rewritten in place
    where ``write``, once every page is filled (a page that cannot be stops them all), each
    whole or not at all."""
    from probe.files import write_file

    found = {}
    for path in marked_pages():
        text = path.read_text(encoding="utf-8")
        current = fill(text, str(path.relative_to(ROOT)))
        if current != text:
            found[path] = current
    for path, current in found.items() if write else ():
        write_file(path, current)
    return list(found)


def _docstring(module: str) -> str:
    """The docstring of one of our modules, read without importing it."""
    import ast

    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    raise ValueError(f"no module {module}")


def _first_sentence(doc: str) -> str:
    paragraph = " ".join(doc.split("\n\n")[0].split())
    end = paragraph.find(". ")
    return paragraph if end < 0 else paragraph[: end + 1]


def layers_table() -> str:
    """The parts of the code, lowest first, as ``tests/project/test_layers.py`` states and checks
    them, each with its modules and what it holds (their docstrings)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "test_layers", ROOT / "tests/project/test_layers.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = ["| part | modules | what it holds |", "|---|---|---|"]
    for part, modules in module.LAYERS:
        folder = ROOT.joinpath(*modules[0].split("."))
        if len(modules) == 1 and folder.is_dir() and not (folder / "__init__.py").exists():
            # a package without an __init__ (the app): each of its modules
            modules = sorted(f"{modules[0]}.{p.stem}" for p in folder.glob("*.py"))
        if len(modules) == 1:
            said = []
            for paragraph in _docstring(modules[0]).split("\n\n")[:2]:
                if ">>>" in paragraph or paragraph.startswith(" ") or paragraph.endswith(":"):
                    break  # an example, an equation, a list
                said.append(paragraph)
            holds = " ".join(" ".join(said).split())
        else:
            holds = "<br>".join(f"`{m.rpartition('.')[2]}`: {_first_sentence(_docstring(m))}"
                                for m in modules)  # fmt: skip
        packages = {m.rpartition(".")[0] for m in modules}
        inside = len(modules) > 1 and len(packages) == 1 and packages != {"probe"}
        names = f"`{packages.pop()}`" if inside else ", ".join(f"`{m}`" for m in modules)
        rows.append(f"| {part} | {names} | {holds} |")
    return "\n".join(rows)


# ---------------------------------------------------------------- hook points


@functools.cache
def points_by_architecture() -> dict[str, set[str]]:
    """Each point (as ``point_of`` names it) -> the architectures whose mirrored model has it,
    with its language-model head (``hook_unembed``, a final norm)."""
    import torch
    import transformers as tf

    tf.logging.set_verbosity_error()  # the small configs' token ids lie outside their vocabulary
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from models import CONFIGS, ENCODERS, SEQ2SEQ

    from probe.capture.architectures import MODEL_TYPES
    from probe.capture.hookpoints import hook_points
    from probe.capture.names import point_of

    found: dict[str, set[str]] = {}
    torch.manual_seed(0)
    for kind, config in (CONFIGS | SEQ2SEQ).items():
        if kind in SEQ2SEQ:
            auto = tf.AutoModelForSeq2SeqLM
        elif kind in ENCODERS:
            auto = tf.AutoModelForMaskedLM
        else:
            auto = tf.AutoModelForCausalLM if MODEL_TYPES[kind].causal else tf.AutoModel
        model = auto.from_config(config()).eval()
        with hook_points(model) as points:
            for name in points:
                found.setdefault(point_of(name), set()).add(kind)
    return found


def _code(text: str) -> str:
    return f"`{text}`"


def hooks_page() -> str:
    from probe.capture.names import Attention, describe, hook_name, known_points

    every = points_by_architecture()
    kinds = sorted({k for ks in every.values() for k in ks})
    lines = [
        "# Hook points",
        "",
        "Generated from `probe.capture.names` (every point it knows, its shape and meaning) and "
        "from the architectures: the last column lists the architectures whose mirrored model "
        "has the point, found by mirroring a small random model of each, with its language-model"
        " head. Names and shapes are TransformerLens's; layers are 0-based.",
        "",
        "A point's full name adds its stack and layer: "
        f"`{hook_name('hook_pattern', 3)}`, `{hook_name('hook_resid_pre', 3)}`, "
        f"`{hook_name('ln1.hook_scale', 3)}`, `{hook_name('hook_z', 1, Attention.CROSS)}`, "
        f"`{hook_name('hook_resid_pre', 0, 'encoder')}`; the model's own points have no layer "
        f"(`{hook_name('hook_embed')}`, `{hook_name('ln_final.hook_scale')}`). Build and parse "
        "them with `probe.capture.names` (`hook_name`, `act_name`, `parse`).",
        "",
        "Attentions: " + ", ".join(f"`{a.value}`" for a in Attention) + ". Dimensions: `head` "
        "the query heads, `kv_head` the key and value heads (fewer under grouped-query "
        "attention), `pos` a position of the stream the point is on (a cross-attention's keys "
        "and values: the source's).",
        "",
        f"Architectures ({len(kinds)}): " + ", ".join(f"`{k}`" for k in kinds) + ".",
        "",
        "| point | shape | meaning | architectures |",
        "|---|---|---|---|",
    ]
    for point in known_points():
        shape, meaning = describe(point)
        have = sorted(every.get(point, ()))
        where = "all" if have == kinds else ", ".join(have) if have else "none of these"
        lines.append(f"| `{point}` | `{shape}` | {meaning} | {where} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- analyses and units


def _doc(obj) -> str:
    """The first paragraph of ``obj``'s docstring, on one line."""
    text = inspect.getdoc(obj) or ""
    return " ".join(text.split("\n\n")[0].split())


def _option_rows(options) -> list[str]:
    rows = ["| option | default | values | what |", "|---|---|---|---|"]
    for o in options:
        values = "a flag" if o.type is bool else o.range
        rows.append(f"| `{o.flag}` | `{_value(o.default)}` | {values} | {_cell(o.help)} |")
    return rows


def _schema_rows(schema: dict[str, str]) -> str:
    return ", ".join(f"`{c}` ({t})" for c, t in schema.items())


def analyses_page() -> str:
    import pandas as pd

    from analyses import DTYPES, REGISTRY, get
    from analyses.vocabulary import Role, Thresholds
    from probe.inputs import units

    rules = Thresholds().describe()
    lines = [
        "# Analyses and inputs",
        "",
        "Generated from each analysis's class declarations (`analyses.REGISTRY`) and each input "
        "unit's (`probe.inputs.units.UNITS`). Ask for analyses with `--analyses` (`-a`); those "
        f"that run by default are `{facts()['analyses.default']}`, of those that apply to the "
        "model. Every option below is a `probe analyze` option, checked before the model loads "
        "and recorded in `run.json`. Tables are CSV files in the report folder, layers and heads "
        "0-based.",
        "",
        "| analysis | title | default | reads |",
        "|---|---|---|---|",
    ]
    for name in REGISTRY:
        cls = get(name)
        reads = " or ".join(units.get(u).label for u in cls.units()) or "no stream"
        default = "yes" if cls.default else "by name"
        lines.append(f"| [`{name}`](#{name}) | {cls.title} | {default} | {reads} |")
    for name in REGISTRY:
        cls = get(name)
        module = sys.modules[cls.__module__]
        lines += ["", f"## `{name}` {{#{name}}}", "", f"**{cls.title}.** {_doc(module)}", ""]
        read = [f"`{u}` ({units.get(u).label})" for u in cls.units()]
        facts_ = [
            "runs by default" if cls.default else "runs when named in `--analyses`",
            "reads "
            + (
                " or ".join(read)
                if read
                else "no input stream: the weights, or inputs it "
                "makes and runs itself when it finishes"
            ),
        ]
        if cls.captures:
            facts_.append("captures " + ", ".join(f"`{c}`" for c in cls.captures))
        if cls.attention:
            facts_.append(f"of the attention `{cls.attention}`")
        if cls.rows:
            facts_.append("takes patterns a block of query rows at a time (long inputs)")
        lines += ["- " + f for f in facts_]
        lines += ["", "Tables:", ""]
        for table, schema in cls.tables.items():
            lines.append(f"- `{table}.csv`: {_schema_rows(schema)}")
        if cls.head_columns:
            measures = {m.column: m.label for m in cls.measures}
            cols = ", ".join(
                f"`{c}` ({t}{'; ' + measures[c] if c in measures else ''})"
                for c, t in cls.head_columns.items()
            )
            lines.append(f"- in `heads.csv`: {cols}")
        empty = {
            t: pd.DataFrame({c: pd.Series(dtype=DTYPES[k]) for c, k in s.items()})
            for t, s in cls.tables.items()
        }
        part = cls.heads(empty, Thresholds())
        roles = [r for r in Role if part is not None and str(r) in part.columns]
        if roles:
            lines += ["", "Roles it grants (default thresholds):", ""]
            lines += [f"- `{r}`: {rules[r]}" for r in roles]
        if cls.plots:
            drawn = "; ".join(f"`{name}-{p.id}`: {p.title}" for p in cls.plots)
            lines += ["", f"Figures (`probe figures`, `probe.plot`): {drawn}."]
        if cls.options:
            lines += ["", "Options:", "", *_option_rows(cls.options)]
    lines += [
        "",
        "## Inputs",
        "",
        "What the model reads for an analysis (`Analysis.unit`); the run streams each unit that a "
        "chosen analysis needs.",
    ]
    for name in units.UNITS:
        unit = units.get(name)
        source = {"treebank": "`--treebank`", "corpus": "`--corpus`"}.get(unit.input, "itself")
        lines += ["", f"### `{name}`: {unit.label}", "", f"{_doc(unit)} Input: {source}."]
        if unit.options:
            lines += ["", *_option_rows(unit.options)]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- command line


def cli_page() -> str:
    lines = [
        "# Command line",
        "",
        "Generated from `probe`'s commands. `probe COMMAND --help` prints the same.",
    ]
    for name, command in _commands().items():
        lines += ["", f"## `probe {name}`", "", _doc_text(command.help), ""]
        arguments = [p for p in command.params if p.param_type_name == "argument"]
        if arguments:
            usage = " ".join(p.name.upper() for p in arguments)
            lines += [f"`probe {name} {usage} [OPTIONS]`", ""]
        lines += ["| option | default | what |", "|---|---|---|"]
        for p in command.params:
            if p.param_type_name == "argument":
                continue
            flags = ", ".join(f"`{f}`" for f in p.opts + p.secondary_opts)
            default = "" if p.default is None or p.is_flag else f"`{_value(p.default)}`"
            lines.append(f"| {flags} | {default} | {_cell(p.help)} |")
    return "\n".join(lines) + "\n"


def _doc_text(text: str | None) -> str:
    return " ".join((text or "").split("\n\n")[0].split())


# ---------------------------------------------------------------- API


API_GROUPS = (
    ("Load and capture", ("load", "trace", "hooks", "Cache", "Hook", "HookPoint")),
    ("Weights", ("head_weights", "HeadWeights", "spectra", "copying_scores",
                 "composition_scores")),
    ("Patterns", ("head_types", "head_statistics", "attention_rows", "show", "View")),
    ("Interventions and circuits", ("ablate", "head_means", "patch", "attribute", "edges",
                                    "circuit", "qk_attribution", "qk_means")),
    ("Building blocks", ("MultiHeadAttention", "HeadId", "ProbeError")),
)  # fmt: skip


def api_page() -> str:
    import probe

    grouped = {n for _, names in API_GROUPS for n in names}
    missing = sorted(set(probe._EXPORTS) - grouped)
    unknown = sorted(grouped - set(probe._EXPORTS))
    if missing or unknown:
        raise ValueError(f"docs/generate.py API_GROUPS: add {missing}, remove {unknown}")
    lines = [
        "# Python API",
        "",
        "Generated from the docstrings of `probe`'s public names (`import probe`, then "
        "`probe.trace`, `probe.patch`…). Each is imported on first use. Shapes are in brackets, "
        "TransformerLens's dimension names; layers and heads are 0-based.",
    ]
    for title, names in API_GROUPS:
        lines += ["", f"## {title}", ""]
        for name in names:
            lines += [f"::: {probe._EXPORTS[name]}.{name}", ""]
    lines += ["## Figures in a notebook", "", "::: probe.plot", ""]
    return "\n".join(lines)


PAGES = {
    "reference/hooks.md": hooks_page,
    "reference/analyses.md": analyses_page,
    "reference/cli.md": cli_page,
    "reference/api.md": api_page,
}


# ---------------------------------------------------------------- MkDocs hooks

# The tutorials' kernels inherit these: offline, as the tests run them, and without progress
# bars or the warning tqdm gives in a kernel without widgets, which would show in the outputs.
TUTORIAL_ENVIRONMENT = {
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "PYTHONWARNINGS": "ignore:IProgress not found",
}


def on_config(config):
    for name, value in TUTORIAL_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    return config


def on_files(files, config):
    from mkdocs.structure.files import File

    for path, page in PAGES.items():
        files.append(File.generated(config, path, content=page()))
    return files


def on_page_markdown(markdown, page, config, files):
    """The page as written, its facts checked against the code (a stale one fails the build)."""
    if fill(markdown, page.file.src_path) != markdown:
        raise ValueError(
            f"{page.file.src_path}: its generated facts are stale; run python docs/generate.py "
            "--write"
        )
    return unmarked(markdown)


# What a page may not load from the web: the site reads offline (mkdocs.yml: theme.font false).
FROM_THE_WEB = re.compile(r"""<(?:link|script|img)\b[^>]*(?:href|src)=["']((?:https?:)?//[^"']+)""")


def on_post_build(config):
    """Fail the build on a link inside the site that leads nowhere, a page or an anchor in one
    (MkDocs checks the Markdown pages' links, not those in the rendered notebooks, nor their
    tables of contents), and on a page that loads anything, a font or a script, from the web."""
    site = Path(config["site_dir"]).resolve()
    pages = {p: p.read_text(encoding="utf-8", errors="replace") for p in site.rglob("*.html")}
    anchors = {page: set(re.findall(r'\bid="([^"]+)"', text)) for page, text in pages.items()}
    broken = []
    for page, text in pages.items():
        where = page.relative_to(site)
        for link, anchor in re.findall(r'href="([^"#:?]*)(?:#([^"]*))?"', text):
            if link.startswith(("/", "//")) or not (link.strip() or anchor):
                continue
            target = (page.parent / link).resolve() if link else page
            if target.is_dir() or not target.exists():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{where}: {link}")
            elif anchor and target.suffix == ".html" and anchor not in anchors.get(target, ()):
                broken.append(f"{where}: {link}#{anchor}")
        broken += [f"{where}: loads {url} from the web" for url in FROM_THE_WEB.findall(text)]
    if broken:
        found = "\n".join(sorted(set(broken)))
        raise ValueError(f"links to nothing in the site, or loads from the web:\n{found}")


def main(argv: list[str] | None = None) -> int:
    """``python docs/generate.py [--write]``: list (or rewrite) the pages whose facts are stale."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--write", action="store_true", help="rewrite the stale pages in place")
    parser.add_argument("--check", action="store_true", help="only list them (the default)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    found = stale(write=args.write)
    for path in found:
        print(f"{'rewrote' if args.write else 'stale'}: {path.relative_to(ROOT)}")
    return 0 if args.write or not found else 1


if __name__ == "__main__":
    sys.exit(main())
