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
(for a decoder: the dependents' next tokens; the second copy's tokens after its first); without
one, the relative change ‖h′ − h‖ / ‖h‖ of the last hidden state at them. Per input (a sentence,
a sequence: the clusters), the claimed head's mean change is paired with the mean over its
layer's unclaimed heads drawn for that input (the baseline: ``claims_baseline_heads`` of them,
drawn afresh for every input by a key of the seed, the head and the input; where every head of
the layer holds a claim, of the nearest layers' unclaimed heads), and the claim is confirmed
where the paired difference is above 0 by a one-sided t-test, after the Benjamini–Hochberg
correction over every claim tested (``probe.inference``), on at least
``MIN_CLUSTERS`` inputs; on fewer the verdict says so.

The samples are kept during the stream (token ids and each token's relation or mark; for the
haystack, a decoder's first sentences' text); the ablated passes run when the analysis finishes,
a row per (head, input) pair a claim reads stacked after the inputs' own, and nothing else
(``probe.interventions.ablation.ablation_effects``), in fixed groups of inputs, so that
``--batch-size`` changes nothing, ``MAX_TOKENS`` tokens a pass at most.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

from analyses import Analysis, Context, Measure, Schema
from analyses.figures import Plot
from analyses.vocabulary import DESCRIBED_FIRST, Role, Thresholds
from probe.inference import FDR, MIN_CLUSTERS, benjamini_hochberg, t_interval, t_test_above
from probe.inputs.treebank import RELATIONS
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
GROUP = 4  # inputs per group of ablated passes, by length: fixed, whatever --batch-size
# Tokens (rows × padded length) in one ablated forward pass: what bounds its memory, whatever
# the inputs' lengths (a sentence's rows, a window's); a pass holds at least its group's own rows
# and one more.
MAX_TOKENS = 16_384

RELATION = "relation"  # a best relation named on a head card without the syntactic role
# The claims tested, and the inputs each is tested on.
ON_SENTENCES = (str(Role.SYNTACTIC), RELATION)
ON_REPEATS = (str(Role.PREVIOUS_TOKEN), str(Role.DUPLICATE_TOKEN), str(Role.INDUCTION))
ON_WINDOWS = (str(Role.COREFERENCE),)
ON_NEEDLES = (str(Role.RETRIEVAL),)
CLAIMS = (*ON_SENTENCES, *ON_REPEATS, *ON_WINDOWS, *ON_NEEDLES)
ORDER = {str(role): i for i, role in enumerate(DESCRIBED_FIRST)} | {RELATION: -1}


