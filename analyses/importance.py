"""Head importance: how much the model's output changes when a head is ablated (Michel et al.
2019, "Are Sixteen Heads Really Better than One?"), and the pruning curve.

Over the first ``sentences`` sentences of the treebank, or windows of a ``--corpus`` (those of
them the model can read; by position, so the same whatever the batches or processes), each head
is ablated alone, by its mean over those sentences' real tokens or by zero, and the change of the
output is averaged over real token positions:

- with a language-model head, KL(p ‖ p_ablated) of the predicted token distributions;
- otherwise ‖h_ablated − h‖₂ / ‖h‖₂ of the last hidden state.

With a language-model head also Michel et al.'s gradient importance E_x |∂L(x)/∂ξ_h| of a mask
ξ_h = 1 on each head's output, L the language-model loss (next token; for a masked model, a
keyed 15% of the word tokens masked). The pruning curve ablates heads together in increasing
order of effect.

The sentences are kept during the stream (token ids only) and merge like any state; the
ablated forward passes run once, when the analysis finishes, in fixed batches.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

from analyses import Analysis, Context, Measure, Schema, svg
from analyses.figures import Figure, Plot
from analyses.vocabulary import Thresholds
from probe.inputs.units import Either
from probe.lazy import lazy
from probe.options import Option

if TYPE_CHECKING:
    from probe.inputs.corpus import Batch

np = lazy("numpy")
pd = lazy("pandas")
torch = lazy("torch")
F = lazy("torch.nn.functional")

SENTENCES = 200  # --importance-sentences
ABLATIONS = ("mean", "zero")  # --importance-ablation, the default first
PASS_SENTENCES = 8  # sentences per ablated forward pass: fixed, so --batch-size changes nothing
SHARES = tuple(k / 10 for k in range(10))  # of heads removed, for the pruning curve
MASKED_SHARE = 0.15  # of word tokens masked for a masked language model's loss (BERT's)
SHOWN = 5  # most and least important heads listed in the report


class Importance(Analysis):
    """The sentences to ablate on, and, at the end, each head's effect on the output."""

    name = "importance"
    title = "Head importance"
    unit = Either("text", "sentence")  # a corpus's first windows when one is given

    @classmethod
    def unsupported(cls, model) -> str | None:
        from probe.capture.spec import describe

        if describe(model).encoder_decoder:
            return "importance does not handle encoder-decoder models yet"
        return None

    tables: ClassVar[dict[str, Schema]] = {
        "importance": {
            "layer": "int", "head": "int", "ablation_effect": "float",
            "gradient_importance": "float", "rank": "int",
        },
        "importance_curve": {
            "share_removed": "float", "heads_removed": "int", "output_change": "float",
        },
        "importance_run": {
            "measure": "str", "ablation": "str", "sentences": "int", "positions": "int",
            "rank_correlation": "float",  # Spearman's, of gradient importance and effect
        },
    }  # fmt: skip
    # (``ablation_effect`` in heads.csv is the claims' ablation: ``analyses.claims``)
    head_columns: ClassVar[Schema] = {"importance_effect": "float"}
    measures = (Measure("importance_effect", "importance (ablation effect)", "num", "higher"),)
    options = (
        Option("importance_sentences", SENTENCES,
               "Sentences (or corpus windows) the importance analysis ablates on.", min=1),
        Option("importance_ablation", ABLATIONS[0], "How importance ablates a head.",
               choices=ABLATIONS),
    )  # fmt: skip
    default = False  # one forward pass per head: asked for by name

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        settings = {o.name: o.default for o in self.options} | context.options
        self.n_sentences = int(settings["importance_sentences"])
        self.ablation = settings["importance_ablation"]
        if self.ablation not in ABLATIONS:
            raise ValueError(f"importance ablation must be one of {ABLATIONS}")
        self.mask_token_id = context.mask_token_id
        # sentence index -> (token ids, which tokens belong to a word)
        self.kept: dict[int, tuple[list[int], list[bool]]] = {}

    @property
    def reads(self) -> int:
        return self.n_sentences

    def begin_batch(self, batch: Batch) -> None:
        for b, index in enumerate(batch.index.tolist()):
            if index < self.n_sentences:
                n = int(batch.attention_mask[b].sum())
                words = (batch.word_of_token[b, :n] >= 0).tolist()
                self.kept[index] = (batch.input_ids[b, :n].tolist(), words)

    def merge(self, other: Importance) -> None:
        self._check_mergeable(other)
        self.kept.update(other.kept)

    # -- the forward passes, once --------------------------------------------------------

    def _tables(self) -> dict[str, pd.DataFrame]:
        from probe.interventions.ablation import ablate, head_means
        from probe.pipeline.loading import main_device

        model = self.context.model
        L, H = self.context.n_layers, self.context.n_heads
        lm = model.get_output_embeddings() is not None
        device = main_device(model)
        order = sorted(self.kept)
        batches = [
            self._inputs(order[i : i + PASS_SENTENCES], device)
            for i in range(0, len(order), PASS_SENTENCES)
        ]
        if not batches:
            return {name: pd.DataFrame(columns=list(s)) for name, s in self.tables.items()}
        positions = sum(int(inputs["attention_mask"].sum()) for inputs, *_ in batches)
        with torch.no_grad():
            means = None
            if self.ablation == "mean":
                means = head_means(model, [inputs for inputs, *_ in batches])
            references = [Reference(output(model, inputs, lm), lm) for inputs, *_ in batches]

            def change(heads: list[tuple[int, int]]) -> float:
                """The mean output change over real positions with ``heads`` ablated together."""
                total = 0.0
                for (inputs, *_), reference in zip(batches, references, strict=True):
                    with ablate(model, heads, self.ablation, means):
                        ablated = output(model, inputs, lm)
                    real = inputs["attention_mask"].bool()
                    total += float(reference.change(ablated)[real].sum())
                return total / positions

            effect = np.array([change([(layer, head)]) for layer in range(L) for head in range(H)])
            pruned = np.argsort(effect, kind="stable")  # least important first
            curve = []
            for share in SHARES:
                k = round(share * L * H)
                heads = [divmod(int(i), H) for i in pruned[:k]]
                curve.append({"share_removed": share, "heads_removed": k,
                              "output_change": change(heads) if k else 0.0})  # fmt: skip
        # A masked model's loss needs its mask token (the tokenizer's).
        can_mask = self.context.causal or self.mask_token_id is not None
        gradient = self._gradient(model, batches) if lm and can_mask else np.full(L * H, math.nan)
        layer, head = np.divmod(np.arange(L * H), H)
        rank = pd.Series(-effect).rank(method="first").astype(int).to_numpy()
        table = pd.DataFrame({"layer": layer, "head": head, "ablation_effect": effect,
                              "gradient_importance": gradient, "rank": rank})  # fmt: skip
        correlation = math.nan
        if np.isfinite(gradient).all() and L * H > 1:
            ranks = [pd.Series(x).rank().to_numpy() for x in (effect, gradient)]
            correlation = float(np.corrcoef(*ranks)[0, 1])
        run = pd.DataFrame([{"measure": "kl" if lm else "relative_norm", "ablation": self.ablation,
                             "sentences": len(order), "positions": positions,
                             "rank_correlation": correlation}])  # fmt: skip
        return {"importance": table, "importance_curve": pd.DataFrame(curve), "importance_run": run}

    def _inputs(self, indices: list[int], device) -> tuple[dict, torch.Tensor, np.ndarray]:
        """Model inputs for the kept sentences ``indices`` (right-padded), which tokens belong
        to a word ``[batch, pos]``, and the sentences' indices."""
        rows = [self.kept[i] for i in indices]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        words = torch.zeros(len(rows), width, dtype=torch.bool)
        for r, (token_ids, is_word) in enumerate(rows):
            ids[r, : len(token_ids)] = torch.tensor(token_ids)
            words[r, : len(is_word)] = torch.tensor(is_word)
        mask = (torch.arange(width)[None] < torch.tensor([len(t) for t, _ in rows])[:, None]).long()
        inputs = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
        return inputs, words.to(device), np.array(indices)

    def _gradient(self, model, batches) -> np.ndarray:
        """E_x |∂L(x)/∂ξ_h| over the sentences: each sentence has its own mask ξ ``[layer,
        head]``, so one backward pass gives every sentence's gradient."""
        from probe.capture.hookpoints import hooks
        from probe.keys import uniform

        L, H = self.context.n_layers, self.context.n_heads
        causal = self.context.causal
        total, sentences = torch.zeros(L, H, dtype=torch.float64), 0
        for inputs, words, index in batches:
            inputs = dict(inputs)
            ids, mask = inputs["input_ids"], inputs["attention_mask"].bool()
            if causal:
                targets, scored = ids[:, 1:], mask[:, 1:]
            else:  # mask a keyed share of the word tokens, and predict them
                position = torch.arange(ids.shape[1])
                drawn = uniform(
                    self.context.seed, "importance-mask", index[:, None], position[None].numpy()
                )
                scored = torch.from_numpy(drawn < MASKED_SHARE).to(ids.device) & words
                targets = ids
                inputs["input_ids"] = ids.masked_fill(scored, self.mask_token_id)
            xi = torch.ones(len(ids), L, H, device=ids.device, requires_grad=True)
            with torch.enable_grad(), hooks(model, {"hook_z": head_mask(xi)}):
                logits = model(**inputs).logits
                logits = logits[:, :-1] if causal else logits
                logits = logits if logits.dtype == torch.float64 else logits.float()
                nll = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
                per_sentence = (nll * scored).sum(1) / scored.sum(1).clamp(min=1)
                (grad,) = torch.autograd.grad(per_sentence.sum(), xi)
            total += grad.abs().sum(0).double().cpu()
            sentences += len(ids)
        return (total / max(sentences, 1)).flatten().numpy()

    # -- what the report shows -----------------------------------------------------------

    @classmethod
    def heads(cls, tables: dict[str, pd.DataFrame], thresholds: Thresholds) -> pd.DataFrame:
        table = tables["importance"][["layer", "head", "ablation_effect"]]
        return table.rename(columns={"ablation_effect": "importance_effect"})

    plots = (
        Plot("heads", "Each head's importance", "analyses.paper:importance_heads",
             page=lambda tables: heatmaps(tables), needs=("importance",)),
        Plot("pruning", "Pruning curve: the output change as heads are removed together",
             "analyses.paper:pruning_curve", page=lambda tables: pruning(tables),
             needs=("importance", "importance_curve")),
    )  # fmt: skip

    @classmethod
    def section(cls, tables: dict[str, pd.DataFrame], run: dict) -> dict:
        table = tables["importance"]
        if table.empty:
            return {"run": None}
        ranked = table.sort_values("rank")
        run = tables["importance_run"].iloc[0].to_dict()
        correlation = run["rank_correlation"]
        return {
            "run": run,
            "most": ranked.head(SHOWN).to_dict("records"),
            "least": ranked.tail(SHOWN).iloc[::-1].to_dict("records"),
            "curve": tables["importance_curve"].to_dict("records"),
            "spearman": None if math.isnan(correlation) else correlation,
        }


