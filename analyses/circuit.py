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
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from analyses import Analysis, Answer, Context, Measure, Schema, svg
from analyses.figures import Figure, Plot
from analyses.vocabulary import Thresholds
from probe.errors import ProbeError
from probe.lazy import lazy
from probe.options import Option

if TYPE_CHECKING:
    from probe.interventions.pairs import Metric

np = lazy("numpy")
pd = lazy("pandas")
torch = lazy("torch")

REPEATS = "repeats"
ALL = slice(None)  # a metric's pairs where it is given every pair at once
FIELDS = ("clean", "corrupted", "answer")  # each line's required fields; ``wrong`` is optional
ATTRIBUTION = "atp"  # probe.attribute's method (see the module's docstring)
EDGE_METHOD = "eap-ig"
STEPS = 5
SHOWN = 10  # heads listed in the report
DRAWN_EDGES = 40  # at most this many of the circuit's edges drawn in its graph


@dataclass(frozen=True)
class Pair:
    """One line of a task file."""

    line: int
    clean: str
    corrupted: str
    answer: str
    wrong: str | None


def read_task(path: Path) -> list[Pair]:
    """The pairs of a ``.jsonl`` task file, checked.

    Raises
    ------
    ProbeError
        One line naming the file, the line and the field: a file that cannot be read, a line
        that is not a JSON object, a field missing or not a string, ``wrong`` on some lines
        but not others, or no pairs.
    """
    if not path.is_file():  # a folder, or a pipe that would hang the run waiting for a writer
        what = "no such file" if not path.exists() else "not a regular file"
        raise ProbeError(f"--task {path}: {what}; give repeats or a .jsonl file of pairs")
    pairs = []
    try:
        # Lines end at \n (JSON strings may hold U+2028, which str.splitlines would split at);
        # a byte-order mark is taken as UTF-8's.
        with path.open(encoding="utf-8-sig") as lines:
            for number, line in enumerate(lines, start=1):
                if line.strip():
                    pairs.append(_pair(path, number, line))
    except (OSError, UnicodeDecodeError) as e:
        raise ProbeError(f"--task {path}: cannot read it ({e}); give repeats or a .jsonl file "
                         "of pairs") from None  # fmt: skip
    if not pairs:
        raise ProbeError(f"{path}: no pairs; give one JSON object a line")
    with_wrong = [p.wrong is not None for p in pairs]
    if any(with_wrong) and not all(with_wrong):
        odd = pairs[with_wrong.index(not with_wrong[0])]
        raise ProbeError(f"{path} line {odd.line}: field 'wrong' is given on some lines and not "
                         "others; give it on every line (a logit difference) or none (the "
                         "answer's log-probability)")  # fmt: skip
    return pairs


