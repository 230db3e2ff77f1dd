"""The report page's Jinja environment and its compiled templates.

Compiling the page's template and the analyses' takes 0.16 s of a run. A run's helper process
(``probe.pipeline.helper``) compiles them while this process imports torch, and sends the code back,
marshalled, as Jinja's bytecode caches keep it: so this module imports neither torch nor pandas.
"""

from __future__ import annotations

import marshal
import math
from functools import cache
from types import CodeType

from jinja2 import Environment, PackageLoader, Template, select_autoescape
from markupsafe import Markup, escape

import analyses
from probe.heads import HeadId
from probe.inputs import units
from probe.pipeline import helper

# Below this many sentences a report says, at the top, that its findings are preliminary (the
# 76-sentence sample gives 35 sink heads where 300 EWT sentences give 14).
PRELIMINARY = 500


def environment() -> Environment:
    """The Jinja environment of every page probe writes: its templates, everything escaped."""
    return Environment(
        loader=PackageLoader("probe.app", "templates"),
        autoescape=select_autoescape(["html", "j2"], default_for_string=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )


def _number(x, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _treebank(path: str) -> Markup:
    """A treebank as the run card names it: a bundled one by name, not by this machine's path."""
    from probe.inputs.treebank import BUNDLED, UD_TREEBANKS

    release = UD_TREEBANKS["en_ewt"].release
    names = {
        str(BUNDLED["ewt-dev"]): f"UD English EWT {release} dev (bundled with probe; CC BY-SA 4.0)",
        str(BUNDLED["sample"]): "the hand-written sample (bundled with probe)",
    }
    return Markup(escape(names[path])) if path in names else Markup(f"<code>{escape(path)}</code>")


@cache
def page_environment() -> Environment:
    """``render_html``'s environment, one per process: it keeps the templates it compiles."""
    env = environment()
    env.filters["num"] = _number
    env.filters["pct"] = lambda x: "–" if x is None or x != x else f"{100 * x:.1f}%"
    env.globals["HeadId"] = HeadId
    env.globals["PRELIMINARY"] = PRELIMINARY
    env.filters["treebank"] = _treebank
    env.filters["unit"] = lambda name: units.get(name).label if name in units.UNITS else name
    return env


PAGE = "report.html.j2"
_CODE: dict[str, CodeType] = {}  # each template source's compiled code, in this process


def compiled(source: str, name: str | None = None) -> CodeType:
    """A template's code, compiled by the page's environment once per process."""
    if source not in _CODE:
        _CODE[source] = page_environment().compile(source, name, name)
    return _CODE[source]


def template_code(templates: tuple[tuple[str | None, str], ...]) -> list[bytes]:
    """The ``(name, source)`` templates compiled by the page's environment, as marshalled code:
    what the helper process sends back (``compile_templates``), as Jinja's bytecode caches
    keep it."""
    return [marshal.dumps(compiled(source, name)) for name, source in templates]


def warm_up() -> None:
    """Compile the page's template and every registered analysis's: the helper process does it
    while torch imports (``probe.pipeline.helper``), and keeps the code for
    ``compile_templates``."""
    template_code(_templates(list(analyses.REGISTRY)))


def _templates(names: list[str]) -> tuple[tuple[str | None, str], ...]:
    """The page's template and those of the analyses ``names``, as ``(name, source)``."""
    env = page_environment()
    page = (PAGE, env.loader.get_source(env, PAGE)[0])
    return (page, *((None, analyses.get(name).template()) for name in names))


def compile_templates(names: list[str]) -> None:
    """Compile the page's template and those of the analyses ``names``, once per process, before
    the page is rendered: compiled by the helper process where there is one (it did so while
    torch imported, and sends the code in a few milliseconds, where compiling here took 0.16 s
    of the run), else here."""
    missing = tuple(t for t in _templates(names) if t[1] not in _CODE)
    if missing:
        code = helper.call(template_code, missing)
        _CODE.update(zip((source for _, source in missing), map(marshal.loads, code), strict=True))


@cache
def page_template() -> Template:
    """The page's template, from its compiled code (``compile_templates``)."""
    env = page_environment()
    compile_templates([])
    code = compiled(env.loader.get_source(env, PAGE)[0], PAGE)
    return env.template_class.from_code(env, code, env.make_globals(None))
