"""Claims tested by ablation (issue #57): the batched ablation against one head at a time with
plain PyTorch hooks; decoys (a head whose W_O slice is zero: its pattern, and so its claim,
unchanged, but it does nothing) kept and not confirmed, with an effect of 0; the real heads of
the trained induction model (induction, previous-token, retrieval on needle trials) and MiniLM's
strongest syntactic head and a coreference head on GUM confirmed; the retrieval path against a
forward pass and a loss computed by hand; the tables the same whatever the batch size; the
columns in heads.csv, run.json and the page."""

import copy
import json

import numpy as np
import pandas as pd
import pytest
import torch
import transformers as tf
from induction import INDUCTION, MODEL, PREVIOUS_TOKEN
from models import CONFIGS, SMALL, padded_batch, small_model
from treebanks import EWT, GUM, needs_ewt, needs_gum

from analyses import Context
from analyses.claims import Claims, listed_claims
from probe.capture.architectures import architecture, blocks, head_dim
from probe.capture.hookpoints import trace
from probe.inputs.corpus import Corpus
from probe.inputs.treebank import iter_conllu
from probe.interventions.ablation import ablate, head_means
from probe.interventions.ablation_rows import (
    ablation_effects,
    difference,
    hidden_state,
    next_token_loss,
    relative_change,
)
from probe.patterns.retrieval import Trial


def zero_head_output(model, layer: int, head: int) -> None:
    """Zero the slice of the output projection W_O that belongs to one head (in place)."""
    o = blocks(model)[layer].get_submodule(architecture(model).o)
    d = head_dim(model)
    with torch.no_grad():
        if isinstance(o, torch.nn.Linear):  # weight [d_model, heads·d_head]
            o.weight[:, head * d : (head + 1) * d] = 0
        else:  # GPT-2's Conv1D: weight [heads·d_head, d_model]
            o.weight[head * d : (head + 1) * d] = 0


def replaced(model, layer: int, head: int, value: torch.Tensor):
    """A plain PyTorch pre-hook on the output projection setting one head's z to ``value``."""
    o = blocks(model)[layer].get_submodule(architecture(model).o)
    d = head_dim(model)

    def hook(_module, args):
        x = args[0].clone()
        x[..., head * d : (head + 1) * d] = value.to(x)
        return (x, *args[1:])

    return o.register_forward_pre_hook(hook)


def bert():
    torch.manual_seed(0)
    config = tf.BertConfig(**SMALL | {"vocab_size": 130}, intermediate_size=64,
                           initializer_range=0.2)  # fmt: skip
    return tf.BertModel(config).eval()


def gpt2_lm():
    torch.manual_seed(0)
    config = tf.GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=300, n_positions=128)
    return tf.GPT2LMHeadModel(config).eval()