class Claims(Analysis):
    """The sample of inputs, and at the end, each claim's ablation effect beside its layer's."""

    name = "claims"
    title = "Claims tested by ablation"
    unit = ("sentence", "window")
    alongside = ("window",)  # coreference claims come from coref, which reads the windows
    # Reads the other analyses' heads (their roles and relations) before it finishes.
    reads_heads: ClassVar[bool] = True
    tables: ClassVar[dict[str, Schema]] = {
        "claims": {
            "layer": "int", "head": "int", "claim": "str", "relation": "str", "inputs": "str",
            "measure": "str", "tested": "bool", "clusters": "int", "positions": "int",
            "effect": "float", "effect_low": "float", "effect_high": "float",
            "baseline": "float", "baseline_spread": "float", "baseline_heads": "int",
            "baseline_from": "str", "p": "float", "confirmed": "bool",
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
                tested, heads_ablated, count, positions, ran = self._test(
                    mine, groups, samples, claims, lm, inputs
                )
            else:  # nothing to test them on: each claim says so (too few inputs)
                tested, heads_ablated, count, positions, ran = (
                    self._none(mine, inputs, lm), 0, 0, 0, 0)  # fmt: skip
            rows.append(tested)
            runs.append({"inputs": inputs, "count": count, "positions": positions,
                         "measure": measure, "ablation": self.ablation,
                         "heads_ablated": heads_ablated, "ablated_rows": ran,
                         **used})  # fmt: skip
        table = pd.concat(rows, ignore_index=True)
        tested = table.tested.astype(bool) & table.p.notna()
        called = benjamini_hochberg(np.where(tested, table.p, np.nan), FDR)
        table["confirmed"] = called & tested.to_numpy()
        table = table.sort_values(["layer", "head", "claim"], kind="stable", ignore_index=True)
        runs = pd.DataFrame(runs, columns=list(self.tables["claims_run"]))
        runs["haystack_tokens"] = runs.haystack_tokens.astype("Int64")  # only the needles'
        return {"claims": table[list(self.tables["claims"])], "claims_run": runs}

    def _sentences(self, relations: set[str]) -> tuple[list, dict[str, set[int]]]:
        """Groups of the kept sentences of the claimed ``relations``, by length (model inputs,
        each token's relation ``[batch, pos]``, -1 for none, and the sentences' indices), and
        each relation's sample: its first ``n_sentences`` sentences by key."""
        from probe.run.loading import main_device

        device = main_device(self.context.model)
        # In key order, each sentence that holds a claimed relation not yet in n_sentences of
        # those chosen: each relation's first n_sentences, few sentences in all.
        need = {RELATIONS.index(r): self.n_sentences for r in relations}
        chosen = []
        for i in sorted(self.kept, key=lambda i: (self.kept[i][0], i)):
            helps = [r for r in set(self.kept[i][2]) if need.get(r, 0) > 0]
            if helps:
                chosen.append(i)
                for r in helps:
                    need[r] -= 1
        samples = {r: {i for i in chosen if RELATIONS.index(r) in self.kept[i][2]}
                   for r in relations}  # fmt: skip
        samples = {r: set(sorted(own, key=lambda i: (self.kept[i][0], i))[: self.n_sentences])
                   for r, own in samples.items()}  # fmt: skip
        # by length, so that a group pads little (ties by position: the same groups always)
        order = sorted(chosen, key=lambda i: (len(self.kept[i][1]), i))
        groups = []
        for start, stop in groups_of(len(order)):
            chosen = order[start:stop]
            rows = [self.kept[i] for i in chosen]
            width = max(len(ids) for _, ids, _ in rows)
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            relation = torch.full((len(rows), width), -1, dtype=torch.long)
            mask = torch.zeros(len(rows), width, dtype=torch.long)
            for r, (_, token_ids, relations) in enumerate(rows):
                ids[r, : len(token_ids)] = torch.tensor(token_ids)
                relation[r, : len(relations)] = torch.tensor(relations)
                mask[r, : len(token_ids)] = 1
            inputs = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
            groups.append((inputs, relation, np.array(chosen)))
        return groups, samples

    def _repeats(self) -> list[tuple[dict, torch.Tensor, np.ndarray]]:
        """Groups of repeated random sequences (the taxonomy's repeats 0, 1, …: BOS, n random
        tokens, the same n again): model inputs, a ``[batch, pos]`` tensor that is 0 on the
        second copy and -1 elsewhere, and the sequences' indices."""
        from probe.inputs.units.repeats import _specials, ordinary_tokens
        from probe.run.loading import main_device

        tokenizer, n = self.context.tokenizer, self.length
        vocabulary = ordinary_tokens(tokenizer)
        first, last = _specials(tokenizer)
        device = main_device(self.context.model)
        groups = []
        for start, stop in groups_of(self.n_sequences):
            chosen = list(range(start, stop))
            rows = []
            for index in chosen:  # as RepeatedSequences.pair(2 · index) draws it
                rng = np.random.default_rng([self.context.seed, 2 * index])
                drawn = rng.choice(vocabulary, size=(2, n))[0].tolist()
                rows.append([*first, *drawn, *drawn, *last])
            ids = torch.tensor(rows)
            second = torch.full(ids.shape, -1, dtype=torch.long)
            second[:, len(first) + n : len(first) + 2 * n] = 0
            inputs = {
                "input_ids": ids.to(device),
                "attention_mask": torch.ones_like(ids).to(device),
            }
            groups.append((inputs, second, np.array(chosen)))
        return groups

    def _windows(self) -> list[tuple[dict, torch.Tensor, np.ndarray]]:
        """Groups of the kept coreference windows, by length: model inputs, a ``[batch, pos]``
        tensor that is 0 at the scored mentions' head words' tokens and -1 elsewhere, and the
        windows' ranks in key order."""
        order = sorted(self.windows, key=lambda w: (self.windows[w][0], w))
        rows = [(self.windows[w][1], self.windows[w][2]) for w in order]
        return packed(rows, self.context.model)

    def _trials(self) -> tuple[list, dict]:
        """The retrieval claims' needle trials (the needle present), in a haystack of the kept
        first sentences, at ``n_needles`` evenly spaced depths; and what was used."""
        from probe.inputs.corpus import max_tokens
        from probe.patterns.retrieval import haystack, needle_trials

        tokenizer = self.context.tokenizer
        room = max_tokens(self.context.model.config, tokenizer) - 64  # retrieval's OVERHEAD
        texts = (self.texts[i][0] for i in sorted(self.texts))
        hay = haystack(tokenizer, texts, min(self.haystack, room))
        if not hay:
            return [], {"haystack_tokens": 0}
        depths = [k / max(self.n_needles - 1, 1) for k in range(self.n_needles)]
        trials = [t for t in needle_trials(tokenizer, hay, [len(hay)], depths,
                                           seed=self.context.seed) if t.needle]  # fmt: skip
        return trials, {"haystack_tokens": len(hay)}

    def _needles(self) -> tuple[list[tuple[dict, torch.Tensor, np.ndarray]], dict]:
        """Groups of the needle trials (``_trials``): model inputs, a ``[batch, pos]`` tensor
        that is 0 at the positions that predict the answer's tokens and -1 elsewhere, and the
        trials' numbers; and what was used."""
        trials, used = self._trials()
        rows = []
        for trial in trials:
            tags = [-1] * len(trial.ids)
            for t in trial.answer:  # the answer's token t is predicted at t - 1
                tags[t - 1] = 0
            rows.append((list(trial.ids), tags))
        return packed(rows, self.context.model), used

    def _none(self, mine: pd.DataFrame, inputs: str, lm: bool) -> pd.DataFrame:
        """``mine``'s claims with no input to test them on: untested, with no effect."""
        return pd.DataFrame([claim._asdict() | statistics([]) | {
            "inputs": inputs, "measure": "loss rise" if lm else "relative change",
            "positions": 0, "baseline_heads": 0, "baseline_from": "none",
        } for claim in mine.itertuples(index=False)])  # fmt: skip

    def _test(self, mine: pd.DataFrame, groups, samples, claims: pd.DataFrame, lm: bool,
              inputs: str):  # fmt: skip
        """Each claim of ``mine`` measured on its ``inputs`` of ``groups`` (its relation's sample
        of ``samples``; every input where that is None), beside its layer's unclaimed heads."""
        from probe.interventions.ablation import (
            difference,
            hidden_state,
            next_token_loss,
            relative_change,
        )

        pools = self._baselines(mine, claims)
        draw = self._draws(pools, inputs)
        ablated = sorted(set(zip(mine.layer, mine["head"], strict=True))
                         | {h for pool, _ in pools.values() for h in pool})  # fmt: skip
        readout, change = (next_token_loss, difference) if lm else (hidden_state, relative_change)
        effects = self._effects(mine, groups, samples, draw, ablated, readout, change)
        slot = {h: i for i, h in enumerate(ablated)}
        rows, positions_total = [], 0
        for claim in mine.itertuples(index=False):
            per_input, positions = self._per_input(claim, groups, samples, effects, draw, slot,
                                                   lm)  # fmt: skip
            positions_total += positions
            rows.append(claim._asdict() | statistics(per_input) | {
                "inputs": inputs,
                "measure": "loss rise" if lm else "relative change", "positions": positions,
                "baseline_from": pools[claim.layer][1],
            })  # fmt: skip
        count = sum(len(indices) for *_, indices in groups)
        ran = sum((~e[:, :, 0].isnan()).sum(1) for e in effects)  # [heads]: rows ablated
        return pd.DataFrame(rows), int((ran > 0).sum()), count, positions_total, int(ran.sum())

    def _baselines(self, mine: pd.DataFrame, claims: pd.DataFrame) -> dict:
        """Per layer of ``mine``'s claims, the heads its baselines are drawn from and where they
        come from: the layer's unclaimed heads, or the nearest layers' where it has none."""
        H, L = self.context.n_heads, self.context.n_layers
        claimed = set(zip(claims.layer, claims["head"], strict=True))
        unclaimed = {layer: [(layer, h) for h in range(H) if (layer, h) not in claimed]
                     for layer in range(L)}  # fmt: skip
        pools = {}
        for layer in sorted(set(mine.layer)):
            pool, kind = unclaimed[layer], "unclaimed"
            if not pool:  # every head of the layer holds a claim: the nearest layers' unclaimed
                near = [k for k in range(L) if unclaimed[k]]
                nearest = min((abs(k - layer) for k in near), default=None)
                pool = [h for k in near if abs(k - layer) == nearest for h in unclaimed[k]]
                kind = "nearest layers' unclaimed" if pool else "none"
            pools[layer] = (pool, kind)
        return pools

    def _draws(self, pools: dict, inputs: str):
        """``draw(layer, index)``: the baseline's heads on input ``index``: ``n_neighbours`` of
        the layer's pool drawn afresh for each input by a key of the seed, the head and the
        input (every head of the pool for 0, or where it holds no more), so that over the inputs
        the baseline is the pool's heads, each as likely as the others, not a chosen few."""
        cache: dict[tuple[int, int], list[tuple[int, int]]] = {}
        seed, n = self.context.seed, self.n_neighbours

        def draw(layer: int, index: int) -> list[tuple[int, int]]:
            if (layer, index) not in cache:
                pool = pools[layer][0]
                chosen = pool
                if n and len(pool) > n:
                    at = [np.array([k for k, _ in pool]), np.array([h for _, h in pool])]
                    drawn = uniform(seed, f"claims-baseline-{inputs}", *at,
                                    np.full(len(pool), index))  # fmt: skip
                    chosen = sorted(pool[i] for i in np.argsort(drawn, kind="stable")[:n])
                cache[(layer, index)] = chosen
            return cache[(layer, index)]

        return draw

    def _effects(self, mine, groups, samples, draw, ablated, readout, change) -> list:
        """Per group of inputs, every ablated head's change ``[heads, batch, pos]``, run only on
        the inputs a claim reads it on (NaN elsewhere, never read): a claimed head on its claim's
        inputs, a baseline head on the inputs of its layer's claims it was drawn for."""
        from probe.interventions.ablation import ablation_effects, head_means
        from probe.run import helper

        model, slot = self.context.model, {h: i for i, h in enumerate(ablated)}
        effects = []
        with torch.no_grad():
            means = None
            if self.ablation != "zero":  # resample takes the mean where its source is padded
                means = head_means(model, [inputs for inputs, *_ in groups])
            for inputs, tags, indices in groups:
                helper.poll()  # the helper done writing the others' tables: both cores here
                needed = torch.zeros(len(ablated), len(indices), dtype=torch.bool)
                for claim in mine.itertuples(index=False):
                    for b, i in enumerate(indices.tolist()):
                        if reads(claim, i, samples):
                            for h in [(claim.layer, claim.head), *draw(claim.layer, i)]:
                                needed[slot[h], b] = True
                effect = torch.full((len(ablated), *tags.shape), math.nan, dtype=torch.float64)
                if needed.any():
                    found = ablation_effects(model, inputs, ablated, readout, change,
                                             mode=self.ablation, means=means, needed=needed,
                                             max_rows=max_rows(tuple(tags.shape)))  # fmt: skip
                    effect = found.cpu().double()
                effects.append(effect)
        return effects

    @staticmethod
    def _per_input(claim, groups, samples, effects, draw, slot, lm: bool):
        """Per input (the cluster) of the claim's that holds its tokens, the claimed head's mean
        change there and each of its baseline heads' (by head); and the positions read."""
        target = RELATIONS.index(claim.relation) if claim.claim in ON_SENTENCES else 0
        per_input, positions = [], 0
        for (inputs, tags, indices), effect in zip(groups, effects, strict=True):
            read = torch.tensor([reads(claim, i, samples) for i in indices.tolist()])
            where = (tags == target).to(effect.device) & inputs["attention_mask"].bool().cpu()
            where &= read[:, None]
            if lm:  # the loss read at t is of token t + 1, which must be real
                where[:, -1] = False
                where[:, :-1] &= inputs["attention_mask"][:, 1:].bool().cpu()
                if claim.claim in ON_REPEATS:  # the second copy's tokens after its first
                    where &= torch.roll(tags == target, 1, dims=1)
            count = where.sum(1)
            positions += int(count.sum())
            at = torch.where(where, effect, 0.0).sum(-1) / count.clamp(min=1)  # [heads, batch]
            for b in torch.nonzero(count).flatten().tolist():
                others = {h: float(at[slot[h], b]) for h in draw(claim.layer, int(indices[b]))}
                per_input.append((float(at[slot[(claim.layer, claim.head)], b]), others))
        return per_input, positions

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
    def section(cls, tables: dict[str, pd.DataFrame], run: dict) -> dict:
        table = tables["claims"]
        counts = []
        for claim in dict.fromkeys(table.claim):
            own = table[table.claim == claim]
            counts.append({"claim": claim, "claims": len(own), "tested": int(own.tested.sum()),
                           "confirmed": int(own.confirmed.sum())})  # fmt: skip
        return {
            "counts": counts,
            "claims": table.to_dict("records"),
            "runs": tables["claims_run"].to_dict("records"),
            "fdr": FDR,
            "min_clusters": MIN_CLUSTERS,
        }


def max_rows(shape: tuple[int, int]) -> int:
    """The rows of one ablated pass over a group of ``shape`` ``[inputs, pos]``: ``MAX_TOKENS``
    of its tokens, and at least the group's own rows and one more."""
    inputs, width = shape
    return max(inputs + 1, MAX_TOKENS // max(1, width))


def reads(claim, index: int, samples: dict[str, set[int]] | None) -> bool:
    """Whether ``claim`` is measured on input ``index``: a syntactic claim on its relation's
    sample of sentences, the others on every input of theirs."""
    return samples is None or index in samples[claim.relation]


def groups_of(n: int) -> list[tuple[int, int]]:
    """(start, stop) of groups of ``GROUP`` of ``n`` inputs, a last group of one joined to the
    one before it (resample ablation takes each input's z from another of its group)."""
    bounds = [(start, min(start + GROUP, n)) for start in range(0, n, GROUP)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        bounds[-2:] = [(bounds[-2][0], n)]
    return bounds


def packed(rows: list[tuple[list[int], list[int]]], model) -> list:
    """Inputs of token ids and tags (``rows``, numbered in order) in groups by length (ties by
    number: the same groups always), right-padded: each group's model inputs, tags
    ``[batch, pos]`` (-1 on padding) and numbers."""
    from probe.run.loading import main_device

    device = main_device(model)
    order = sorted(range(len(rows)), key=lambda i: (len(rows[i][0]), i))
    groups = []
    for start, stop in groups_of(len(order)):
        chosen = order[start:stop]
        width = max(len(rows[i][0]) for i in chosen)
        ids = torch.zeros(len(chosen), width, dtype=torch.long)
        tags = torch.full((len(chosen), width), -1, dtype=torch.long)
        mask = torch.zeros(len(chosen), width, dtype=torch.long)
        for r, i in enumerate(chosen):
            token_ids, tagged = rows[i]
            ids[r, : len(token_ids)] = torch.tensor(token_ids)
            tags[r, : len(tagged)] = torch.tensor(tagged)
            mask[r, : len(token_ids)] = 1
        inputs = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
        groups.append((inputs, tags, np.array(chosen)))
    return groups


def listed_claims(heads: pd.DataFrame | None) -> pd.DataFrame:
    """One row per claim the page makes about a head: ``layer``, ``head``, ``claim`` (a role of
    ``CLAIMS``, or ``relation`` for a best relation named without the syntactic role) and
    ``relation`` (a syntactic claim's; empty otherwise)."""
    rows = []
    if heads is not None and len(heads):
        roles = heads["roles"] if "roles" in heads else pd.Series("", index=heads.index)
        best = heads["best_relation"] if "best_relation" in heads else roles.map(lambda _: "")
        for layer, head, held, relation in zip(heads.layer, heads["head"], roles, best,
                                               strict=True):  # fmt: skip
            held = set(str(held).split(";")) if isinstance(held, str) and held else set()
            named = relation if isinstance(relation, str) and relation in RELATIONS else ""
            if named:
                syntactic = str(Role.SYNTACTIC) in held
                rows.append((layer, head, str(Role.SYNTACTIC) if syntactic else RELATION, named))
            rows += [(layer, head, c, "") for c in CLAIMS[2:] if c in held]
    return pd.DataFrame(rows, columns=["layer", "head", "claim", "relation"]).astype(
        {"layer": "int64", "head": "int64", "claim": "object", "relation": "object"}
    )


def statistics(per_input: list[tuple[float, dict]]) -> dict:
    """The claimed head's mean effect over inputs with its 95% t-interval; the baseline (the mean
    over inputs of its heads' mean effect there), the heads it drew on and the spread of their
    own means; and the one-sided p-value of the paired difference (head − baseline) being above
    0. No interval or p-value on fewer than ``MIN_CLUSTERS`` inputs or without a baseline head."""
    n = len(per_input)
    nan = math.nan
    out = {"clusters": n, "effect": nan, "effect_low": nan, "effect_high": nan, "baseline": nan,
           "baseline_spread": nan, "baseline_heads": 0, "p": nan, "tested": False}  # fmt: skip
    if not n:
        return out
    effect = np.array([e for e, _ in per_input])
    out["effect"] = float(effect.mean())
    has_baseline = all(others for _, others in per_input)
    if has_baseline:
        baseline = np.array([np.mean(list(others.values())) for _, others in per_input])
        out["baseline"] = float(baseline.mean())
        by_head: dict = {}
        for _, others in per_input:
            for head, value in others.items():
                by_head.setdefault(head, []).append(value)
        out["baseline_heads"] = len(by_head)
        if len(by_head) > 1:
            out["baseline_spread"] = float(np.std([np.mean(v) for v in by_head.values()], ddof=1))
    if n < MIN_CLUSTERS:
        return out
    out["effect_low"], out["effect_high"] = t_interval(out["effect"], effect.std(ddof=1), n)
    if not has_baseline:
        return out
    out["p"] = t_test_above(effect - baseline)
    out["tested"] = True
    return out


def claim_name(row) -> str:
    """A claim in words: ``syntactic (obj)``, ``relation obj``, ``induction``."""
    if row.claim == RELATION:
        return f"relation {row.relation}"
    return f"{row.claim} ({row.relation})" if row.relation else str(row.claim)


def verdict(row) -> str:
    """``confirmed by ablation``, ``pattern only`` (tested, not confirmed), or why untested."""
    if bool(row.tested):
        return "confirmed by ablation" if bool(row.confirmed) else "pattern only"
    return "pattern only (too few inputs to test)"