def head_mask(xi: torch.Tensor):
    """A ``hook_z`` function that scales head h of layer l of sentence b by ``xi[b, l, h]``."""

    def scale(z: torch.Tensor, hook) -> torch.Tensor:  # z: [batch, pos, head, d_head]
        return z * xi[:, hook.layer(), None, :, None].to(z.dtype)

    return scale


def output(model, inputs: dict, lm: bool) -> torch.Tensor:
    """Log-probabilities ``[batch, pos, vocab]`` (with a language-model head), or the last
    hidden state ``[batch, pos, d_model]``."""
    out = model(**inputs)
    x = out.logits if lm else out.last_hidden_state
    x = x if x.dtype == torch.float64 else x.float()
    return x.log_softmax(-1) if lm else x


class Reference:
    """One batch's unablated output, and its change when heads are ablated, per position
    ``[batch, pos]``: KL(p ‖ p_ablated) from log-probabilities, or the relative change of the
    hidden state ‖h_ablated − h‖₂ / ‖h‖₂."""

    def __init__(self, out: torch.Tensor, lm: bool) -> None:
        self.out, self.lm = out, lm
        if lm:  # what every head's KL shares: p, and Σ p log p
            self.p = out.exp()
            self.neg_entropy = torch.einsum("btv,btv->bt", self.p, out)
        else:
            self.norm = out.norm(dim=-1).clamp(min=1e-12)

    def change(self, ablated: torch.Tensor) -> torch.Tensor:
        if self.lm:
            return self.neg_entropy - torch.einsum("btv,btv->bt", self.p, ablated)
        return (ablated - self.out).norm(dim=-1) / self.norm


