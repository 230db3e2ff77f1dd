"""Why each head attends where it does: for every head the other analyses give a role or place
in the circuit, its attention score at the positions that role concerns, split exactly into what
wrote its query times what wrote its key (``probe.qk_attribution``).

Like the claims, it reads the other analyses' heads (``reads_heads``) and runs the model itself
when it finishes, on ``qk_sequences`` repeated random sequences (BOS, ``qk_repeat_length``
random tokens, the same again; the sequences ``RepeatedSequences.pair(2 · index)`` draws, the
taxonomy's and the claims' first ones), each query of the second copy with the key its role
concerns:

- previous-token: the token before (i − 1);
- duplicate-token: the same token in the first copy (i − n);
- induction: the token after that one (i − n + 1), the induction key;
- copying, and a circuit head (one of the ``qk_circuit_heads`` with the largest patching
  effect on the circuit's task) with none of these roles: the key it attends to most.

Each input's terms are averaged over its positions, then over inputs, with 95% t-intervals over
inputs. A side's contribution of a source is its terms summed over the other side's sources:
what the score gets through that side, the other side whole. The split freezes each norm's
scale at the clean run's value (TransformerLens's ``apply_ln_to_stack``), so the terms sum to
the score exactly.

It runs whenever the taxonomy or the circuit does (``follows``). Its memory is bounded by
``qk_max_bytes``: a head and a group of inputs at a time. The analysis is this module; its
package holds ``figures`` (the source × source heat map of each head).
"""

from __future__ import annotations

from typing import ClassVar

from analyses import Analysis, Context, Measure, Schema
from analyses.figures import Plot
from analyses.vocabulary import Role, Thresholds
from probe.lazy import lazy
from probe.options import Option

np = lazy("numpy")
pd = lazy("pandas")
torch = lazy("torch")

SEQUENCES = Option("qk_sequences", 8, "Repeated random sequences on which each head's scores "
                   "are split into what wrote its query and its key.", min=2)  # fmt: skip
LENGTH = Option("qk_repeat_length", 16, "Random tokens in each copy of those sequences.", min=2)
CIRCUIT_HEADS = Option("qk_circuit_heads", 8, "Circuit heads (largest patching effect) whose "
                       "scores are split, beside the heads with a role.", min=0)  # fmt: skip
BUDGET = Option("qk_max_bytes", 256 << 20, "What the split may hold at once, in bytes "
                "(probe's max_bytes).", min=1 << 20)  # fmt: skip
CIRCUIT = "circuit"
# role -> the key of query i, as an offset back from it in units of (1, n); None: most attended
KEYS: dict[str, tuple[int, int] | None] = {
    str(Role.PREVIOUS_TOKEN): (1, 0),
    str(Role.DUPLICATE_TOKEN): (0, 1),
    str(Role.INDUCTION): (-1, 1),
    str(Role.COPYING): None,
    CIRCUIT: None,
}
SHOWN = 3  # sources named per side in the section
DRAWN = 8  # sources per side in the heat map; the others summed into "other"
ROW_BYTES = 80  # the table's rows as qk_attribution returns them, and pandas' copies


