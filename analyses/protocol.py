"""The protocol every analysis follows: the ``Analysis`` base class, the ``Context`` it is
created with, the ``Measure`` and ``Answer`` it shows, and the column types of its tables.

An analysis follows one life cycle, like a scikit-learn estimator:

1. ``__init__(context)`` stores what it is told about the run (model shape, seed, thresholds);
2. for every batch: ``begin_batch``, ``update`` once per layer with that layer's captures (in
   layer order, while the model runs), ``end_batch``; it keeps sums, never attention maps;
3. ``merge(other)`` adds another instance's state exactly (another process's share);
4. ``finish()`` once, into typed tables.

What it shows is computed from its tables alone (``heads``, ``plots``, ``section``), so
``probe report`` can draw a report again from the CSV files. Its report section is a Jinja
template with a ``section`` and a ``card`` macro: by default ``templates/<name>.html.j2`` beside
its module (``template`` can return another).

This module imports nothing heavy: the command line reads the registry before loading torch.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self

from analyses.vocabulary import Role, Thresholds
from probe.options import Option

if TYPE_CHECKING:
    import pandas as pd
    from torch import nn

    from analyses.figures import Figure, Plot
    from probe.capture.rows import RowBlock
    from probe.inputs.corpus import Batch
    from probe.pipeline.runner import LayerCapture

# A table's columns and their types: "int", "float", "str", "bool", "Int64" (an integer
# that may be missing) or "boolean" (a bool that may be missing).
Schema = dict[str, str]
DTYPES = {
    "int": "int64",
    "float": "float64",
    "str": "object",
    "bool": "bool",
    "Int64": "Int64",
    "boolean": "boolean",
}


@dataclass(frozen=True)
class Measure:
    """A ``heads.csv`` column worth showing beside other analyses' (``probe compare``, the
    command line's summary, the overview grid): how to name and format it, which way is better,
    and the role a head must hold for the overview to show it (None: not shown there)."""

    column: str
    label: str
    format: Literal["pct", "num", "text"] = "num"
    better: Literal["higher", "lower"] | None = None
    role: Role | None = None
    unit: str = ""  # what the number is in, where "num" does not say (the summary's line)

    def show(self, value: Any) -> str:
        """``value`` as the report shows it (– for a missing one)."""
        if value is None or value != value or value == "":
            return "–"
        if self.format == "pct":
            return f"{100 * value:.1f}%"
        return f"{value:.3f}" if self.format == "num" else str(value)


@dataclass(frozen=True)
class Answer:
    """What an analysis found, in the words the page opens with (its overview): a sentence, and
    the heads it names (linked to their cards), ``(layer, head)`` each."""

    text: str
    heads: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Context:
    """What an analysis is told about the run when it is created."""

    n_layers: int
    n_heads: int
    causal: bool = False
    seed: int = 0
    thresholds: Thresholds = field(default_factory=Thresholds)
    model: nn.Module | None = None  # for analyses of the weights, or their own forward passes
    # The values of the analysis's ``options`` (defaults where the user gave none).
    options: dict[str, Any] = field(default_factory=dict)
    mask_token_id: int | None = None  # the tokenizer's, for analyses that mask words
    tokenizer: Any = None  # for analyses that make inputs of their own


class Analysis:
    """The protocol every analysis follows (see the module's docstring)."""

    name: ClassVar[str]
    title: ClassVar[str]
    # Hook suffixes this analysis reads, layer by layer, while a corpus streams through the
    # model (none: it sees only the batches).
    captures: ClassVar[tuple[str, ...]] = ()
    # What the model reads for it (``probe.inputs.units.UNITS``): single sentences, or "window"s of
    # consecutive sentences of one document (``probe.inputs.coreference.Windows``), whose batches
    # hold ``Window``s; several, as a tuple (``Batch.unit`` tells a batch's); a choice, as
    # ``probe.inputs.units.Either("text", "sentence")`` (a corpus when given, else sentences); None
    # for an analysis of the weights alone, which needs neither treebank nor forward pass.
    unit: ClassVar[str | tuple[str, ...] | None] = "sentence"
    # Which attention's captures it reads (``probe.capture.architectures.attentions``); None for the
    # model's first: its only one, or an encoder-decoder model's encoder self-attention.
    attention: ClassVar[str | None] = None
    tables: ClassVar[dict[str, Schema]] = {}
    head_columns: ClassVar[Schema] = {}  # what this analysis adds to heads.csv
    # Of those, what the app shows beside other analyses' measures.
    measures: ClassVar[tuple[Measure, ...]] = ()
    # Its settings: each becomes a command-line option, is checked, and is kept in run.json.
    options: ClassVar[tuple[Option, ...]] = ()
    default: ClassVar[bool] = True  # run when the user names no analyses
    # Whether it takes a layer's pattern in blocks of query rows (``update_rows``): it keeps sums
    # over queries, so that a long input's T × T pattern need never exist whole, and the model
    # runs its fast kernel (``probe.pipeline.runner.stream_rows``). Analyses that need a whole
    # pattern at once (syntax's word-level attention, say) leave it False.
    rows: ClassVar[bool] = False
    # Whether it reads the model's predictions: a run that names it needs ``--lm-head`` and a
    # checkpoint saved with its head, which the plan checks from the model's config.json before
    # the model loads (``probe.pipeline.checkpoint``); ``unsupported`` checks the loaded model.
    lm_head: ClassVar[bool] = False
    # Its figures, declared once: the page draws them as SVG, `probe figures` with seaborn.
    plots: ClassVar[tuple[Plot, ...]] = ()
    # What the command line's helper process (``probe.pipeline.helper``) runs while torch imports,
    # for the work this analysis hands it later: ``"module:function"``, called with no arguments.
    helper_warmup: ClassVar[str | None] = None
    # Whether it reads the other analyses' heads (their roles and relations) before it
    # finishes: the run finishes it after them and hands it their joined heads (``take_heads``).
    reads_heads: ClassVar[bool] = False
    # Of its units, those it reads only alongside another analysis of the run that reads them
    # (the claims read coreference windows only where coref gives coreference roles): a run
    # with none such does not stream them for it.
    alongside: ClassVar[tuple[str, ...]] = ()
    # Analyses after which it runs whenever a run has them (named or by default), as the split
    # of each role's scores follows the taxonomy and the circuit.
    follows: ClassVar[tuple[str, ...]] = ()
    # Whether it still runs where the run streams none of its units, their input unreadable by
    # the tokenizer (``probe.app.execute``): it makes inputs of its own when it finishes (the
    # claims' repeated sequences), and tests what it can without the units' inputs.
    runs_without_units: ClassVar[bool] = False

    def __init__(self, context: Context) -> None:
        self.context = context
        self.finished = False

    @classmethod
    def units(cls, given: set[str] | None = None) -> tuple[str, ...]:
        """The units it reads, in the order they are streamed: of a choice (``Either``), the one
        the run's inputs ``given`` pick (``{"treebank", "corpus"}``), or every one (None)."""
        from probe.inputs.units import Either

        unit = cls.unit
        declared = () if unit is None else unit if type(unit) is tuple else (unit,)
        names: list[str] = []
        for u in declared:
            names += [u] if not isinstance(u, Either) else u if given is None else [u.pick(given)]
        return tuple(dict.fromkeys(names))

    @classmethod
    def check_tokenizer(cls, tokenizer, config, options: dict[str, Any]) -> None:
        """Refuse, in one line (``ProbeError``), what this analysis's inputs (``options``, as
        resolved for the run) show it cannot do with the model's ``tokenizer`` and ``config``:
        called once they are loaded, before the weights are. Nothing by default."""

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
        """Add one layer of one batch; an analysis that takes ``rows`` is handed the whole
        pattern as one block."""
        if self.rows:
            from probe.capture.rows import RowBlock

            whole = RowBlock.whole(capture.pattern, capture.attention, batch.attention_mask)
            self.update_rows(batch, layer, whole)

    def update_rows(self, batch: Batch, layer: int, block: RowBlock) -> None:
        """Add one block of query rows of one layer's pattern (``probe.capture.rows.RowBlock``). A
        layer's blocks arrive in order, all before the next layer's; only analyses that declare
        ``rows`` are called."""
        raise NotImplementedError(f"{type(self).__name__} does not take rows")

    def end_batch(self, batch: Batch) -> None:
        """Called once the batch has been through every layer."""

    def hand_off(self) -> bool:
        """Called on every analysis once the batches are done, before any finishes: hand the
        slow work of ``finish`` that needs nothing but this analysis's state (a fit) to the
        helper process now (``probe.pipeline.helper.submit``), so that it runs while the other
        analyses
        finish (the run finishes those first).

        Returns
        -------
        bool
            Whether work was handed off.
        """
        return False

    def take_heads(self, heads: pd.DataFrame) -> None:
        """Called before ``finish`` on an analysis that ``reads_heads``, with the heads the
        other analyses of the run give (``probe.app.publish.join_heads``: ``roles`` and their
        ``head_columns``)."""

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
        """The page's figures: those of ``plots`` that have an SVG drawing and something to show."""
        from analyses.figures import page_figures

        return page_figures(cls.plots, tables)

    @classmethod
    def section(cls, tables: dict[str, pd.DataFrame], run: dict) -> dict[str, Any]:
        """What the report section's template reads, besides the figures."""
        return {}

    @classmethod
    def answer(cls, tables: dict[str, pd.DataFrame], run: dict) -> Answer | None:
        """What the analysis found beyond the roles it grants, said in the page's overview;
        None: nothing more (the roles say it)."""
        return None

    @classmethod
    def finish_reads(cls, tables: dict[str, pd.DataFrame], run: dict) -> str | None:
        """What the analysis reads of its own when it finishes, besides the input units it
        declares and the weights (the circuit: its task's prompt pairs), in words for the run
        card; None: nothing."""
        return None

    @classmethod
    def summary(cls, tables: dict[str, pd.DataFrame]) -> list[str]:
        """Lines for the command line's summary after a run; by default, the head with the best
        value of each measure that has a direction."""
        heads = tables.get("heads")
        lines = []
        for measure in cls.measures:
            if heads is None or measure.better is None or measure.column not in heads:
                continue
            values = heads[measure.column].astype(float)
            if values.notna().any():
                best = values.idxmax() if measure.better == "higher" else values.idxmin()
                row = heads.loc[best]
                unit = cls.measure_unit(measure, tables)
                lines.append(f"{measure.label}: best head {row.layer}-{row['head']} "
                             f"({measure.show(row[measure.column])}"
                             + (f" {unit})" if unit else ")"))  # fmt: skip
        return lines

    @classmethod
    def measure_unit(cls, measure: Measure, tables: dict[str, pd.DataFrame]) -> str:
        """What ``measure``'s numbers are in, for the summary: its ``unit`` by default; an
        analysis whose unit depends on the run (a loss, or a relative change) says so here."""
        return measure.unit

    @classmethod
    def template(cls) -> str:
        """The Jinja source of the report section: ``templates/<name>.html.j2`` beside the
        module that defines the class, or, where there is none, a section with the figures."""
        folder = Path(sys.modules[cls.__module__].__file__).parent
        path = folder / "templates" / f"{cls.name}.html.j2"
        return path.read_text(encoding="utf-8") if path.is_file() else DEFAULT_TEMPLATE

    def __getstate__(self) -> dict[str, Any]:
        """What another process needs to merge this instance (``probe.distributed``): the
        state, without the model or what was only needed for the current batch (``_`` names)."""
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        state["context"] = replace(self.context, model=None, tokenizer=None)
        return state

    def _check_mergeable(self, other: Analysis) -> None:
        if type(other) is not type(self) or other.context.n_layers != self.context.n_layers:
            raise ValueError(f"cannot merge {type(other).__name__} into {type(self).__name__}")
        if self.finished or other.finished:
            raise RuntimeError("an analysis that has finished cannot merge")


# The report section of an analysis without a template of its own: its figures, and in each head
# card its measures.
DEFAULT_TEMPLATE = """\
{% macro section(s, run) %}
{% for f in s.figures %}<figure>{{ f.html }}<figcaption>{{ f.figure.title }}</figcaption></figure>
{% endfor %}
{% endmacro %}
{% macro card(r) %}
{% for m in measures %}<dt>{{ m.label }}</dt><dd>{{ m.show(r[m.column]) }}</dd>{% endfor %}
{% endmacro %}
"""