def heatmaps(tables: dict[str, pd.DataFrame]) -> Figure:
    """Layer x head heatmaps of each head's importance, as inline SVG."""
    table = tables["importance"]
    measures = ["ablation_effect"] + (
        ["gradient_importance"] if table.gradient_importance.notna().any() else []
    )
    gradient = " and of its gradient importance" if len(measures) > 1 else ""
    alt = f"Layer-by-head heatmaps of the output change when the head is ablated{gradient}."
    drawings = []
    for measure in measures:
        grid = table.pivot(index="layer", columns="head", values=measure)
        name = measure.replace("_", " ")
        drawings.append(svg.heatmaps(
            [svg.Grid(name.capitalize(), grid)], vmin=0,
            vmax=float(grid.max().max()) or 1.0, anchors=svg.MAGMA, label=name, alt=alt,
            name=f"importance-{measure}", size=(300, 170),
        ))  # fmt: skip
    return Figure("importance", "Each head's importance", alt, "".join(drawings))


def pruning(tables: dict[str, pd.DataFrame]) -> Figure:
    """The pruning curve, as inline SVG."""
    curve = tables["importance_curve"]
    alt = ("A line chart of the output change as more heads are ablated together, least "
           "important first.")  # fmt: skip
    curve_chart = svg.Chart(
        "Pruning curve",
        [svg.Series("output change", 100 * curve.share_removed, curve.output_change)],
        "heads removed, least important first (%)",
        "output change",
        integer_x=False,
        legend=False,
    )
    return Figure("pruning", "Pruning curve", alt, svg.charts([curve_chart], alt=alt))