def z_of(model, inputs) -> list[torch.Tensor]:
    """Each layer's z ``[batch, pos, head, d_head]``, read with plain PyTorch pre-hooks on the
    output projections."""
    found = []

    def keep(_module, args):
        found.append(args[0].detach().clone())

    handles = [b.get_submodule(architecture(model).o).register_forward_pre_hook(keep)
               for b in blocks(model)]  # fmt: skip
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for h in handles:
            h.remove()
    return [z.unflatten(-1, (-1, head_dim(model))) for z in found]


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
@pytest.mark.parametrize("mode", ["mean", "zero", "resample"])
def test_ablation_effects_are_one_head_at_a_time_with_plain_hooks(kind, mode):
    model = bert() if kind == "bert" else gpt2_lm()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 120, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # padding
    inputs = {"input_ids": ids, "attention_mask": mask}
    lm = kind == "gpt2"
    readout, change = (next_token_loss, difference) if lm else (hidden_state, relative_change)
    heads = [(0, 1), (1, 0), (1, 3), (0, 2)]
    means = head_means(model, [inputs]) if mode != "zero" else None
    got = ablation_effects(model, inputs, heads, readout, change, mode=mode, means=means)
    assert got.shape == (4, 3, 9)
    zs = z_of(model, inputs)
    with torch.no_grad():
        intact = readout(model(**inputs), inputs)
        for i, (layer, head) in enumerate(heads):
            value = torch.zeros(head_dim(model)) if mode == "zero" else means[layer][head]
            if mode == "resample":  # the next input's z, its mean where that one is padded
                source = zs[layer][:, :, head].roll(-1, 0)
                real = mask.roll(-1, 0).bool()[..., None]
                value = torch.where(real, source, means[layer][head])
            handle = replaced(model, layer, head, value)
            try:
                ablated = readout(model(**inputs), inputs)
            finally:
                handle.remove()
            expected = change(ablated[None], intact)[0]
            real = mask.bool() if not lm else mask.bool() & torch.roll(mask.bool(), -1, 1)
            real[:, -1] &= not lm  # the loss at the last position predicts nothing
            torch.testing.assert_close(got[i][real], expected[real], atol=1e-5, rtol=1e-4)
    # how many copies share a pass changes nothing
    one = ablation_effects(model, inputs, heads, readout, change, mode=mode, means=means,
                           max_rows=1)  # fmt: skip
    torch.testing.assert_close(one, got, atol=1e-6, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_ablation_effects_on_every_architecture_copy_the_rows_from_the_chunks_first_layer(kind):
    """Copies of a chunk of layer-1 heads share layer 0's pass (their rows are copied at block 1's
    input): the same as each head ablated alone with plain hooks, padded batches included."""
    model = small_model(kind)
    inputs = padded_batch(kind)
    heads = [(0, 1), (0, 2), (1, 0), (1, 3)]
    means = head_means(model, [inputs])
    got = ablation_effects(
        model, inputs, heads, hidden_state, relative_change, means=means, max_rows=6
    )  # two copies a pass: layer 0's heads, then layer 1's
    real = inputs["attention_mask"].bool()
    with torch.no_grad():
        intact = hidden_state(model(**inputs), inputs)
        for i, (layer, head) in enumerate(heads):
            if kind == "albert":  # one module for every layer: no plain hook per layer
                with ablate(model, [(layer, head)], "mean", means):
                    ablated = hidden_state(model(**inputs), inputs)
            else:
                handle = replaced(model, layer, head, means[layer][head])
                try:
                    ablated = hidden_state(model(**inputs), inputs)
                finally:
                    handle.remove()
            expected = relative_change(ablated[None], intact)[0]
            torch.testing.assert_close(got[i][real], expected[real], atol=1e-5, rtol=1e-4)
    # Only some (head, input) pairs, as many rows a pass as the batch has (a later block's
    # hidden states, gathered already, must not be gathered again): the same numbers, NaN for
    # the pairs not asked for.
    needed = torch.rand(len(heads), real.shape[0], generator=torch.Generator().manual_seed(0))
    needed = needed < 0.5
    for max_rows in (1, real.shape[0], 256):
        some = ablation_effects(model, inputs, heads, hidden_state, relative_change, means=means,
                                max_rows=max_rows, needed=needed)  # fmt: skip
        asked = needed[:, :, None] & real[None]
        torch.testing.assert_close(some[asked], got[asked], atol=1e-6, rtol=1e-5)
        assert some[~needed].isnan().all()


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_ablation_effects_read_at_some_positions_equal_them_at_every_one(kind):
    """Each block's MLP computes the real tokens alone, and with ``read`` the last block's those
    read alone (where the model names its MLP and is not an encoder-decoder model): the same
    changes at the positions read, NaN elsewhere."""
    from probe.capture.architectures import is_encoder_decoder

    model = small_model(kind)
    inputs = padded_batch(kind)
    heads = [(0, 1), (1, 0), [(0, 2), (1, 3)]]
    means = head_means(model, [inputs])
    real = inputs["attention_mask"].bool()
    read = (torch.rand(real.shape, generator=torch.Generator().manual_seed(2)) < 0.4) & real
    every = ablation_effects(model, inputs, heads, hidden_state, relative_change, means=means)
    rows_in, handles = {0: [], 1: []}, []
    arch = architecture(model) if kind != "albert" else None
    cut = arch is not None and arch.mlp_post and not is_encoder_decoder(model)
    cut = cut and bool(arch.mlp_pre or arch.mlp_pre_fused)
    for k, block in enumerate(blocks(model)[:2]) if cut else ():
        post = block.get_submodule(arch.mlp_post)
        handles.append(post.register_forward_pre_hook(lambda _m, a, k=k: rows_in[k].append(a[0])))
    try:
        some = ablation_effects(model, inputs, heads, hidden_state, relative_change, means=means,
                                read=read)  # fmt: skip
    finally:
        for handle in handles:
            handle.remove()
    at = read[None].expand_as(every)
    torch.testing.assert_close(some[at], every[at], atol=1e-6, rtol=1e-5)
    assert some[~at].isnan().all()
    if cut:  # one pass: the batch's rows, and a copy per (item, input) from its lowest layer on
        # block 0: the batch's rows and the copies of the two items there, their real tokens
        assert len(rows_in[0][0]) == 3 * int(real.sum())
        # block 1, the last: those and item (1, 0)'s copies, the tokens read alone
        assert len(rows_in[1][0]) == int(read.sum()) * (1 + len(heads))


def claims_of(model, tokenizer, heads: pd.DataFrame, sentences=(), **options) -> Claims:
    """The analysis fed ``sentences`` (Corpus batches), told ``heads``, finished."""
    spec_layers, n_heads = len(blocks(model)), model.config.num_attention_heads
    context = Context(spec_layers, n_heads, causal=model.config.model_type == "gpt2",
                      model=model, tokenizer=tokenizer, options=options)  # fmt: skip
    analysis = Claims(context)
    for batch in sentences:
        batch.unit = "sentence"
        analysis.begin_batch(batch)
    analysis.take_heads(heads)
    return analysis


def heads_table(n_layers, n_heads, roles: dict, relations: dict | None = None) -> pd.DataFrame:
    rows = [{"layer": layer, "head": head, "roles": roles.get((layer, head), ""),
             "best_relation": (relations or {}).get((layer, head), "")}
            for layer in range(n_layers) for head in range(n_heads)]  # fmt: skip
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def induction_model():
    model = tf.AutoModelForCausalLM.from_pretrained(MODEL).eval()
    return model, tf.AutoTokenizer.from_pretrained(MODEL)


INDUCTION_ROLES = {PREVIOUS_TOKEN: "previous-token",
                   **{(1, h): "broad;induction;copying" for h in range(4)}}  # fmt: skip


def test_the_induction_models_heads_are_confirmed_and_its_decoy_is_not(induction_model):
    model, tokenizer = induction_model
    heads = heads_table(2, 4, INDUCTION_ROLES)
    table = claims_of(model, tokenizer, heads).finish()["claims"].set_index(["layer", "head"])
    assert (table.measure == "loss rise").all() and (table.inputs == "repeats").all()
    assert table.loc[PREVIOUS_TOKEN, "claim"] == "previous-token"
    assert table.confirmed.all(), table  # the previous-token head and all four induction heads
    # the induction heads' baseline: layer 0's unclaimed heads, every layer-1 head holding a claim
    assert table.loc[INDUCTION, "baseline_from"] == "nearest layers' unclaimed"
    assert table.loc[INDUCTION, "effect_low"] > table.loc[INDUCTION, "baseline"]

    decoy = copy.deepcopy(model)
    zero_head_output(decoy, *INDUCTION)
    repeats = claims_of(model, tokenizer, heads)._repeats()[0][0]
    with trace(model, ["blocks.1.attn.hook_pattern"]) as a, torch.no_grad():
        model(**repeats)
    with trace(decoy, ["blocks.1.attn.hook_pattern"]) as b, torch.no_grad():
        decoy(**repeats)
    name = "blocks.1.attn.hook_pattern"
    assert torch.equal(a[name][:, INDUCTION[1]], b[name][:, INDUCTION[1]])  # its claim stands
    tables = claims_of(decoy, tokenizer, heads).finish()
    table = tables["claims"].set_index(["layer", "head"])
    assert not table.loc[INDUCTION, "confirmed"]
    assert abs(table.loc[INDUCTION, "effect"]) < 1e-6
    others = [(1, h) for h in range(4) if (1, h) != INDUCTION]
    assert table.loc[others, "confirmed"].all() and table.loc[PREVIOUS_TOKEN, "confirmed"]
    heads_out = Claims.heads(tables, None).set_index(["layer", "head"])
    assert heads_out.loc[INDUCTION, "confirmed"] == False  # noqa: E712 (a nullable bool)
    assert heads_out.loc[INDUCTION, "claim_verdicts"] == "induction: pattern only"
    assert heads_out.loc[PREVIOUS_TOKEN, "claim_verdicts"] == (
        "previous-token: confirmed by ablation"
    )


def test_the_repeats_loss_is_read_where_induction_can_predict_the_next_token(induction_model):
    """BOS, 16 random tokens, the same again (33 tokens): the loss read at t is of token t + 1,
    so the positions read are t = 17 to 31, each predicting a second-copy token after its first
    (18 to 32), position 17 included (its next token is the first induction can predict)."""
    from analyses.claims.ablation_test import per_input
    from analyses.claims.inputs import repeat_groups

    model, tokenizer = induction_model
    groups = repeat_groups(tokenizer, 0, 2, 16, model)
    ((_, tags, _),) = groups
    assert tuple(tags.shape) == (2, 33)
    effect = torch.arange(33, dtype=torch.float64).expand(1, 2, 33)  # [items, batch, pos]: t
    changes, positions = per_input("induction", "", groups, [effect], None, lm=True, control=False)
    assert positions == 2 * 15
    assert [float(v[0]) for v in changes.values()] == [sum(range(17, 32)) / 15] * 2  # mean of t
    # the control, the first copy, is read alike: t = 1 to 15, each predicting a first-copy token
    changes, positions = per_input("induction", "", groups, [effect], None, lm=True, control=True)
    assert positions == 2 * 15
    assert [float(v[0]) for v in changes.values()] == [sum(range(1, 16)) / 15] * 2


def test_claims_are_listed_from_roles_and_relations():
    heads = heads_table(2, 3, {(0, 1): "sink;syntactic", (1, 2): "coreference;induction"},
                        {(0, 1): "obj", (1, 0): "nsubj"})  # fmt: skip
    listed = listed_claims(heads)
    assert listed.values.tolist() == [
        [0, 1, "syntactic", "obj"],
        [1, 0, "relation", "nsubj"],
        [1, 2, "induction", ""],
        [1, 2, "coreference", ""],
    ]


def ewt_batches(tokenizer, n: int, batch_size: int):
    path = EWT / "en_ewt-ud-dev.conllu"
    sentences = [s for _, s in zip(range(n), iter_conllu(path), strict=False)]
    return Corpus(sentences, tokenizer, 512).batches(batch_size)


@pytest.mark.slow
@needs_ewt()
def test_minilms_strongest_syntactic_head_beats_its_neighbours_not_its_control(minilm, tmp_path):
    """MiniLM's strongest syntactic head (2-0, obj) changes the hidden state at its dependents
    more than its layer's unclaimed heads do (p ≈ 2e-5), but no more than at the same tokens of
    the same sentences shuffled (its control, issue #63: 0.081 against 0.078): not confirmed
    alone. Its decoy is confirmed in no form."""
    from probe.app.analyze import analyze
    from probe.app.plan import Settings

    model, tokenizer = minilm
    out = tmp_path / "r"
    analyze(Settings(model="minilm", treebank=[str(EWT / "en_ewt-ud-dev.conllu")], out=out,
                     max_sentences=400, analyses=["syntax", "claims"],
                     options={"claims_sentences": 30}))  # fmt: skip
    heads = pd.read_csv(out / "heads.csv", keep_default_na=False)
    syntactic = heads[heads.roles.str.contains("syntactic")]
    strongest = syntactic.loc[syntactic.best_relation_margin.astype(float).idxmax()]
    head = (int(strongest.layer), int(strongest["head"]))
    claims = pd.read_csv(out / "claims.csv").set_index(["layer", "head"])
    row = claims.loc[[head]].iloc[0]
    assert row.p < 1e-3 and row.control_on == "the same sentences shuffled", row.to_dict()
    assert row.effect_low < row.control < row.effect_high and row.p_control > 0.05
    assert strongest.confirmed == "False" and row.verdict == "not confirmed"
    run = json.loads((out / "run.json").read_text())
    assert run["claims"][0]["inputs"] == "sentences" and run["claims"][0]["count"] >= 10

    # the same claims, the analysis fed the same sentences in other batches: the same table
    given = heads.drop(columns=[c for c in heads if c.startswith(("ablation", "confirmed"))])
    batches = ewt_batches(tokenizer, 400, 7)
    mine = claims_of(model, tokenizer, given, batches, claims_sentences=30).finish()["claims"]
    written = pd.read_csv(out / "claims.csv", keep_default_na=False)
    assert mine.effect.tolist() == written.effect.tolist()
    assert mine.confirmed.tolist() == written.confirmed.tolist()

    decoy = copy.deepcopy(model)
    zero_head_output(decoy, *head)
    batches = ewt_batches(tokenizer, 400, 32)
    table = claims_of(decoy, tokenizer, given, batches, claims_sentences=30).finish()["claims"]
    row = table.set_index(["layer", "head"]).loc[head]
    assert not row.confirmed and abs(row.effect) < 1e-6 and row.baseline > 0
    assert row.verdict == "not confirmed"


def test_a_run_writes_the_columns_and_the_page_marks_each_claim(sample_report):
    """MiniLM on the hand-written sample, every default analysis (claims among them)."""
    out = sample_report
    heads = pd.read_csv(out / "heads.csv", keep_default_na=False)
    for column in ("ablation_effect", "ablation_effect_low", "ablation_effect_high",
                   "ablation_baseline", "confirmed"):  # fmt: skip
        assert column in heads
    claimed = heads.claim_verdicts != ""
    assert claimed.any() and heads.confirmed[claimed].isin(["True", "False"]).all()
    assert (heads.confirmed[~claimed] == "").all() and (heads.ablation_effect[~claimed] == "").all()
    run = json.loads((out / "run.json").read_text())
    assert run["options"]["claims_ablation"] == "mean"
    assert {r["inputs"] for r in run["claims"]} <= {"sentences", "repeats", "windows", "needles"}
    page = (out / "index.html").read_text()
    assert "Claims tested by ablation" in page
    for verdict in heads.claim_verdicts[claimed]:
        assert verdict in page  # each head card's line of verdicts
    claims = pd.read_csv(out / "claims.csv", keep_default_na=False)
    too_few = claims.clusters.astype(int) < 10
    assert not claims.confirmed[too_few].eq("True").any()


@pytest.mark.parametrize("threads", [1, 2])
def test_the_tables_are_the_same_for_one_or_two_threads(induction_model, threads):
    model, tokenizer = induction_model
    heads = heads_table(2, 4, INDUCTION_ROLES)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        table = claims_of(model, tokenizer, heads).finish()["claims"]
        torch.set_num_threads(3 - threads)
        other = claims_of(model, tokenizer, heads).finish()["claims"]
    finally:
        torch.set_num_threads(before)
    pd.testing.assert_frame_equal(table, other)


def test_an_importance_folder_of_layout_1_is_read_with_its_column_renamed():
    """Importance's heads.csv column was ablation_effect, now the claims'; layout 2 renames it."""
    from probe.app.folder import SCHEMA, migrate

    heads = pd.DataFrame({"layer": [0], "head": [0], "ablation_effect": [0.5]})
    run, tables = {"analyses": ["syntax", "importance"]}, {"heads": heads}
    migrate(run, tables)
    assert run["schema"] == SCHEMA >= 2 and tables["heads"].importance_effect.tolist() == [0.5]
    assert "ablation_effect" not in tables["heads"]
    untouched = {"heads": heads}
    migrate({"analyses": ["claims"]}, untouched)  # no importance: the claims' own column
    assert untouched["heads"].ablation_effect.tolist() == [0.5]


def test_resample_ablation_confirms_the_previous_token_head_and_not_a_decoy(induction_model):
    """Resampled from another repeated sequence, the layer-1 heads matter less than layer 0's
    unclaimed heads (their baseline: every layer-1 head is claimed); the previous-token head is
    confirmed, and a decoy's effect is 0."""
    model, tokenizer = induction_model
    heads = heads_table(2, 4, INDUCTION_ROLES)
    table = claims_of(model, tokenizer, heads, claims_ablation="resample").finish()["claims"]
    assert table.set_index(["layer", "head"]).loc[PREVIOUS_TOKEN, "confirmed"]
    decoy = copy.deepcopy(model)
    zero_head_output(decoy, *INDUCTION)
    table = claims_of(decoy, tokenizer, heads, claims_ablation="resample").finish()["claims"]
    row = table.set_index(["layer", "head"]).loc[INDUCTION]
    assert not row.confirmed and abs(row.effect) < 1e-6


@pytest.mark.slow
@needs_ewt()
def test_a_decoders_syntactic_claim_is_measured_by_the_loss_at_its_dependents_next_tokens(minilm):
    """A small GPT-2 with MiniLM's tokenizer: a syntactic claim's effect is, per sentence bearing
    the relation, the mean rise of −log p(token t+1) at the tokens t of its dependents (t + 1
    real), the head's z replaced by its mean over the sentences' real tokens, computed here with
    plain PyTorch hooks, unpadded, one sentence at a time; averaged over the sentences."""
    from probe.inputs.treebank import RELATIONS

    _, tokenizer = minilm
    torch.manual_seed(0)
    config = tf.GPT2Config(n_embd=32, n_head=4, n_layer=2, n_positions=256,
                           vocab_size=tokenizer.vocab_size)  # fmt: skip
    model = tf.GPT2LMHeadModel(config).eval()
    heads = heads_table(2, 4, {(1, 2): "syntactic"}, {(1, 2): "det"})
    batches = list(ewt_batches(tokenizer, 40, 8))
    table = claims_of(model, tokenizer, heads, batches, claims_sentences=1000).finish()["claims"]
    row = table.set_index(["layer", "head"]).loc[(1, 2)]
    assert row.measure == "loss rise" and row.inputs == "sentences"

    det = RELATIONS.index("det")
    sentences = []  # (token ids, positions of the dependents' tokens whose next token is real)
    for batch in batches:
        for b in range(len(batch.input_ids)):
            n = int(batch.attention_mask[b].sum())
            word = batch.word_of_token[b, :n]
            bears = [int(w) >= 0 and int(batch.relations[b, w]) == det and
                     int(batch.heads[b, w]) >= 0 for w in word]  # fmt: skip
            if any(bears):
                at = [t for t in range(n - 1) if bears[t]]
                sentences.append((batch.input_ids[b, :n][None], at))
    with torch.no_grad():
        zs = [z_of(model, {"input_ids": ids})[1][0, :, 2] for ids, _ in sentences]
        mean = torch.cat(zs).mean(0)
        rises = []
        for ids, at in sentences:
            logp = model(input_ids=ids).logits.log_softmax(-1)[0]
            handle = replaced(model, 1, 2, mean)
            try:
                ablated = model(input_ids=ids).logits.log_softmax(-1)[0]
            finally:
                handle.remove()
            if at:
                nxt = ids[0, 1:]
                loss = -logp[:-1].gather(-1, nxt[:, None])[:, 0]
                loss_ablated = -ablated[:-1].gather(-1, nxt[:, None])[:, 0]
                rises.append(float((loss_ablated - loss)[at].mean()))
    assert row.clusters == len(rises) >= 10
    assert row.positions == sum(len(at) for _, at in sentences)
    assert abs(row.effect) > 1e-4  # the head does something, so the comparison has teeth
    assert row.effect == pytest.approx(sum(rises) / len(rises), rel=1e-4, abs=1e-7)


# -- coreference (windows) and retrieval (needle trials) ----------------------------------------

# MiniLM's head that finds a scored mention's antecedent second best on GUM dev (51% of them; the
# best, 2-9, 52%). No head of MiniLM beats the rules baseline there (77%), so no run gives one the
# coreference role; told it here, the claim is tested as a run would test it.
COREF = (1, 1)


def gum_windows(tokenizer, batch_size: int):
    from probe.inputs.units import Source
    from probe.inputs.units.windows import CoreferenceWindows

    unit = CoreferenceWindows(Source(treebank=(GUM / "en_gum-ud-dev.conllu",)), tokenizer, 512)
    for batch in unit.batches(batch_size):
        batch.unit = "window"
        yield batch


def windows_claims(model, tokenizer, heads, batches, **options) -> Claims:
    analysis = claims_of(model, tokenizer, heads, **options)
    for batch in batches:
        analysis.begin_batch(batch)
    return analysis


@pytest.mark.slow
@needs_gum()
def test_a_minilm_coreference_head_beats_its_neighbours_and_its_decoy_does_not(minilm):
    """Told that 1-1 is a coreference head, MiniLM's claim beats its layer's unclaimed heads
    (above their baseline, interval and all), but not its control, the same windows shuffled
    (issue #63): not confirmed alone. Its decoy is confirmed in no form."""
    model, tokenizer = minilm
    heads = heads_table(6, 12, {COREF: "coreference"})
    analysis = windows_claims(model, tokenizer, heads, gum_windows(tokenizer, 32))
    assert len(analysis.windows) == 12  # claims_windows, of the keyed first
    kept = dict(analysis.windows)
    group = analysis._windows()[0][0]
    tables = analysis.finish()
    row = tables["claims"].iloc[0]
    assert (row.claim, row.inputs, row.measure) == ("coreference", "windows", "relative change")
    assert row.clusters == 12 and row.positions > 50 and row.baseline_from == "unclaimed"
    assert row.effect_low > row.baseline and row.p < 0.01, row.to_dict()
    assert row.control_on == "the same windows shuffled" and row.control > 0
    assert not row.confirmed and row.verdict == "not confirmed"
    run = tables["claims_run"].iloc[0]
    assert (run.inputs, run["count"], run.positions) == ("windows", 12, row.positions)

    # other batches, and two processes' halves merged: the same windows, the same table
    batches = list(gum_windows(tokenizer, 7))
    one = windows_claims(model, tokenizer, heads, batches[::2])
    one.merge(windows_claims(model, tokenizer, heads, batches[1::2]))
    assert one.windows == kept
    pd.testing.assert_frame_equal(one.finish()["claims"], tables["claims"])

    decoy = copy.deepcopy(model)
    zero_head_output(decoy, *COREF)
    name = f"blocks.{COREF[0]}.attn.hook_pattern"
    with trace(model, [name]) as a, trace(decoy, [name]) as b, torch.no_grad():
        model(**group), decoy(**group)
    assert torch.equal(a[name][:, COREF[1]], b[name][:, COREF[1]])  # its claim stands
    table = windows_claims(decoy, tokenizer, heads, gum_windows(tokenizer, 32)).finish()["claims"]
    row = table.iloc[0]
    assert not row.confirmed and abs(row.effect) < 1e-6 and row.baseline > 0
    verdicts = Claims.heads({"claims": table}, None).claim_verdicts.tolist()
    assert verdicts == ["coreference: pattern only"]


def test_claims_without_inputs_say_too_few_inputs():
    """Coreference claims on a run that kept no window (a treebank without coreference): kept,
    untested, and the verdict says why."""
    model = bert()
    heads = heads_table(2, 4, {(0, 1): "coreference"})
    tables = claims_of(model, None, heads).finish()
    row = tables["claims"].iloc[0]
    assert (row.claim, row.inputs, row.clusters, row.tested, row.confirmed) == (
        "coreference", "windows", 0, False, False)  # fmt: skip
    assert tables["claims_run"].iloc[0]["count"] == 0
    verdict = Claims.heads(tables, None).claim_verdicts.tolist()
    assert verdict == ["coreference: pattern only (too few inputs to test)"]


def random_needles(n: int, seed: int = 0) -> list[Trial]:
    """Needle trials the induction model can read (test_retrieval.py's): BOS, 30 random tokens
    with a needle of 8 inserted at an evenly spaced depth, then the needle's first 3 tokens again
    as the question and its other 5 as the answer."""
    rng = np.random.default_rng(seed)
    trials = []
    for k in range(n):
        depth = k / (n - 1)
        hay, needle = rng.integers(1, 64, 30).tolist(), rng.integers(1, 64, 8).tolist()
        at = 1 + round(depth * 30)
        ids = [0, *hay[: at - 1], *needle, *hay[at - 1 :], *needle]
        answer = range(len(ids) - 5, len(ids))
        trials.append(Trial(tuple(ids), range(at, at + 8), answer, 30, depth, True))
    return trials


def needle_claims(model, tokenizer, heads, n: int = 48, **options) -> Claims:
    """The analysis with its needle trials replaced by ``random_needles`` (the induction model's
    word-level tokenizer reads none of the treebank's text)."""
    analysis = claims_of(model, tokenizer, heads, **options)
    analysis._trials = lambda: (random_needles(n), {"haystack_tokens": 30})
    return analysis


# The layer-1 heads as retrieval heads, and the previous-token head they read (which would
# otherwise be drawn into their baseline, layer 0's unclaimed heads: without it they copy nothing).
RETRIEVAL_ROLES = {PREVIOUS_TOKEN: "previous-token", **{(1, h): "retrieval" for h in range(4)}}


@pytest.mark.slow
def test_the_induction_models_retrieval_claims_are_confirmed_and_its_decoy_is_not(
    induction_model,
):
    """Its layer-1 heads copy the answer from the needle (test_retrieval.py: scores 0.4 to 0.65);
    every one claimed, their baseline is layer 0's unclaimed heads (the previous-token head holds
    its claim). On 48 trials all four are confirmed (on 12, the redundant heads' effects are too
    spread for two of them to clear it)."""
    model, tokenizer = induction_model
    heads = heads_table(2, 4, RETRIEVAL_ROLES)
    tables = needle_claims(model, tokenizer, heads).finish()
    table = tables["claims"].set_index(["layer", "head"])
    table = table[table.claim == "retrieval"]
    assert len(table) == 4 and (table.inputs == "needles").all()
    assert (table.measure == "loss rise").all()
    assert (table.clusters == 48).all() and (table.positions == 48 * 5).all()
    assert table.confirmed.all(), table
    assert (table.baseline_from == "nearest layers' unclaimed").all()
    assert (table.baseline_heads == 3).all()  # 0-1, 0-2, 0-3
    run = tables["claims_run"].set_index("inputs").loc["needles"]
    assert (run["count"], run.haystack_tokens) == (48, 30)

    decoy = copy.deepcopy(model)
    zero_head_output(decoy, *INDUCTION)
    table = needle_claims(decoy, tokenizer, heads).finish()["claims"]
    row = table.set_index(["layer", "head"]).loc[INDUCTION]
    assert not row.confirmed and abs(row.effect) < 1e-6


def test_retrieval_effects_are_a_plain_forward_pass_and_a_loss_by_hand(induction_model):
    """Zero ablation, each head's z set to 0 by a plain PyTorch pre-hook: per trial the mean over
    the answer's tokens of the rise of -log p(token), read from the logits before it."""
    model, tokenizer = induction_model
    heads = heads_table(2, 4, {INDUCTION: "retrieval"})
    trials = random_needles(12, seed=3)
    analysis = claims_of(model, tokenizer, heads, claims_ablation="zero", claims_baseline_heads=0)
    analysis._trials = lambda: (trials, {"haystack_tokens": 30})
    row = analysis.finish()["claims"].iloc[0]
    baseline = [(1, 0), (1, 2), (1, 3)]  # claims_baseline_heads 0: all three, on every trial

    def losses(trial, head=None):
        ids = torch.tensor([trial.ids])
        handle = replaced(model, *head, torch.zeros(head_dim(model))) if head else None
        try:
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0].double()
        finally:
            if handle:
                handle.remove()
        at = torch.tensor(list(trial.answer))
        return -logits[at - 1].log_softmax(-1)[torch.arange(len(at)), ids[0, at]]

    effect, others = [], []
    for trial in trials:
        intact = losses(trial)
        effect.append(float((losses(trial, INDUCTION) - intact).mean()))
        others.append([float((losses(trial, h) - intact).mean()) for h in baseline])
    assert row.clusters == 12 and row.baseline_heads == 3
    assert row.effect == pytest.approx(np.mean(effect), rel=1e-5, abs=1e-6)
    assert row.baseline == pytest.approx(np.mean(others), rel=1e-5, abs=1e-6)
    from scipy.stats import ttest_1samp

    expected = ttest_1samp(np.array(effect) - np.mean(others, 1), 0, alternative="greater")
    assert row.p == pytest.approx(expected.pvalue, rel=1e-4)


