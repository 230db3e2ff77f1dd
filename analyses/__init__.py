"""The analyses: one module each (a package where it has parts of its own), with one
``Analysis`` subclass, listed in ``REGISTRY``.

An analysis follows one life cycle, like a scikit-learn estimator (``analyses.protocol``):
created with its ``Context``, fed every batch layer by layer, merged with other processes'
shares, finished once into typed tables, from which alone it shows its heads, figures and
report section.

This package's ``__init__`` holds the registry: ``REGISTRY``, the lookups (``get``, ``defaults``,
``followers``, ``shipped``) and ``check_analysis``; it re-exports the protocol's names and the
contract's. Its other modules: ``protocol`` (``Analysis``, ``Context``, ``Measure``, ``Answer``,
the column types), ``contract`` (the checks every analysis passes), ``vocabulary`` (roles and
thresholds), ``figures``, ``svg`` and ``paper`` (the figures), ``head_map`` (the roles' map of
heads by similarity), and one module per analysis; an analysis with parts of its own is a package
whose ``__init__`` is the analysis (``claims``, ``circuit``, ``qk``).

This module imports nothing heavy: the command line reads the registry before loading torch.
"""

from __future__ import annotations

import importlib

from analyses.contract import ContractError, check_declaration, check_head_columns
from analyses.protocol import (
    DEFAULT_TEMPLATE,
    DTYPES,
    Analysis,
    Answer,
    Context,
    Measure,
    Schema,
)

__all__ = [  # re-exported: the protocol's names and the contract's, as before the split
    "DEFAULT_TEMPLATE", "DTYPES", "REGISTRY", "Analysis", "Answer", "Context", "ContractError",
    "Measure", "Schema", "check_analysis", "check_head_columns", "defaults", "followers", "get",
    "shipped",
]  # fmt: skip

# name -> "module:class". Adding an analysis: one module in analyses/ and one line here.
REGISTRY: dict[str, str] = {
    "syntax": "analyses.syntax:Syntax",
    "roles": "analyses.roles:Roles",
    "spectra": "analyses.spectra:Spectra",
    "probe": "analyses.probing:AttentionProbe",
    "coref": "analyses.coreference:Coreference",
    "cross": "analyses.cross:CrossAttention",
    "importance": "analyses.importance:Importance",
    "taxonomy": "analyses.taxonomy:Taxonomy",
    "retrieval": "analyses.retrieval:Retrieval",
    "circuit": "analyses.circuit:Circuit",
    "claims": "analyses.claims:Claims",
    "qk": "analyses.qk:QK",
}


_SHIPPED = dict(REGISTRY)  # as probe ships it, whatever is registered later


def shipped(cls: type[Analysis]) -> bool:
    """Whether ``cls`` is one of the analyses probe ships, as it ships it (each passes
    ``check_analysis`` in full in ``tests/analyses/test_contract.py``)."""
    return _SHIPPED.get(getattr(cls, "name", None)) == f"{cls.__module__}:{cls.__qualname__}"


def get(name: str) -> type[Analysis]:
    """The analysis class registered as ``name`` (its module is imported now).

    Raises
    ------
    ContractError
        When the class breaks the analysis contract (``check_analysis``).
    """
    module, cls = REGISTRY[name].split(":")
    found = getattr(importlib.import_module(module), cls)
    check_analysis(found, name, full=False)
    return found


def defaults() -> list[str]:
    """The analyses run when the user names none: those whose class says so (``default``), in
    the registry's order."""
    return [name for name in REGISTRY if get(name).default]


def followers(names: list[str]) -> list[str]:
    """The analyses that run whenever one of ``names`` does (their ``follows``), not already in
    ``names``, in the registry's order."""
    return [name for name in REGISTRY
            if name not in names and set(get(name).follows) & set(names)]  # fmt: skip


def check_analysis(cls: type, key: str | None = None, *, full: bool = True) -> None:
    """Check what an analysis declares, before any compute (as scikit-learn's
    ``check_estimator`` checks an estimator).

    Parameters
    ----------
    cls : type
        The class.
    key : str, optional
        The name it is registered under, which must be its ``name``.
    full : bool
        Also run ``heads`` on empty tables of the declared schemas (imports pandas: the run's
        plan does it; looking an analysis up does the rest). Without it, the template of an
        analysis probe ships is not parsed either: ``tests/analyses/test_contract.py`` checks it in
        full, and parsing every template took 0.15 s of each start of the command.

    Raises
    ------
    ContractError
        One line naming the analysis and what is wrong.
    """
    if isinstance(cls, type) and {(cls, key, full), (cls, key, True)} & _PASSED:
        return
    # a shipped template is parsed by its test, not at each start
    check_declaration(cls, key, template=full or not shipped(cls), heads=full)
    _PASSED.add((cls, key, full))


# The checks passed in this process, by (class, key, full): a class's declaration does not
# change, and a run looks its analyses up dozens of times (and plans twice).
_PASSED: set[tuple[type, str | None, bool]] = set()