def _pair(path: Path, number: int, line: str) -> Pair:
    """One line of a task file, checked (``read_task``)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ProbeError(f"{path} line {number}: not JSON ({e.msg})") from None
    except (RecursionError, ValueError) as e:  # nesting too deep, a number too long
        raise ProbeError(f"{path} line {number}: not JSON that can be read ({e})") from None
    if not isinstance(row, dict):
        raise ProbeError(f"{path} line {number}: not a JSON object with fields "
                         f"{', '.join(FIELDS)}")  # fmt: skip
    for field in (*FIELDS, "wrong"):
        if field not in row:
            if field == "wrong":
                continue
            raise ProbeError(f"{path} line {number}: no field {field!r}; each line needs "
                             "clean, corrupted and answer (wrong is optional)")  # fmt: skip
        if not isinstance(row[field], str) or not row[field]:
            raise ProbeError(f"{path} line {number}: field {field!r} must be a non-empty "
                             "string")  # fmt: skip
    return Pair(number, row["clean"], row["corrupted"], row["answer"], row.get("wrong"))


@dataclass(frozen=True)
class TaskOption(Option):
    """``--task``: ``repeats`` or a task file, which is read and checked when the run is planned,
    before the model loads."""

    def check(self, value: Any) -> Any:
        value = super().check(value)
        if value != REPEATS:
            read_task(Path(value))
        return value


TASK = TaskOption("task", REPEATS, "The circuit analysis's task: repeats, or a .jsonl file of "
                  "pairs (clean, corrupted, answer and optionally wrong).")  # fmt: skip
# No most: the runs take the pairs a chunk at a time within probe's budget (max_bytes), so memory
# does not grow with them (benchmarks/circuit_memory.py); the time does, about linearly.
PAIRS = Option("circuit_pairs", 16, "Prompt pairs of the circuit's task (repeats drawn; a task "
               "file's first ones).", min=2)  # fmt: skip
LENGTH = Option("circuit_length", 20, "Random tokens in each copy of the repeats task.", min=2)
FAITHFULNESS = Option("circuit_faithfulness", 0.8, "Faithfulness the circuit's edges must reach.",
                      min=0.0, max=1.0)  # fmt: skip
BUDGET = Option("circuit_max_bytes", 1 << 30, "What the circuit's runs may hold at once, in "
                "bytes (probe's max_bytes): more pairs take more chunks, not more memory.",
                min=1 << 20)  # fmt: skip
PATCHED = Option("circuit_patched", 24, "Heads (the attribution's highest) checked by exact "
                 "patching.", min=1)  # fmt: skip


class Circuit(Analysis):
    """The task's heads, edges, circuit and composition, from forward and backward passes run
    when the analysis finishes."""

    name = "circuit"
    title = "Circuit"
    unit = None  # it makes and runs its own pairs when it finishes
    options = (TASK, PAIRS, LENGTH, FAITHFULNESS, PATCHED, BUDGET)
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
            "faithfulness": "float", "spearman": "float",
        },
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

    @classmethod
    def check_tokenizer(cls, tokenizer, config, options: dict[str, Any]) -> None:
        """A task file's pairs, tokenized as the run will: texts of different lengths, an
        answer of several tokens, a text longer than the model reads, refused before the
        weights load."""
        from probe.inputs.corpus import max_tokens

        settings = {o.name: o.default for o in cls.options} | options
        if settings["task"] != REPEATS:
            file_task(Path(settings["task"]), tokenizer, int(settings["circuit_pairs"]),
                      max_tokens(config, tokenizer))  # fmt: skip

    @classmethod
    def unsupported(cls, model) -> str | None:
        from probe.capture.spec import describe
        from probe.run.checkpoint import has_lm_head

        if model.get_output_embeddings() is None:
            return "the circuit's metric reads the model's predictions; add --lm-head"
        if has_lm_head(model.config.to_dict()) is False:  # a head tied to the embeddings
            saved = ", ".join(model.config.architectures)
            return (f"the checkpoint has no language-model head (its config.json names "
                    f"{saved}); give a checkpoint saved with its head")  # fmt: skip
        if not describe(model).causal:
            return "the circuit's tasks predict the next token: it needs a causal language model"
        from probe.interventions.edges import graph

        try:
            graph(model)
        except ProbeError as e:
            return str(e)
        return None

    def merge(self, other: Circuit) -> None:
        self._check_mergeable(other)  # nothing streams: the work is done when it finishes

    # -- the forward and backward passes, once ------------------------------------------

    def _tables(self) -> dict[str, pd.DataFrame]:
        import probe

        model, L, H = self.context.model, self.context.n_layers, self.context.n_heads
        clean, corrupted, metric, kind = self._task()
        budget = {"max_bytes": self.max_bytes}
        attribution = probe.attribute(model, clean, corrupted, metric, ATTRIBUTION, **budget)
        attribution["attribution_rank"] = (
            (-attribution.attribution.abs()).rank(method="first").astype(int)
        )
        chosen = attribution.nsmallest(min(self.patched, L * H), "attribution_rank")
        heads = list(zip(chosen.layer.tolist(), chosen["head"].tolist(), strict=True))
        patching = probe.patch(model, clean, corrupted, metric, heads=heads, **budget)
        table = attribution.merge(patching.drop(columns="metric"), on=["layer", "head"], how="left")
        table["patched"] = table.effect.notna()
        scores = probe.edges(model, clean, corrupted, metric, method=EDGE_METHOD, steps=STEPS,
                             **budget)  # fmt: skip
        circuit, curve = probe.circuit(model, clean, corrupted, metric, self.target,
                                       scores=scores, **budget)  # fmt: skip
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
        return {
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
        from probe.run.loading import main_device

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
        text = (f"Circuit of the {task_name(r.task)}: {kept} of {total} edges "
                f"({kept / max(total, 1):.0%}) keep faithfulness {r.faithfulness:.2f}, "
                f"{reached} the {r.target:.2f} asked for; {len(named)} heads are in it"
                + (":" if named else "."))  # fmt: skip
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
        return {
            "run": info,
            "spearman": None if info["spearman"] != info["spearman"] else info["spearman"],
            "top": heads.head(SHOWN).to_dict("records"),
            "edges": strongest.head(SHOWN).to_dict("records"),
        }


def task_name(task: str) -> str:
    """The task in words: the repeats task (random tokens made for it) or a task file's."""
    if task == REPEATS:
        return "repeats task (random tokens, then the same again)"
    return f"task {Path(task).name}"


