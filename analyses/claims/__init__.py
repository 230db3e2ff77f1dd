"""Claims tested by ablation: does knocking out a head that the page gives a role or a relation
change the behaviour the claim is about, more than knocking out its unclaimed neighbours does?

A head's role comes from its attention pattern: evidence of what it reads, not of what it does.
Once the other analyses have made their tables, every head that holds a tested claim is ablated
alone (by its mean z over the inputs below, by zero, or by another input's z), and so are, on
each input, heads of the same layer that hold no claim, on a bounded sample of the run's inputs:

- a syntactic relation (a head's best relation, role or not): the first ``claims_sentences``
  sentences with a word bearing the relation, by a key of the seed and the sentence's position
  in the treebank (``probe.keys``: the same sample whatever the batches or processes), measured
  at the tokens of the words that bear the relation (the dependents);
- previous-token, duplicate-token and induction: ``claims_sequences`` repeated random sequences
  (``probe.inputs.units.repeats``, the taxonomy's first ones), measured at the second copy;
- coreference: the ``claims_windows`` coreference windows (``probe.inputs.coreference``) of
  smallest key (the seed, the window's document and first sentence) among those with a scored
  mention, measured at the tokens of the scored mentions' head words (where the coreference
  analysis reads a head's attention);
- retrieval (a decoder's): ``claims_needles`` needle-in-a-haystack trials
  (``probe.patterns.retrieval``, the needle present) in a haystack of ``claims_haystack``
  tokens, the treebank's first sentences, at evenly spaced depths, measured at the positions that
  predict the answer's tokens (where the model copies them from the needle).

With a language-model head the measure is the rise of the next-token loss read at those tokens
(for a decoder: the dependents' next tokens; the second copy's tokens after its first, which
induction can predict, so read at the second copy's positions but its last: after BOS and L
tokens, L + 1 to 2L − 1); without
one, the relative change ‖h′ − h‖ / ‖h‖ of the last hidden state at them. Per input (a sentence,
a sequence: the clusters), the claimed head's mean change is paired with the mean over its
layer's unclaimed heads drawn for that input (the baseline: ``claims_baseline_heads`` of them,
drawn afresh for every input by a key of the seed, the head and the input; where every head of
the layer holds a claim, of the nearest layers' unclaimed heads), and the claim is confirmed
where the paired difference is above 0 by a one-sided t-test, after the Benjamini–Hochberg
correction over every claim tested (``probe.inference``), on at least
``MIN_CLUSTERS`` inputs; on fewer the verdict says so.

Each claim is also measured on its control, where the claimed behaviour cannot happen (the
first copy of the repeats; the same inputs shuffled otherwise), and must beat it as well as the
neighbours (the control alone where the neighbours are fewer than two heads); heads holding the
same claim are ablated together too, each head's Shapley share of the joint effect beside its
row (``groups``); every p-value goes through one Benjamini–Hochberg correction (``verdicts``).

The samples are kept during the stream (token ids and each token's relation or mark; for the
haystack, a decoder's first sentences' text); the ablated passes run when the analysis finishes,
a row per (head, input) pair a claim reads stacked after the inputs' own, and nothing else
(``probe.interventions.ablation_rows.ablation_effects``), in fixed groups of inputs, so that
``--batch-size`` changes nothing, ``MAX_TOKENS`` tokens a pass at most.

The analysis is this module: its options, the sampling during the stream, and the tables and
page. Its package holds the rest: ``inputs`` (which claims each kind of input tests, and the
model inputs made from what was kept), ``ablation_test`` (``AblationTest``: the ablations, the
baselines and each claim's statistics), ``groups`` (the groups, their shares, the controls)
and ``verdicts`` (the claims a run lists, their verdicts in one correction, in words).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from analyses import Analysis, Context, Measure, Schema
from analyses.claims import inputs as claim_inputs
from analyses.claims.ablation_test import AblationTest
from analyses.claims.inputs import (
    ON_NEEDLES,
    ON_REPEATS,
    ON_SENTENCES,
    ON_WINDOWS,
    RELATION,
)
from analyses.claims.verdicts import claim_name, listed_claims, verdict, verdicts, with_columns
from analyses.figures import Plot
from analyses.vocabulary import DESCRIBED_FIRST, Thresholds
from probe.errors import ProbeError
from probe.inference import FDR, MIN_CLUSTERS
from probe.keys import uniform
from probe.lazy import lazy
from probe.options import Option

if TYPE_CHECKING:
    from probe.inputs.corpus import Batch

np = lazy("numpy")
pd = lazy("pandas")
torch = lazy("torch")

SENTENCES = Option("claims_sentences", 16,
                   "Sentences per claimed relation the claims' ablations run on.",
                   min=1)  # fmt: skip
SEQUENCES = Option("claims_sequences", 12,
                   "Repeated random sequences the claims' ablations run on.", min=1)  # fmt: skip
LENGTH = Option("claims_repeat_length", 16,
                "Random tokens in each half of the claims' repeated sequences.", min=2)  # fmt: skip
WINDOWS = Option("claims_windows", 12,
                 "Coreference windows the claims' ablations run on.", min=1)  # fmt: skip
NEEDLES = Option("claims_needles", 12,
                 "Needle-in-a-haystack trials the retrieval claims' ablations run on.",
                 min=1)  # fmt: skip
HAYSTACK = Option("claims_haystack", 256,
                  "Haystack tokens of the retrieval claims' needle trials (capped by the "
                  "model's context).", min=8)  # fmt: skip
NEIGHBOURS = Option("claims_baseline_heads", 2,
                    "Unclaimed heads of a claim's layer drawn for each input as its baseline "
                    "(0: all).",
                    min=0)  # fmt: skip
ABLATIONS = ("mean", "zero", "resample")
ABLATION = Option("claims_ablation", ABLATIONS[0], "How the claims' ablations remove a head.",
                  choices=ABLATIONS)  # fmt: skip
ORDER = {str(role): i for i, role in enumerate(DESCRIBED_FIRST)} | {RELATION: -1}


class Claims(Analysis):
    """The sample of inputs, and at the end, each claim's ablation effect beside its layer's."""

    name = "claims"
    title = "Claims tested by ablation"
    unit = ("sentence", "window")
    alongside = ("window",)  # coreference claims come from coref, which reads the windows
    # Reads the other analyses' heads (their roles and relations) before it finishes.
    reads_heads: ClassVar[bool] = True
    # Its repeated-sequence claims read no treebank: it runs where the treebank is unreadable.
    runs_without_units: ClassVar[bool] = True
    tables: ClassVar[dict[str, Schema]] = {
        "claims": {
            "layer": "int", "head": "int", "claim": "str", "relation": "str", "inputs": "str",
            "measure": "str", "tested": "bool", "clusters": "int", "positions": "int",
            "effect": "float", "effect_low": "float", "effect_high": "float",
            "baseline": "float", "baseline_spread": "float", "baseline_heads": "int",
            "baseline_from": "str", "p": "float", "confirmed": "bool",
            "control_on": "str", "control": "float", "p_control": "float",
            "baseline_note": "str", "group": "str", "group_heads": "int", "shares_by": "str",
            "group_effect": "float", "group_effect_low": "float", "group_effect_high": "float",
            "group_baseline": "float", "group_control": "float", "group_p": "float",
            "group_p_control": "float", "group_note": "str", "group_confirmed": "bool",
            "share": "float", "share_low": "float", "share_high": "float", "share_p": "float",
            "verdict": "str",
        },
        "claims_run": {
            "inputs": "str", "count": "int", "positions": "int", "measure": "str",
            "ablation": "str", "heads_ablated": "int", "ablated_rows": "int",
            "haystack_tokens": "Int64",
        },
    }  # fmt: skip
    head_columns: ClassVar[Schema] = {
        "ablation_claim": "str", "ablation_effect": "float", "ablation_effect_low": "float",
        "ablation_effect_high": "float", "ablation_baseline": "float", "confirmed": "boolean",
        "claim_verdicts": "str",
    }  # fmt: skip
    measures = (
        Measure("ablation_effect", "ablation effect of the claim", "num", "higher"),
        Measure("ablation_baseline", "its layer's unclaimed heads", "num"),
        Measure("claim_verdicts", "claims", "text"),
    )
    options = (SENTENCES, SEQUENCES, LENGTH, WINDOWS, NEEDLES, HAYSTACK, NEIGHBOURS, ABLATION)

    @classmethod
    def check_tokenizer(cls, tokenizer, config, options: dict[str, Any]) -> None:
        """Sizes refused before the weights load: repeated sequences longer than the model
        reads, and inputs that cannot fit the machine or finish in a day (``check_memory``,
        ``check_time``; the claims' inputs are held at once: a token's id in a list, then in a
        tensor of ids and one of tags, at least 24 bytes)."""
        from probe.inputs.corpus import max_tokens
        from probe.inputs.units.repeats import specials
        from probe.options import check_memory, check_time, forward_flops

        settings = {o.name: o.default for o in cls.options} | options
        try:
            first, last = specials(tokenizer)
        except ProbeError:  # no token to begin with: the repeats' own check says so, if run
            first, last = [], []
        length, limit = int(settings["claims_repeat_length"]), max_tokens(config, tokenizer)
        tokens = len(first) + 2 * length + len(last)
        if tokens > limit:
            raise ProbeError(
                f"{LENGTH.flag} {length} makes sequences of {tokens} tokens, longer than the "
                f"model's {limit}; use at most {(limit - len(first) - len(last)) // 2}"
            )
        hay = min(int(settings["claims_haystack"]), limit)
        for option, each in ((SEQUENCES, tokens), (NEEDLES, hay)):
            n = int(settings[option.name])
            check_memory(option.flag, n, 24.0 * n * each)
            per_input = 2 * each * forward_flops(config)  # at least its run and one ablated
            check_time(option.flag, n, n * per_input, per_input)

    @classmethod
    def unsupported(cls, model) -> str | None:
        from probe.capture.spec import describe

        if describe(model).encoder_decoder:
            return "claims are not tested by ablation on encoder-decoder models yet"
        return None

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        settings = {o.name: o.default for o in self.options} | context.options
        self.n_sentences = int(settings["claims_sentences"])
        self.n_sequences = int(settings["claims_sequences"])
        self.length = int(settings["claims_repeat_length"])
        self.ablation = settings["claims_ablation"]
        self.n_neighbours = int(settings["claims_baseline_heads"])
        self.n_windows = int(settings["claims_windows"])
        self.n_needles = int(settings["claims_needles"])
        self.haystack = int(settings["claims_haystack"])
        if self.ablation not in ABLATIONS:
            raise ValueError(f"claims ablation must be one of {ABLATIONS}")
        # sentence index -> (its key, token ids, each token's relation index or -1)
        self.kept: dict[int, tuple[float, list[int], list[int]]] = {}
        # (document, first sentence) -> (its key, token ids, 0 at scored mentions' head words)
        self.windows: dict[tuple[int, int], tuple[float, list[int], list[int]]] = {}
        # a decoder's first sentences, the retrieval claims' haystack: index -> (text, tokens)
        self.texts: dict[int, tuple[str, int]] = {}
        self._heads = None

    def begin_batch(self, batch: Batch) -> None:
        if batch.unit == "window":
            self._keep_windows(batch)
            return
        if batch.unit != "sentence":
            return
        if self.context.causal:
            self._keep_texts(batch)
        index = batch.index.cpu().numpy()
        drawn = uniform(self.context.seed, "claims-sample", index)
        for b, (i, key) in enumerate(zip(index.tolist(), drawn.tolist(), strict=True)):
            n = int(batch.attention_mask[b].sum())
            word = batch.word_of_token[b, :n]
            relation = batch.relations[b].gather(0, word.clamp(min=0))
            has_head = batch.heads[b].gather(0, word.clamp(min=0)) >= 0  # the root: no relation
            relation = torch.where((word >= 0) & has_head, relation, -1)
            self.kept[i] = (key, batch.input_ids[b, :n].tolist(), relation.tolist())
        self._trim()

    def _trim(self) -> None:
        """Keep, for each relation, the ``n_sentences`` of smallest key (ties by index) among
        the sentences with a word bearing it: a sample that does not depend on the order the
        sentences came in, with as many sentences for a rare relation as for a frequent one."""
        keep = set()
        for sentences in self._by_relation(self.kept).values():
            keep.update(sentences[: self.n_sentences])
        if len(keep) < len(self.kept):
            self.kept = {i: self.kept[i] for i in self.kept if i in keep}

    @staticmethod
    def _by_relation(kept: dict) -> dict[int, list[int]]:
        """Relation index -> the kept sentences with a word bearing it, by key."""
        found: dict[int, list[int]] = {}
        for i in sorted(kept, key=lambda i: (kept[i][0], i)):
            for relation in set(kept[i][2]) - {-1}:
                found.setdefault(relation, []).append(i)
        return found

    def _keep_windows(self, batch: Batch) -> None:
        """The batch's windows with a scored mention, keyed by the seed, the document and the
        window's first sentence (the same whatever the batches or processes); the
        ``n_windows`` of smallest key kept."""
        from probe.inputs.coreference import scored

        for b, window in enumerate(batch.sentences):
            heads = sorted({m.head for m, _ in scored(window.mentions)})
            if not heads:
                continue
            n = int(batch.attention_mask[b].sum())
            word = batch.word_of_token[b, :n].cpu()
            tags = torch.where(torch.isin(word, torch.tensor(heads)), 0, -1)
            if not (tags == 0).any():
                continue
            where = (window.document_index, window.first_sentence)
            key = float(uniform(self.context.seed, "claims-windows", *map(np.array, where)))
            self.windows[where] = (key, batch.input_ids[b, :n].tolist(), tags.tolist())
        self._trim_windows()

    def _trim_windows(self) -> None:
        if len(self.windows) > self.n_windows:
            first = sorted(self.windows, key=lambda w: (self.windows[w][0], w))[: self.n_windows]
            self.windows = {w: self.windows[w] for w in first}

    def _keep_texts(self, batch: Batch) -> None:
        """The text of the treebank's first sentences, enough for the haystack: those of
        smallest index whose words' tokens reach twice ``haystack`` (whatever order they come
        in; twice, as the haystack tokenizes them again, joined)."""
        words = (batch.word_of_token >= 0).sum(1).tolist()
        for i, sentence, n in zip(batch.index.tolist(), batch.sentences, words, strict=False):
            self.texts[i] = (" ".join(sentence.words), n)
        self._trim_texts()

    def _trim_texts(self) -> None:
        total, keep = 0, []
        for i in sorted(self.texts):
            if total >= 2 * self.haystack:
                break
            keep.append(i)
            total += self.texts[i][1]
        if len(keep) < len(self.texts):
            self.texts = {i: self.texts[i] for i in keep}

    def merge(self, other: Claims) -> None:
        self._check_mergeable(other)
        self.kept.update(other.kept)
        self._trim()
        self.windows.update(other.windows)
        self._trim_windows()
        self.texts.update(other.texts)
        self._trim_texts()

    def take_heads(self, heads: pd.DataFrame) -> None:
        """The other analyses' heads (``layer``, ``head``, ``roles``, ``best_relation``…), whose
        claims this one tests; called by the run before ``finish``."""
        self._heads = heads

    # -- the ablations, once -------------------------------------------------------------

    def _tables(self) -> dict[str, pd.DataFrame]:
        empty = {name: pd.DataFrame(columns=list(s)) for name, s in self.tables.items()}
        claims = listed_claims(self._heads)
        if claims.empty:
            return empty
        model = self.context.model
        lm = model.get_output_embeddings() is not None
        measure = "loss rise" if lm else "relative change of the last hidden state"
        test = AblationTest(model, self.context.n_layers, self.context.n_heads, self.context.seed,
                            self.ablation, self.n_neighbours, lm)  # fmt: skip
        rows, runs = [], []
        for inputs, kinds in (("sentences", ON_SENTENCES), ("repeats", ON_REPEATS),
                              ("windows", ON_WINDOWS), ("needles", ON_NEEDLES)):  # fmt: skip
            mine = claims[claims.claim.isin(kinds)]
            if mine.empty:
                continue
            used = {}
            if inputs == "sentences":
                groups, samples = self._sentences(set(mine.relation))
            elif inputs == "repeats":
                groups, samples = self._repeats(), None
            elif inputs == "windows":
                groups, samples = self._windows(), None
            else:
                (groups, used), samples = self._needles(), None
            if groups:
                tested = test.run(mine, claims, inputs, groups, samples)
            else:  # nothing to test them on: each claim says so (too few inputs)
                tested = test.untested(mine, inputs)
            rows.append(tested.table)
            runs.append({"inputs": inputs, "count": tested.count, "positions": tested.positions,
                         "measure": measure, "ablation": self.ablation,
                         "heads_ablated": tested.heads_ablated,
                         "ablated_rows": tested.ablated_rows, **used})  # fmt: skip
        table = verdicts(pd.concat([with_columns(t) for t in rows], ignore_index=True))
        table = table.sort_values(["layer", "head", "claim"], kind="stable", ignore_index=True)
        runs = pd.DataFrame(runs, columns=list(self.tables["claims_run"]))
        runs["haystack_tokens"] = runs.haystack_tokens.astype("Int64")  # only the needles'
        return {"claims": table[list(self.tables["claims"])], "claims_run": runs}

    # -- the inputs, made from what was kept (``analyses.claims.inputs``) ---------------

    def _sentences(self, relations: set[str]) -> tuple[list, dict[str, set[int]]]:
        """Groups of the kept sentences of the claimed ``relations`` and each relation's
        sample (``inputs.sentence_groups``)."""
        return claim_inputs.sentence_groups(
            self.kept, relations, self.n_sentences, self.context.model
        )

    def _repeats(self) -> list[claim_inputs.Group]:
        """Groups of repeated random sequences (``inputs.repeat_groups``)."""
        context = self.context
        return claim_inputs.repeat_groups(
            context.tokenizer, context.seed, self.n_sequences, self.length, context.model
        )

    def _windows(self) -> list[claim_inputs.Group]:
        """Groups of the kept coreference windows (``inputs.window_groups``)."""
        return claim_inputs.window_groups(self.windows, self.context.model)

    def _trials(self) -> tuple[list, dict]:
        """The retrieval claims' needle trials and what was used (``inputs.retrieval_trials``)."""
        context = self.context
        return claim_inputs.retrieval_trials(
            self.texts,
            context.tokenizer,
            context.model,
            self.haystack,
            self.n_needles,
            context.seed,
        )

    def _needles(self) -> tuple[list[claim_inputs.Group], dict]:
        """Groups of the needle trials (``_trials``) and what was used."""
        trials, used = self._trials()
        return claim_inputs.needle_groups(trials, self.context.model), used

    # -- what the report shows -----------------------------------------------------------

    plots = (
        Plot("effects", "Each claim's ablation effect beside its layer's unclaimed heads",
             "analyses.paper:claims_effects", needs=("claims",), width="page"),
    )  # fmt: skip

    @classmethod
    def heads(cls, tables: dict[str, pd.DataFrame], thresholds: Thresholds) -> pd.DataFrame:
        """Per head with a claim: its first claim's effect (in the order heads are described),
        and every claim's verdict in words."""
        table = tables["claims"]
        columns = ["layer", "head", *cls.head_columns]
        if table.empty:
            return pd.DataFrame({c: pd.Series(dtype="object") for c in columns}).astype(
                {"layer": "int64", "head": "int64"}
            )
        table = table.assign(order=table.claim.map(lambda c: ORDER.get(c, len(ORDER))))
        rows = []
        for (layer, head), own in table.sort_values("order", kind="stable").groupby(
            ["layer", "head"], sort=True
        ):
            first = own.iloc[0]
            rows.append({
                "layer": layer, "head": head, "ablation_claim": claim_name(first),
                "ablation_effect": first.effect, "ablation_effect_low": first.effect_low,
                "ablation_effect_high": first.effect_high, "ablation_baseline": first.baseline,
                "confirmed": bool(first.confirmed),
                "claim_verdicts": "; ".join(f"{claim_name(c)}: {verdict(c)}"
                                            for c in own.itertuples()),
            })  # fmt: skip
        return pd.DataFrame(rows, columns=columns).astype({"confirmed": "boolean"})

    @classmethod
    def measure_unit(cls, measure: Measure, tables: dict[str, pd.DataFrame]) -> str:
        """The ablation effect's unit: nats of next-token loss with an LM head, else a relative
        change of the last hidden state."""
        runs = tables.get("claims_run")
        if measure.column not in ("ablation_effect", "ablation_baseline") or runs is None:
            return measure.unit
        lm = (runs.measure == "loss rise").all() if len(runs) else False
        return "nats of next-token loss" if lm else "relative change of the last hidden state"

    @classmethod
    def section(cls, tables: dict[str, pd.DataFrame], run: dict) -> dict:
        table = tables["claims"]
        counts = []
        for claim in dict.fromkeys(table.claim):
            own = table[table.claim == claim]
            grouped = int((own.verdict == "only with its group").sum())
            counts.append({"claim": claim, "claims": len(own), "tested": int(own.tested.sum()),
                           "confirmed": int(own.confirmed.sum()), "grouped": grouped})  # fmt: skip
        return {
            "counts": counts,
            "claims": table.to_dict("records"),
            "runs": tables["claims_run"].to_dict("records"),
            "fdr": FDR,
            "min_clusters": MIN_CLUSTERS,
        }
