"""Circuits: which heads a task needs, how they connect, and how much of the behaviour the
strongest connections carry.

The task is a batch of prompt pairs, clean and corrupted, with a metric of the model's output:

- ``repeats`` (the default): clean is BOS + A + A and corrupted BOS + A' + A, A' fresh random
  tokens in place of the first copy, so that nothing in the corrupted context predicts the
  second copy. The metric is the mean log-probability of the second copy's predictable next
  tokens (its first token cannot be predicted from what precedes it): the induction circuit's
  job;
- a ``.jsonl`` file of pairs, one JSON object a line with ``clean``, ``corrupted``, ``answer`` and
  optionally ``wrong`` (texts; the answer and wrong one token each): the metric is the logit
  difference answer − wrong at the last position, or, without ``wrong``, the answer's
  log-probability there.

The analysis runs the model itself when it finishes (no corpus streams for it): every head's
attribution (AtP on ``hook_z``, ``probe.attribute``), exact patching of the heads
the attribution ranks highest (``probe.patch``), every edge's EAP-IG score (``probe.edges``), the
fewest top edges reaching the faithfulness asked for, measured exactly (``probe.circuit``), and
the heads' composition scores from the weights (``probe.composition_scores``).

Heads are attributed by AtP (the gradient at the corrupted run), not by ``probe.attribute``'s
``"ig"``: that interpolates the run's input, so it estimates a head's share of the whole input's
change, not the effect of patching the head alone. On the induction model's repeats task it gives
the previous-token head +1.8 where patching it alone gives −2.3 (AtP: −0.5), and ranks the four
induction heads 2nd, 3rd, 6th and 7th (AtP: the top four).

How far to trust the circuit (``probe.circuit``'s ``Trust``): its edges' inclusion over
``--circuit-resamples`` bootstrap resamples of the pairs (``circuit_stability``), its
faithfulness under each ablation of the edges left out, at MIB's sizes, with intervals
(``circuit_ablations``) and MIB's CPR and CMD (``circuit_scores``), each pair's faithfulness
(``circuit_pairs``), and their summary in ``circuit_run`` (and ``run.json``'s ``circuit``).
``--circuit-ablation`` chooses the ablation the circuit is searched with.

The analysis is this module; its package holds ``task`` (the task's pairs, read and checked, and
its model inputs and metric), ``trust`` (the trust's tables and sentence), ``figures`` (the
page's graph and curves) and ``plots`` (their figures for papers).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from analyses import Analysis, Answer, Context, Measure, Schema
from analyses.circuit import trust as trust_io
from analyses.circuit.figures import (
    ablations_figure,
    faithfulness_figure,
    graph_figure,
    pairs_figure,
)
from analyses.circuit.task import (
    REPEATS,
    TaskOption,
    file_task,
    read_task,
    repeats_task,
    repeats_unit,
    task_name,
)
from analyses.figures import Plot
from analyses.vocabulary import Thresholds
from probe.errors import ProbeError
from probe.lazy import lazy
from probe.options import MAX_BYTES, Option, check_time, forward_flops

if TYPE_CHECKING:
    from probe.interventions.pairs import Metric

np = lazy("numpy")
pd = lazy("pandas")
torch = lazy("torch")

ATTRIBUTION = "atp"  # probe.attribute's method (see the module's docstring)
EDGE_METHOD = "eap-ig"
STEPS = 5
SHOWN = 10  # heads listed in the report
# How far outside exact patching's interval, as a share of the effect, an attribution must fall
# for the page to name the head: there the linear estimate misses, not only ranks differently.
MISSED = 0.5


TASK = TaskOption("task", REPEATS, "The circuit analysis's task: repeats, or a .jsonl file of "
                  "pairs (clean, corrupted, answer and optionally wrong).")  # fmt: skip
# No most: the runs take the pairs a chunk at a time within probe's budget (max_bytes), so memory
# does not grow with them (benchmarks/circuit_memory.py); the time does, about linearly.
PAIRS = Option("circuit_pairs", 16, "Prompt pairs of the circuit's task (repeats drawn; a task "
               "file's first ones).", min=2)  # fmt: skip
LENGTH = Option("circuit_length", 20, "Random tokens in each copy of the repeats task.", min=2)
FAITHFULNESS = Option("circuit_faithfulness", 0.8, "Faithfulness the circuit's edges must reach.",
                      min=0.0, max=1.0)  # fmt: skip
BUDGET = Option("circuit_max_bytes", MAX_BYTES, "What the circuit's runs may hold at once, in "
                "bytes (probe's max_bytes): more pairs take more chunks, not more memory.",
                min=1 << 20)  # fmt: skip
RESAMPLES = Option("circuit_resamples", 100, "Bootstrap resamples of the pairs for the "
                   "circuit's stability (no forward pass: the edges are re-ranked from their "
                   "per-pair scores).", min=2)  # fmt: skip
ABLATION = Option("circuit_ablation", "corrupted", "What the edges left out of the circuit carry "
                  "while it is searched: the corrupted run's values, their mean over the clean "
                  "runs, zero, or another pair's clean run's (every ablation is measured "
                  "beside it).", choices=trust_io.ABLATIONS)  # fmt: skip
PATCHED = Option("circuit_patched", 24, "Heads (the attribution's highest) checked by exact "
                 "patching.", min=1)  # fmt: skip


class Circuit(Analysis):
    """The task's heads, edges, circuit and composition, from forward and backward passes run
    when the analysis finishes."""

    name = "circuit"
    title = "Circuit"
    unit = None  # it makes and runs its own pairs when it finishes
    options = (TASK, PAIRS, LENGTH, FAITHFULNESS, PATCHED, BUDGET, RESAMPLES, ABLATION)
    default = False  # a task of the user's: asked for by name
    lm_head = True  # its metrics read the logits: --lm-head, checked when the run is planned
    tables: ClassVar[dict[str, Schema]] = {
        "circuit_heads": {
            "layer": "int", "head": "int", "attribution": "float", "attribution_low": "float",
            "attribution_high": "float", "attribution_rank": "int", "patched": "bool",
            "effect": "float", "effect_low": "float", "effect_high": "float",
            "recovered": "float", "in_circuit": "bool",
        },
        "circuit_edges": {
            "sender": "str", "receiver": "str", "input": "str", "score": "float",
            "score_low": "float", "score_high": "float", "in_circuit": "bool",
        },
        "circuit_faithfulness": {"edges": "int", "total_edges": "int", "faithfulness": "float"},
        "circuit_composition": {
            "kind": "str", "layer_from": "int", "head_from": "int", "layer_to": "int",
            "head_to": "int", "score": "float", "baseline": "float",
        },
        "circuit_run": {
            "task": "str", "metric": "str", "pairs": "int", "clean": "float",
            "corrupted": "float", "attribution": "str", "edge_method": "str", "steps": "int",
            "target": "float", "chosen_edges": "int", "total_edges": "int",
            "faithfulness": "float", "spearman": "float", **trust_io.RUN,
        },
        **trust_io.SCHEMAS,
    }  # fmt: skip
    head_columns: ClassVar[Schema] = {"circuit_attribution": "float", "circuit_effect": "float"}
    measures = (
        Measure("circuit_effect", "patching effect on the circuit's task", "num", "higher"),
        Measure("circuit_attribution", "attribution on the circuit's task", "num", "higher"),
    )

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        settings = {o.name: o.default for o in self.options} | context.options
        self.task = str(settings["task"])
        self.pairs = int(settings["circuit_pairs"])
        self.length = int(settings["circuit_length"])
        self.target = float(settings["circuit_faithfulness"])
        self.patched = int(settings["circuit_patched"])
        self.max_bytes = int(settings["circuit_max_bytes"])
        self.resamples = int(settings["circuit_resamples"])
        self.ablation = str(settings["circuit_ablation"])

    @classmethod
    def check_tokenizer(cls, tokenizer, config, options: dict[str, Any]) -> None:
        """A task file's pairs, tokenized as the run will: texts of different lengths, an
        answer of several tokens, a text longer than the model reads, refused before the
        weights load."""
        from probe.inputs.corpus import max_tokens

        settings = {o.name: o.default for o in cls.options} | options
        pairs, limit = int(settings["circuit_pairs"]), max_tokens(config, tokenizer)
        if settings["task"] != REPEATS:
            clean = file_task(Path(settings["task"]), tokenizer, pairs, limit)[0]
            tokens = clean["input_ids"].shape[1]
            given = len(clean["input_ids"])
            if settings["circuit_ablation"] == "resample" and given < 2:
                raise ProbeError(f"--circuit-ablation resample takes values from another "
                                 f"pair's run: {settings['task']} gives {given} pair; give at "
                                 "least 2 or another ablation")  # fmt: skip
        else:
            tokens = repeats_unit(tokenizer, 0, 1, int(settings["circuit_length"]), limit).length
        # Per pair, at least: attribution's clean run and corrupted run and backward, patching's
        # two runs and one a head patched, the edges' two runs and a run and backward a step,
        # and the circuit's curve's two ends. A backward counts as two forwards.
        # (one head patched at least: the estimate stays a lower bound whatever the model's heads)
        forwards = 4 + 2 + 1 + 2 + 3 * STEPS + 2
        per_pair = forwards * tokens * forward_flops(config)
        check_time(PAIRS.flag, pairs, pairs * per_pair, per_pair)

    @classmethod
    def unsupported(cls, model) -> str | None:
        from probe.capture.spec import describe
        from probe.pipeline.checkpoint import has_lm_head

        if model.get_output_embeddings() is None:
            return "the circuit's metric reads the model's predictions; add --lm-head"
        if has_lm_head(model.config.to_dict()) is False:  # a head tied to the embeddings
            saved = ", ".join(model.config.architectures)
            return (f"the checkpoint has no language-model head (its config.json names "
                    f"{saved}); give a checkpoint saved with its head")  # fmt: skip
        if not describe(model).causal:
            return "the circuit's tasks predict the next token: it needs a causal language model"
        from probe.interventions.graph import graph

        try:
            graph(model)
        except ProbeError as e:
            return str(e)
        return None

    def merge(self, other: Circuit) -> None:
        self._check_mergeable(other)  # nothing streams: the work is done when it finishes

    # -- the forward and backward passes, once ------------------------------------------

    def _tables(self) -> dict[str, pd.DataFrame]:
        try:
            return self._runs()
        except ProbeError as e:  # the library's budget is this option here
            raise ProbeError(re.sub(r"\bmax_bytes=?", BUDGET.flag + " ", str(e))) from None

    def _runs(self) -> dict[str, pd.DataFrame]:
        import probe

        model, L, H = self.context.model, self.context.n_layers, self.context.n_heads
        clean, corrupted, metric, kind = self._task()
        budget = {"max_bytes": self.max_bytes, "progress": False}  # the command draws its own
        attribution = probe.attribute(model, clean, corrupted, metric, ATTRIBUTION, **budget)
        attribution["attribution_rank"] = (
            (-attribution.attribution.abs()).rank(method="first").astype(int)
        )
        chosen = attribution.nsmallest(min(self.patched, L * H), "attribution_rank")
        heads = list(zip(chosen.layer.tolist(), chosen["head"].tolist(), strict=True))
        patching = probe.patch(model, clean, corrupted, metric, heads=heads, **budget)
        table = attribution.merge(patching.drop(columns="metric"), on=["layer", "head"], how="left")
        table["patched"] = table.effect.notna()
        seed, pairs = self.context.seed, len(clean["input_ids"])
        scores = probe.edges(model, clean, corrupted, metric, method=EDGE_METHOD, steps=STEPS,
                             resamples=self.resamples, seed=seed, **budget)  # fmt: skip
        # The resample ablation needs two pairs: with one it is left out, unless it was asked for.
        ablations = [a for a in trust_io.ABLATIONS if a != "resample" or pairs > 1]
        circuit, curve = probe.circuit(model, clean, corrupted, metric, self.target,
                                       scores=scores, ablation=self.ablation,
                                       ablations=ablations, resamples=self.resamples,
                                       seed=seed, **budget)  # fmt: skip
        scores["in_circuit"] = False
        scores.loc[circuit.index, "in_circuit"] = True
        nodes = set(circuit.sender) | set(circuit.receiver)
        named = [f"{layer}-{head}" for layer, head in zip(table.layer, table["head"], strict=True)]
        table["in_circuit"] = [name in nodes for name in named]
        checked = table[table.patched]
        spearman = math.nan
        if len(checked) >= 3:
            ranks = [checked[c].rank().to_numpy() for c in ("attribution", "effect")]
            spearman = float(np.corrcoef(*ranks)[0, 1])
        chosen_edges = int(curve.attrs["chosen"])
        strongest = scores.score.abs().to_numpy().argsort(kind="stable")[::-1]
        run = {
            "task": self.task, "metric": kind, "pairs": int(patching.attrs["pairs"]),
            "clean": float(patching.attrs["clean"]),
            "corrupted": float(patching.attrs["corrupted"]),
            "attribution": ATTRIBUTION, "edge_method": EDGE_METHOD, "steps": STEPS,
            "target": self.target, "chosen_edges": chosen_edges, "total_edges": len(scores),
            "faithfulness": float(curve.set_index("edges").faithfulness[chosen_edges]),
            "spearman": spearman,
        }  # fmt: skip
        prompts = None if self.task == REPEATS else read_task(Path(self.task))[: self.pairs]
        trust_tables, trust_run = trust_io.trust_tables(curve.attrs["trust"], scores, prompts)
        run |= trust_run
        return trust_tables | {
            "circuit_heads": table[list(self.tables["circuit_heads"])],
            # Strongest first: a CSV of a large model's edges holds its top ones (see
            # probe.app.tables.CSV_ROWS; the whole table is then circuit_edges.parquet).
            "circuit_edges": scores.iloc[strongest][list(self.tables["circuit_edges"])],
            "circuit_faithfulness": curve[list(self.tables["circuit_faithfulness"])],
            "circuit_composition": probe.composition_scores(model, seed=self.context.seed),
            "circuit_run": pd.DataFrame([run]),
        }

    def _task(self) -> tuple[dict, dict, Metric, str]:
        """The pairs' model inputs, clean and corrupted, on the model's device, the metric,
        and what it measures."""
        from probe.inputs.corpus import max_tokens
        from probe.pipeline.loading import main_device

        model, tokenizer = self.context.model, self.context.tokenizer
        limit = max_tokens(model.config, tokenizer)
        if self.task == REPEATS:
            clean, corrupted, metric = repeats_task(tokenizer, self.context.seed, self.pairs,
                                                    self.length, limit)  # fmt: skip
            kind = "mean log-probability of the second copy's predictable tokens"
        else:
            clean, corrupted, metric, kind = file_task(Path(self.task), tokenizer, self.pairs,
                                                       limit)  # fmt: skip
        device = main_device(model)
        clean = {k: v.to(device) for k, v in clean.items()}
        corrupted = {k: v.to(device) for k, v in corrupted.items()}
        return clean, corrupted, metric, kind

    # -- what the report shows -----------------------------------------------------------

    @classmethod
    def heads(cls, tables: dict[str, pd.DataFrame], thresholds: Thresholds) -> pd.DataFrame:
        t = tables["circuit_heads"]
        return pd.DataFrame({"layer": t.layer, "head": t["head"],
                             "circuit_attribution": t.attribution,
                             "circuit_effect": t.effect})  # fmt: skip

    plots = (
        Plot("graph", "The circuit's strongest edges", "analyses.paper:circuit_graph",
             page=lambda tables: graph_figure(tables), needs=("circuit_edges", "circuit_heads"),
             width="page"),
        Plot("faithfulness", "Faithfulness curve", "analyses.paper:circuit_faithfulness",
             page=lambda tables: faithfulness_figure(tables), needs=("circuit_faithfulness",)),
        Plot("ablations", "Faithfulness under each ablation",
             "analyses.circuit.plots:circuit_ablations",
             page=lambda tables: ablations_figure(tables), needs=("circuit_ablations",)),
        Plot("pairs", "Each pair's faithfulness", "analyses.circuit.plots:circuit_pairs",
             page=lambda tables: pairs_figure(tables), needs=("circuit_pairs",)),
    )  # fmt: skip

    @classmethod
    def answer(cls, tables: dict[str, pd.DataFrame], run: dict) -> Answer | None:
        """The circuit: the edges kept of all, the faithfulness they reach against the target,
        and the heads in it (by attribution rank)."""
        runs = tables["circuit_run"]
        if runs.empty:
            return None
        r = runs.iloc[0]
        kept, total = int(r.chosen_edges), int(r.total_edges)
        heads = tables["circuit_heads"]
        inside = heads[heads.in_circuit].sort_values("attribution_rank")
        named = tuple(zip(inside.layer.tolist(), inside["head"].tolist(), strict=True))
        reached = "reaching" if r.faithfulness >= r.target else "short of"
        trust = trust_io.trust_sentence(tables)
        text = (f"Circuit of the {task_name(r.task)}: {kept} of {total} edges "
                f"({kept / max(total, 1):.0%}) keep faithfulness {r.faithfulness:.2f}, "
                f"{reached} the {r.target:.2f} asked for. "
                + (f"{trust[0].upper()}{trust[1:]}. " if trust else "")
                + f"{len(named)} heads are in it" + (":" if named else "."))  # fmt: skip
        return Answer(text, named)

    @classmethod
    def finish_reads(cls, tables: dict[str, pd.DataFrame], run: dict) -> str | None:
        runs = tables["circuit_run"]
        if runs.empty:
            return None
        r = runs.iloc[0]
        return (f"{int(r.pairs)} prompt pairs of the {task_name(r.task)}, run when it finished, "
                "and the weights (composition)")  # fmt: skip

    @classmethod
    def section(cls, tables: dict[str, pd.DataFrame], run: dict) -> dict:
        runs = tables["circuit_run"]
        if runs.empty:
            return {"run": None}
        info = runs.iloc[0].to_dict()
        heads = tables["circuit_heads"].sort_values("attribution_rank")
        strongest = tables["circuit_edges"].query("in_circuit")
        strongest = strongest.reindex(strongest.score.abs().sort_values(ascending=False).index)
        scores = tables.get("circuit_scores")
        pairs = tables.get("circuit_pairs")
        worst = []
        if pairs is not None and len(pairs):
            worst = pairs[~pairs.set_aside.astype(bool)].nsmallest(5, "faithfulness")
            worst = worst.to_dict("records")
        return {
            "run": info,
            "trust": trust_io.trust_sentence(tables),
            "unstable": "jaccard" in info and trust_io.unstable(runs.iloc[0]),
            "scores": [] if scores is None else scores.to_dict("records"),
            "worst": worst,
            "names": trust_io.NAMES,
            "spearman": None if info["spearman"] != info["spearman"] else info["spearman"],
            "top": heads.head(SHOWN).to_dict("records"),
            "missed": missed(heads).to_dict("records"),
            "missed_share": MISSED,
            "edges": strongest.head(SHOWN).to_dict("records"),
        }


def missed(heads: pd.DataFrame) -> pd.DataFrame:
    """The patched heads of ``heads`` (``circuit_heads``) whose attribution falls outside exact
    patching's 95% interval (the effect itself without one) by more than ``MISSED`` of the
    effect, in attribution order: those whose effect the linear estimate misses, typically one
    that acts through later heads' attention (the induction model's previous-token head)."""
    patched = heads[heads.patched]
    low = patched.effect_low.fillna(patched.effect)
    high = patched.effect_high.fillna(patched.effect)
    outside = np.maximum(low - patched.attribution, patched.attribution - high)
    return patched[outside > MISSED * patched.effect.abs()]