@needs_ewt()
def test_the_haystack_is_the_treebanks_first_sentences_whatever_the_batches(minilm):
    """A decoder keeps the first sentences' text, enough for ``claims_haystack`` tokens, in any
    order of batches; the trials are the needle's, at evenly spaced depths, tagged where the
    answer's tokens are predicted."""
    model, tokenizer = minilm

    def kept(batches) -> Claims:
        context = Context(6, 12, causal=True, model=model, tokenizer=tokenizer,
                          options={"claims_haystack": 100, "claims_needles": 5})  # fmt: skip
        analysis = Claims(context)
        for batch in batches:
            batch.unit = "sentence"
            analysis.begin_batch(batch)
        return analysis

    forward = kept(ewt_batches(tokenizer, 60, 32))
    backward = kept(reversed(list(ewt_batches(tokenizer, 60, 7))))
    assert forward.texts == backward.texts and min(forward.texts) == 0
    assert sum(n for _, n in forward.texts.values()) >= 200
    assert max(forward.texts) == len(forward.texts) - 1
    trials, used = forward._trials()
    assert used == {"haystack_tokens": 100} and len(trials) == 5
    assert [t.depth for t in trials] == [0, 0.25, 0.5, 0.75, 1] and all(t.needle for t in trials)
    groups, _ = forward._needles()
    for inputs, tags, numbers in groups:
        for row, i in enumerate(numbers.tolist()):
            answer = trials[i].answer
            assert torch.nonzero(tags[row] == 0).flatten().tolist() == [
                t - 1 for t in answer]  # fmt: skip
            assert inputs["input_ids"][row, : len(trials[i].ids)].tolist() == list(trials[i].ids)


