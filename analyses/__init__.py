"""The analyses: one module each, with one ``Analysis`` subclass, listed in ``REGISTRY``.

An analysis follows one life cycle, like a scikit-learn estimator:

1. ``__init__(context)`` stores what it is told about the run (model shape, seed, thresholds);
2. for every batch: ``begin_batch``, ``update`` once per layer with that layer's captures (in
   layer order, while the model runs), ``end_batch``; it keeps sums, never attention maps;
3. ``merge(other)`` adds another instance's state exactly (another process's share);
4. ``finish()`` once, into typed tables.

What it shows is computed from its tables alone (``heads``, ``figures``, ``section``), so
``probe report`` can draw a report again from the CSV files. Its report section is a Jinja
template with a ``section`` and a ``card`` macro: by default ``templates/<name>.html.j2`` beside
its module (``template`` can return another).

This module imports nothing heavy: the command line reads the registry before loading torch.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Self

from analyses.vocabulary import Thresholds

if TYPE_CHECKING:
    import pandas as pd
    from torch import nn

    from analyses.figures import Figure
    from probe.corpus import Batch
    from probe.runner import LayerCapture

# name -> "module:class". Adding an analysis: one module in analyses/ and one line here.
REGISTRY: dict[str, str] = {
    "syntax": "analyses.syntax:Syntax",
    "roles": "analyses.roles:Roles",
    "spectra": "analyses.spectra:Spectra",
    "probe": "analyses.probing:AttentionProbe",
    "coref": "analyses.coreference:Coreference",
    "cross": "analyses.cross:CrossAttention",
    "importance": "analyses.importance:Importance",
}

# Analyses run only when asked for: they cost many forward passes.
OPT_IN = ("importance",)

# A table's columns and their types: "int", "float", "str", "bool", or "Int64" (an integer
# that may be missing).
Schema = dict[str, str]


def defaults() -> list[str]:
    """The analyses run when the user names none: all but the expensive ones (importance),
    read from the registry without importing the analyses' modules."""
    return [name for name in REGISTRY if name not in OPT_IN]


def get(name: str) -> type[Analysis]:
    """The analysis class registered as ``name`` (its module is imported now)."""
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


@dataclass(frozen=True)
class Context:
    """What an analysis is told about the run when it is created."""

    n_layers: int
    n_heads: int
    causal: bool = False
    seed: int = 0
    thresholds: Thresholds = field(default_factory=Thresholds)
    model: nn.Module | None = None  # for analyses of the weights, or their own forward passes
    # Settings of one analysis, by the CLI option's name (``importance_sentences``…).
    options: dict[str, Any] = field(default_factory=dict)


class Analysis:
    """The protocol every analysis follows (see the module's docstring)."""

    name: ClassVar[str]
    title: ClassVar[str]
    # Hook suffixes this analysis reads, layer by layer, while a corpus streams through the
    # model (none: it sees only the batches).
    captures: ClassVar[tuple[str, ...]] = ()
    # What the model reads for it: single sentences, or "window"s of consecutive sentences of
    # one document (``probe.coreference.Windows``), whose batches hold ``Window``s; None for an
    # analysis of the weights alone, which needs neither treebank nor forward pass.
    unit: ClassVar[str | None] = "sentence"
    # Which attention's captures it reads (``probe.architectures.attentions``); None for the
    # model's first: its only one, or an encoder-decoder model's encoder self-attention.
    attention: ClassVar[str | None] = None
    tables: ClassVar[dict[str, Schema]] = {}
    head_columns: ClassVar[Schema] = {}  # what this analysis adds to heads.csv

    def __init__(self, context: Context) -> None:
        self.context = context
        self.finished = False

    @classmethod
    def unsupported(cls, model: nn.Module) -> str | None:
        """Why this analysis cannot run on ``model``, or None. A run that chose its analyses by
        default leaves such an analysis out; one that named it stops with the reason."""
        return None

    @property
    def reads(self) -> int | None:
        """How many sentences from the treebank's start this analysis needs; None for all.
        When every analysis needs few, the run stops reading there."""
        return None

    def begin_batch(self, batch: Batch) -> None:
        """Called before ``batch`` runs through the model."""

    def update(self, batch: Batch, layer: int, capture: LayerCapture) -> None:
        """Add one layer of one batch."""

    def end_batch(self, batch: Batch) -> None:
        """Called once the batch has been through every layer."""

    def merge(self, other: Self) -> None:
        """Add the state of ``other``, an instance that saw other sentences, exactly."""
        raise NotImplementedError(f"{type(self).__name__} cannot merge")

    def finish(self) -> dict[str, pd.DataFrame]:
        """The tables (named as in ``tables``), once; the state is spent afterwards."""
        if self.finished:
            raise RuntimeError(f"the {self.name} analysis has already finished")
        self.finished = True
        return self._tables()

    def _tables(self) -> dict[str, pd.DataFrame]:
        raise NotImplementedError

    @classmethod
    def heads(cls, tables: dict[str, pd.DataFrame], thresholds: Thresholds) -> pd.DataFrame | None:
        """One row per head: ``layer``, ``head``, the ``head_columns`` and one bool column per
        ``Role`` this analysis grants (named by the role); None adds nothing."""
        return None

    @classmethod
    def figures(cls, tables: dict[str, pd.DataFrame]) -> list[Figure]:
        return []

    @classmethod
    def section(cls, tables: dict[str, pd.DataFrame], run: dict) -> dict[str, Any]:
        """What the report section's template reads, besides the figures."""
        return {}

    @classmethod
    def template(cls) -> str:
        """The Jinja source of the report section: ``templates/<name>.html.j2`` beside the
        module that defines the class."""
        folder = Path(sys.modules[cls.__module__].__file__).parent
        return (folder / "templates" / f"{cls.name}.html.j2").read_text(encoding="utf-8")

    def __getstate__(self) -> dict[str, Any]:
        """What another process needs to merge this instance (``probe.distributed``): the
        state, without the model or what was only needed for the current batch (``_`` names)."""
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        state["context"] = replace(self.context, model=None)
        return state

    def _check_mergeable(self, other: Analysis) -> None:
        if type(other) is not type(self) or other.context.n_layers != self.context.n_layers:
            raise ValueError(f"cannot merge {type(other).__name__} into {type(self).__name__}")
        if self.finished or other.finished:
            raise RuntimeError("an analysis that has finished cannot merge")
