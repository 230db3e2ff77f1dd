"""What ``probe analyze`` and ``probe timeline`` share on the command line: a keyword option per
option the analyses and units declare (``with_declared_options``), the Settings their options
make (``settings_of``), and what the helper process warms up while torch imports (``warmups``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from dataclasses import fields

import typer

from probe.app.plan import Settings
from probe.errors import ProbeError


def warmups(classes: Iterable[type]) -> list[str]:
    """What the helper process does while torch imports (``probe.pipeline.helper.start``): compile
    the report's templates, and warm up what the analyses ``classes`` will hand it."""
    return ["probe.app.page:warm_up", *(c.helper_warmup for c in classes if c.helper_warmup)]


def with_declared_options(command: Callable) -> Callable:
    """``command`` with one keyword option per option the analyses and units declare
    (``probe.options.Option``), shown in their help with type, range and default."""
    from analyses import ContractError
    from probe.app.plan import declared_options

    signature = inspect.signature(command)
    core = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    taken = {p.name for p in core}
    extra = []
    try:
        declared = [option for option, _ in declared_options().values()]
    except ContractError:  # two analyses disagree on an option: the run's plan says so
        declared = []
    for option in declared:
        if option.name in taken:  # the run's plan refuses it, naming the analysis
            continue
        help = option.help + (f" One of: {option.range}." if option.choices else "")
        declared = typer.Option(
            None,
            option.flag,
            help=help + f"  [default: {option.default}" + (
                f"; {option.range}" if option.min is not None or option.max is not None else ""
            ) + "]",
            show_default=False,
        )  # fmt: skip
        kind = option.type if option.type is not bool else bool
        extra.append(inspect.Parameter(option.name, inspect.Parameter.KEYWORD_ONLY,
                                       default=declared, annotation=kind | None))  # fmt: skip

    @functools.wraps(command)
    def wrapped(**kwargs):
        return command(**kwargs)

    wrapped.__signature__ = signature.replace(parameters=[*core, *extra])
    return wrapped


def settings_of(given: dict) -> Settings:
    """The Settings of ``probe analyze``'s options as the command received them: ``analyses``
    comma-separated, ``threshold`` a list of NAME=NUMBER, the declared options in ``options``,
    ``quiet`` left out; those that are no Settings field (given as keywords, as ``probe
    timeline`` receives them) are options too.

    Raises
    ------
    ProbeError
        For a threshold that is not NAME=NUMBER.
    """
    core = {f.name for f in fields(Settings)} - {"thresholds", "options"}
    values = {k: v for k, v in given.items() if k in core}
    declared = {k: v for k, v in given.items() if k not in core | {"quiet", "threshold", "options"}}
    thresholds = {}
    for item in given.get("threshold") or []:
        name, _, value = item.partition("=")
        try:
            thresholds[name.strip().replace("-", "_")] = float(value)
        except ValueError:
            raise ProbeError(f"--threshold {item!r} is not NAME=NUMBER (e.g. sink=0.5)") from None
    chosen = values.get("analyses")
    values["analyses"] = (
        [a.strip() for a in chosen.split(",") if a.strip()] if chosen is not None else None
    )
    values["treebank"] = values.get("treebank") or None
    options = {
        name: value
        for name, value in (given.get("options", {}) | declared).items()
        if value is not None
    }
    return Settings(**values, thresholds=thresholds, options=options)