@pytest.mark.slow
@needs_ewt()
def test_a_decoders_run_tests_its_retrieval_claims_on_needle_trials(minilm, tmp_path):
    """A small random Llama reading MiniLM's tokens, ``-a retrieval,claims`` with a low
    retrieval threshold (so that some head holds the role): each retrieval head's claim is tested
    on needle trials in the treebank's first sentences, the haystack capped by the context (256
    positions, 64 kept free) and recorded."""
    from probe.app.analyze import analyze
    from probe.app.plan import Settings

    _, tokenizer = minilm
    torch.manual_seed(0)
    config = tf.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                            num_hidden_layers=2, intermediate_size=64,
                            vocab_size=len(tokenizer), max_position_embeddings=256)  # fmt: skip
    folder = tmp_path / "llama"
    tf.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "r"
    analyze(Settings(model=str(folder), treebank=[str(EWT / "en_ewt-ud-dev.conllu")], out=out,
                     max_sentences=300, analyses=["retrieval", "claims"],
                     thresholds={"retrieval": 0.05},
                     options={"retrieval_lengths": "64"}))  # fmt: skip
    heads = pd.read_csv(out / "heads.csv", keep_default_na=False)
    held = heads[heads.roles.str.split(";").map(lambda r: "retrieval" in r)]
    assert len(held), heads.retrieval_score.tolist()
    claims = pd.read_csv(out / "claims.csv", keep_default_na=False)
    assert sorted(zip(claims.layer, claims["head"], strict=True)) == sorted(
        zip(held.layer, held["head"], strict=True))  # fmt: skip
    assert (claims.claim == "retrieval").all() and (claims.inputs == "needles").all()
    assert (claims.clusters.astype(int) == 12).all() and claims.tested.astype(str).eq("True").all()
    (run,) = json.loads((out / "run.json").read_text())["claims"]
    assert (run["inputs"], run["count"], run["haystack_tokens"]) == ("needles", 12, 192)
    assert run["measure"] == "relative change of the last hidden state"  # no --lm-head