class QK(Analysis):
    """Each role's head: its scores at the role's positions, split into query and key sources."""

    name = "qk"
    title = "Why each head attends"
    unit = None  # it makes and runs its own sequences when it finishes
    default = False
    follows: ClassVar[tuple[str, ...]] = ("taxonomy", "circuit")
    reads_heads: ClassVar[bool] = True
    options = (SEQUENCES, LENGTH, CIRCUIT_HEADS, BUDGET)
    tables: ClassVar[dict[str, Schema]] = {
        "qk": {
            "layer": "int", "head": "int", "role": "str", "side": "str", "source": "str",
            "contribution": "float", "low": "float", "high": "float", "positions": "int",
        },
        "qk_pairs": {
            "layer": "int", "head": "int", "role": "str", "query_source": "str",
            "key_source": "str", "contribution": "float",
        },
        "qk_scores": {
            "layer": "int", "head": "int", "role": "str", "score": "float", "low": "float",
            "high": "float", "inputs": "int", "positions": "int",
        },
    }  # fmt: skip
    head_columns: ClassVar[Schema] = {"qk_query_top": "str", "qk_key_top": "str"}
    measures = (
        Measure("qk_key_top", "largest key-side source of its score", "text"),
        Measure("qk_query_top", "largest query-side source of its score", "text"),
    )
    plots = (
        Plot("sources", "Each head's score split into query source x key source (mean over "
             "the role's positions)", "analyses.qk.figures:qk_sources", needs=("qk_pairs",),
             panels=tuple({"shown": i} for i in range(3)), width="page"),
    )  # fmt: skip

    @classmethod
    def unsupported(cls, model) -> str | None:
        from probe.capture.architectures import architecture
        from probe.capture.spec import describe
        from probe.interventions.qk import SPLITS

        spec = describe(model)
        if spec.encoder_decoder:
            return "scores are not split on encoder-decoder models yet"
        if spec.model_type not in SPLITS or architecture(model).fused == "linear":
            return f"qk_attribution does not split {spec.model_type}'s scores"
        return None

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        settings = {o.name: o.default for o in self.options} | context.options
        self.n_sequences = int(settings["qk_sequences"])
        self.length = int(settings["qk_repeat_length"])
        self.n_circuit = int(settings["qk_circuit_heads"])
        self.max_bytes = int(settings["qk_max_bytes"])
        self._heads = None

    def merge(self, other: QK) -> None:
        self._check_mergeable(other)  # nothing streamed: the work is done when it finishes

    def take_heads(self, heads: pd.DataFrame) -> None:
        """The other analyses' heads: their ``roles`` and the circuit's ``circuit_effect``."""
        self._heads = heads

    def _tables(self) -> dict[str, pd.DataFrame]:
        empty = {name: pd.DataFrame(columns=list(s)) for name, s in self.tables.items()}
        chosen = chosen_heads(self._heads, self.n_circuit)
        if chosen.empty or self.context.model is None:
            return empty
        ids, first = self._sequences()
        found = {"qk": [], "qk_pairs": [], "qk_scores": []}
        for (layer, head), roles in chosen.groupby(["layer", "head"], sort=True).role:
            for role in roles:
                for name, table in self._split(ids, first, layer, head, role).items():
                    found[name].append(table)
        return {name: pd.concat(found[name], ignore_index=True)[list(self.tables[name])]
                for name in self.tables}  # fmt: skip

    def _sequences(self) -> tuple[torch.Tensor, int]:
        """The repeated random sequences ``[sequences, pos]`` and where the first copy starts."""
        from probe.inputs.units.repeats import halves, ordinary_tokens, specials
        from probe.pipeline.loading import main_device

        tokenizer = self.context.tokenizer
        vocabulary = ordinary_tokens(tokenizer)
        before, after = specials(tokenizer)
        rows = []
        for index in range(self.n_sequences):
            drawn, _ = halves(self.context.seed, 2 * index, vocabulary, self.length)
            rows.append([*before, *drawn, *drawn, *after])
        return torch.tensor(rows, device=main_device(self.context.model)), len(before)

    def _split(self, ids, first: int, layer: int, head: int, role: str) -> dict[str, pd.DataFrame]:
        """One head's terms at its role's positions, a group of inputs at a time, reduced to
        each input's mean per (query source, key source)."""
        import probe

        n = self.length
        queries = list(range(first + n, first + 2 * n))
        offset = KEYS[role]
        keys = None if offset is None else {i: i - offset[0] - offset[1] * n for i in queries}
        n_layers, n_heads = self.context.n_layers, self.context.n_heads
        sources = 6 + layer * (n_heads + 2) + n_layers  # at most, with every bias a source
        per_input = len(queries) * sources**2 * ROW_BYTES
        group = max(1, (self.max_bytes // 2) // per_input)
        per_pair, scores = [], []
        for start in range(0, len(ids), group):
            part = ids[start : start + group]
            batch = {"input_ids": part, "attention_mask": torch.ones_like(part)}
            terms = probe.qk_attribution(
                self.context.model, batch, heads=[(layer, head)],
                query_positions=None if keys else queries, key_positions=keys,
                max_bytes=self.max_bytes,
            )  # fmt: skip
            terms["input"] += start
            names = {c: terms[c].astype(str) for c in ("query_source", "key_source")}
            terms = terms.assign(**names)
            per_pair.append(terms.groupby(["input", "query_source", "key_source"])
                            .contribution.sum() / len(queries))  # fmt: skip
            found = terms.attrs["scores"]
            scores.append(found.groupby(found.input + start).score.mean())
        return reduced(pd.concat(per_pair), pd.concat(scores), layer, head, role, len(queries))

    @classmethod
    def heads(cls, tables: dict[str, pd.DataFrame], thresholds: Thresholds) -> pd.DataFrame:
        """Per head split: its largest query-side and key-side sources (of its first role)."""
        table = tables["qk"]
        columns = ["layer", "head", *cls.head_columns]
        rows = []
        for (layer, head), own in table.groupby(["layer", "head"], sort=True):
            own = own[own.role == own.role.iloc[0]]
            top = {side: own[own.side == side].nlargest(1, "contribution").source
                   for side in ("query", "key")}  # fmt: skip
            rows.append({"layer": layer, "head": head,
                         "qk_query_top": next(iter(top["query"]), ""),
                         "qk_key_top": next(iter(top["key"]), "")})  # fmt: skip
        return pd.DataFrame(rows, columns=columns).astype({"layer": "int64", "head": "int64"})

    @classmethod
    def section(cls, tables: dict[str, pd.DataFrame], run: dict) -> dict:
        return {"heads": explained(tables), "sequences": run.get("options", {}).get("qk_sequences")}


def chosen_heads(heads: pd.DataFrame | None, n_circuit: int) -> pd.DataFrame:
    """One row per (layer, head, role) to split: each role of ``KEYS`` a head holds, and the
    ``n_circuit`` circuit heads of largest |patching effect| that hold none of them."""
    rows = []
    if heads is not None and len(heads):
        roles = heads["roles"] if "roles" in heads else pd.Series("", index=heads.index)
        held = {(int(r.layer), int(r.head)): [x for x in str(own or "").split(";") if x in KEYS]
                for r, own in zip(heads.itertuples(), roles, strict=True)}  # fmt: skip
        rows = [(layer, head, role) for (layer, head), own in held.items() for role in own]
        if "circuit_effect" in heads and n_circuit:
            effect = heads.set_index(["layer", "head"]).circuit_effect.astype(float).dropna()
            for layer, head in effect.abs().nlargest(n_circuit).index:
                if not held.get((int(layer), int(head))):
                    rows.append((int(layer), int(head), CIRCUIT))
    return pd.DataFrame(rows, columns=["layer", "head", "role"]).astype(
        {"layer": "int64", "head": "int64", "role": "object"}
    )


def reduced(per_pair, scores, layer: int, head: int, role: str, positions: int) -> dict:
    """The tables' rows of one (head, role): ``per_pair`` (each input's mean term per (query
    source, key source)) averaged over inputs, per side with 95% t-intervals over inputs."""
    from probe.inference import t975

    wide = per_pair.unstack("input", fill_value=0.0)  # [(query, key) source pairs, inputs]
    n = wide.shape[1]

    def summary(values: pd.DataFrame) -> pd.DataFrame:
        v = values.to_numpy(np.float64)
        mean = v.mean(1)
        half = t975(n - 1) * v.std(1, ddof=1) / np.sqrt(n) if n > 1 else np.nan
        return pd.DataFrame({"contribution": mean, "low": mean - half, "high": mean + half},
                            index=values.index)  # fmt: skip

    base = {"layer": layer, "head": head, "role": role}
    sides = []
    for side, level in (("query", "query_source"), ("key", "key_source")):
        own = summary(wide.groupby(level=level, observed=True).sum())
        own = own.sort_values("contribution", ascending=False).rename_axis("source")
        sides.append(own.reset_index().assign(**base, side=side, positions=positions * n))
    key_side = sides[1].set_index("source").contribution
    query_side = sides[0].set_index("source").contribution
    pairs = wide.mean(axis=1).rename("contribution").reset_index()
    pairs["query_source"] = _top_or_other(pairs.query_source, query_side)
    pairs["key_source"] = _top_or_other(pairs.key_source, key_side)
    pairs = pairs.groupby(["query_source", "key_source"], sort=False).contribution.sum()
    s = scores.to_numpy(np.float64)
    half = t975(n - 1) * s.std(ddof=1) / np.sqrt(n) if n > 1 else np.nan
    score = {**base, "score": s.mean(), "low": s.mean() - half, "high": s.mean() + half,
             "inputs": n, "positions": positions * n}  # fmt: skip
    return {
        "qk": pd.concat(sides, ignore_index=True).astype({"source": str}),
        "qk_pairs": pairs.reset_index().assign(**base),
        "qk_scores": pd.DataFrame([score]),
    }


def _top_or_other(sources: pd.Series, side: pd.Series) -> pd.Series:
    """Each source, or ``other`` where it is not among the side's ``DRAWN`` largest |terms|."""
    top = set(side.abs().nlargest(DRAWN).index.astype(str))
    named = sources.astype(str)
    return named.where(named.isin(top), "other")


def explained(tables: dict[str, pd.DataFrame]) -> list[dict]:
    """Each (head, role) in words, for the page: its mean score and the ``SHOWN`` largest
    sources of each side with their intervals."""
    table, scores = tables["qk"], tables["qk_scores"]
    out = []
    for r in scores.itertuples():
        own = table[(table.layer == r.layer) & (table["head"] == r.head) & (table.role == r.role)]
        sides = {side: own[own.side == side].nlargest(SHOWN, "contribution").to_dict("records")
                 for side in ("query", "key")}  # fmt: skip
        out.append({"layer": r.layer, "head": r.head, "role": r.role, "score": r.score,
                    "low": r.low, "high": r.high, "inputs": r.inputs, "positions": r.positions,
                    **sides})  # fmt: skip
    return out