def repeats_task(tokenizer, seed: int, pairs: int, n: int, limit: int):
    """The repeats task's inputs ``{"input_ids": [pairs, T]}``, clean and corrupted, and its
    metric: clean is the specials before, A, A and the specials after; corrupted has A' (fresh
    tokens) in place of the first A. Drawn as ``probe.inputs.units.repeats`` draws its sequences
    (pair i: the repeat and null of sequence i, keyed to the seed)."""
    from probe.inputs.units import Source
    from probe.inputs.units.repeats import RepeatedSequences

    unit = RepeatedSequences(Source(seed=seed), tokenizer, limit,
                             options={"repeat_length": n, "repeat_sequences": pairs})  # fmt: skip
    s = len(unit.first)
    clean, corrupted = [], []
    for i in range(pairs):
        repeat, null = unit.pair(i)
        first, fresh = repeat[s : s + n], null[s + n : s + 2 * n]
        clean.append(repeat)
        corrupted.append([*unit.first, *fresh, *first, *unit.last])
    ids = torch.tensor(clean)
    other = torch.tensor(corrupted)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    corrupted_inputs = {"input_ids": other, "attention_mask": torch.ones_like(other)}
    # Positions s+n … s+2n−2 predict the second copy's tokens s+n+1 … s+2n−1.
    targets = ids[:, s + n + 1 : s + 2 * n]

    def metric(logits: torch.Tensor, pairs: slice = ALL) -> torch.Tensor:  # the logits' pairs
        logp = torch.log_softmax(logits[:, s + n : s + 2 * n - 1].float(), dim=-1)
        return logp.gather(-1, targets[pairs].to(logp.device)[..., None])[..., 0].mean(-1)

    return inputs, corrupted_inputs, metric


def file_task(path: Path, tokenizer, pairs: int, limit: int):
    """A task file's first ``pairs`` pairs as model inputs, right-padded alike, their metric
    at each pair's last real position, and what the metric measures.

    Raises
    ------
    ProbeError
        Naming the file and line: a pair whose texts differ in length in tokens, an answer or
        wrong token that is not one token, or a text longer than the model reads.
    """
    rows = read_task(path)[:pairs]
    clean, corrupted, answers, wrongs = [], [], [], []
    for p in rows:
        a, b = (tokenizer(text).input_ids for text in (p.clean, p.corrupted))
        if len(a) != len(b):
            raise ProbeError(f"{path} line {p.line}: clean is {len(a)} tokens and corrupted "
                             f"{len(b)}; a pair's texts need as many tokens")  # fmt: skip
        if len(a) > limit:
            raise ProbeError(f"{path} line {p.line}: {len(a)} tokens, more than the model's "
                             f"{limit}")  # fmt: skip
        clean.append(a)
        corrupted.append(b)
        for field, store in (("answer", answers), ("wrong", wrongs)):
            word = getattr(p, field)
            if word is None:
                continue
            ids = tokenizer(word, add_special_tokens=False).input_ids
            if len(ids) != 1:
                raise ProbeError(f"{path} line {p.line}: {field} {word!r} is {len(ids)} tokens; "
                                 "give one token (with its leading space where the tokenizer "
                                 "marks one)")  # fmt: skip
            store.append(ids[0])
    width = max(len(a) for a in clean)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    lengths = torch.tensor([len(a) for a in clean])
    mask = (torch.arange(width)[None] < lengths[:, None]).long()

    def padded(rows_: list[list[int]]) -> torch.Tensor:
        return torch.tensor([r + [pad] * (width - len(r)) for r in rows_])

    last = lengths - 1
    answer = torch.tensor(answers)
    wrong = torch.tensor(wrongs) if wrongs else None

    def metric(all_logits: torch.Tensor, pairs: slice = ALL) -> torch.Tensor:  # their pairs
        at = last[pairs].to(all_logits.device)
        logits = all_logits[torch.arange(len(at), device=at.device), at].float()
        picked = logits.gather(-1, answer[pairs].to(logits.device)[:, None])[:, 0]
        if wrong is None:
            return picked - logits.logsumexp(-1)
        return picked - logits.gather(-1, wrong[pairs].to(logits.device)[:, None])[:, 0]

    kind = "logit difference answer − wrong" if wrong is not None else "log-probability of answer"
    return (
        {"input_ids": padded(clean), "attention_mask": mask},
        {"input_ids": padded(corrupted), "attention_mask": mask.clone()},
        metric,
        kind + " at the last position",
    )


# -- figures -------------------------------------------------------------------------------

INPUT_COLOURS = {"q": svg.CATEGORIES[0], "k": svg.CATEGORIES[1], "v": svg.CATEGORIES[2],
                 "": svg.CATEGORIES[7]}  # fmt: skip