@needs_gum()
def test_the_claims_read_coreference_windows_only_beside_coref(tmp_path):
    """Coreference claims come from the coref analysis: a run without it streams no windows for
    the claims (on GUM, a second forward pass over its documents)."""
    from probe.app.plan import Settings, plan

    gum = [str(GUM / "en_gum-ud-dev.conllu")]
    alone = plan(Settings(model="minilm", treebank=gum, out=tmp_path / "a",
                          analyses=["syntax", "claims"]))  # fmt: skip
    assert alone.units == ("sentence",) and alone.reads["claims"] == ("sentence",)
    beside = plan(Settings(model="minilm", treebank=gum, out=tmp_path / "b",
                           analyses=["coref", "claims"]))  # fmt: skip
    assert beside.reads["claims"] == ("sentence", "window")
    assert set(beside.units) == {"sentence", "window"}


def test_a_window_option_without_coref_is_refused_though_claims_run():
    from probe.app.plan import Settings, plan
    from probe.errors import ProbeError

    with pytest.raises(ProbeError, match="--coref-window says how to read the coreference "
                       "windows, which no analysis of this run reads; add coref to"):  # fmt: skip
        plan(Settings(model="minilm", treebank=["sample"], analyses=["syntax", "claims"],
                      options={"coref_window": 200}))  # fmt: skip


def test_a_smaller_token_budget_a_pass_changes_nothing_but_the_passes(induction_model, monkeypatch):
    """``MAX_TOKENS`` bounds an ablated pass's memory: with a budget of one token, every pass
    holds its group's own rows and one more, and the tables are the same. Two of the four
    induction heads claimed (a group of two, and the previous-token head alone): the same code
    paths as four, in a third of the passes."""
    import analyses.claims.ablation_test as claims

    model, tokenizer = induction_model
    two = {PREVIOUS_TOKEN: "previous-token", (1, 0): "induction", (1, 1): "induction"}
    heads = heads_table(2, 4, two)
    table = claims_of(model, tokenizer, heads).finish()["claims"]
    monkeypatch.setattr(claims, "MAX_TOKENS", 1)
    assert claims.max_rows((4, 34)) == 5
    small = claims_of(model, tokenizer, heads).finish()["claims"]
    assert table.tested.any() and table.group.ne("").sum() >= 2  # the group was ablated too
    pd.testing.assert_frame_equal(table, small, rtol=1e-6)


def test_a_claim_with_no_head_to_compare_with_says_so():
    """Every head claimed (or a layer of one head, and no other unclaimed): the claim is
    untested for want of a baseline, not of inputs."""
    from analyses.claims import verdict

    rows = pd.DataFrame({"tested": [False, False, False, True],
                         "confirmed": [False, False, False, True],
                         "baseline_from": ["none", "none", "unclaimed", "unclaimed"],
                         "clusters": [12, 0, 2, 12]})  # fmt: skip
    said = [verdict(row) for row in rows.itertuples(index=False)]
    assert said == ["pattern only (untested: no unclaimed head to compare it with)",
                    "pattern only (too few inputs to test)",
                    "pattern only (too few inputs to test)", "confirmed by ablation"]  # fmt: skip