def drawn_edges(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """The circuit's edges that its graph draws: the ``DRAWN_EDGES`` of largest |score|."""
    edges = tables["circuit_edges"]
    kept = edges[edges.in_circuit]
    return kept.reindex(kept.score.abs().sort_values(ascending=False).index).head(DRAWN_EDGES)


def place(node: str, n_layers: int, n_heads: int) -> tuple[float, float]:
    """A node's place in the graph, ``(column, row)``: heads in their layer's row (a head's
    index its column), each layer's MLP right of its heads, a third of a row higher; the
    embeddings in row 0, below, and the logits in the top row, both centred."""
    if node == "embed":
        return (n_heads - 1) / 2, 0.0
    if node == "logits":
        return (n_heads - 1) / 2, n_layers + 1.0
    if node.startswith("mlp"):
        return float(n_heads), int(node[3:]) + 1 + 1 / 3
    layer, head = map(int, node.split("-"))
    return float(head), layer + 1.0


def graph_figure(tables: dict[str, pd.DataFrame]) -> Figure | None:
    """The circuit's strongest edges as a graph: one row of nodes per layer (the embeddings
    below, the logits on top), edges coloured by the input they enter, as inline SVG."""
    edges = tables.get("circuit_edges")
    if edges is None or edges.empty or not edges.in_circuit.any():
        return None
    kept = drawn_edges(tables)
    heads = tables["circuit_heads"]
    n_layers, n_heads = int(heads.layer.max()) + 1, int(heads["head"].max()) + 1
    step_x, step_y, left, top = 56, 70, 70, 30
    width = left + step_x * (n_heads + 1) + 40
    height = top + step_y * (n_layers + 1) + 40

    def at(node: str) -> tuple[float, float]:
        """A node's centre on the page: rows from the bottom."""
        column, row = place(node, n_layers, n_heads)
        return left + step_x * column, top + step_y * (n_layers + 1 - row)

    biggest = float(kept.score.abs().max()) or 1.0
    alt = ("A graph of the circuit's strongest edges: the embeddings at the bottom, one row of "
           "heads per layer above, the logits on top; lines coloured by the input they enter "
           "(query, key, value, or an MLP's or the logits'), thicker for larger "
           "scores.")  # fmt: skip
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" role="img" viewBox="0 0 {width} {height}" '
             f'width="{width}" height="{height}"><title>{escape(alt)}</title>']  # fmt: skip
    for row in kept.itertuples():
        (x1, y1), (x2, y2) = at(row.sender), at(row.receiver)
        into = f" ({row.input})" if row.input else ""
        label = f"{row.sender} → {row.receiver}{into}: {row.score:.3g}"
        parts.append(
            f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" '
            f'stroke="{INPUT_COLOURS.get(row.input, svg.CATEGORIES[7])}" stroke-opacity="0.75" '
            f'stroke-width="{0.8 + 4 * abs(row.score) / biggest:.2f}">'
            f"<title>{escape(label)}</title></line>"
        )
    nodes = dict.fromkeys([*kept.sender, *kept.receiver])
    for node in nodes:
        x, y = at(node)
        parts.append(
            f'<g><title>{escape(node)}</title><circle cx="{x:.1f}" cy="{y:.1f}" r="13" '
            f'fill="#f7f7f7" stroke="currentColor"/><text x="{x:.1f}" y="{y + 4:.1f}" '
            f'text-anchor="middle" font-size="10" {svg.FONT.replace("currentColor", "#222")}>'
            f"{escape(node)}</text></g>"
        )
    for k, (name, colour) in enumerate(
        (("query", INPUT_COLOURS["q"]), ("key", INPUT_COLOURS["k"]), ("value", INPUT_COLOURS["v"]),
         ("MLP, logits", INPUT_COLOURS[""]))
    ):  # fmt: skip
        y = 12 + 14 * k
        parts.append(f'<line x1="{width - 130}" y1="{y}" x2="{width - 110}" y2="{y}" '
                     f'stroke="{colour}" stroke-width="3"/><text x="{width - 104}" y="{y + 4}" '
                     f'font-size="10" {svg.FONT}>{escape(name)}</text>')  # fmt: skip
    parts.append("</svg>")
    title = f"The circuit's {len(kept)} strongest edges"
    return Figure("circuit-graph", title, alt, "".join(parts))


def faithfulness_figure(tables: dict[str, pd.DataFrame]) -> Figure | None:
    """The faithfulness of the top k edges against k, as inline SVG."""
    curve = tables.get("circuit_faithfulness")
    if curve is None or curve.empty:
        return None
    alt = ("A line chart of the circuit's faithfulness (its metric over the full model's, "
           "0 with every edge corrupted) against the number of top edges kept.")  # fmt: skip
    chart = svg.Chart(
        "Faithfulness",
        [svg.Series("faithfulness", curve.edges, curve.faithfulness)],
        f"top edges kept (of {int(curve.total_edges.iloc[0])})",
        "faithfulness",
        legend=False,
    )
    return Figure("circuit-faithfulness", "Faithfulness curve", alt, svg.charts([chart], alt=alt))
