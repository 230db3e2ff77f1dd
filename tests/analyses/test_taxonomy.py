"""Head types (analyses.taxonomy, probe.patterns.headtypes, the repeated-sequence unit): each score
on patterns worked out by hand, the unit's sequences, intervals that do not depend on batching,
the Python entry point against the analysis, and the known heads of a trained model."""

import json

import numpy as np
import pandas as pd
import pytest
import torch
import transformers as tf
from streams import context
from tokenizers_util import wordpiece
from typer.testing import CliRunner

import probe
from analyses.taxonomy import Taxonomy
from analyses.vocabulary import Role, Thresholds
from probe.app.cli import app
from probe.capture.names import parse
from probe.inputs.units import Source
from probe.inputs.units.repeats import RepeatedSequences, ordinary_tokens
from probe.patterns.headtypes import (
    SCORES,
    head_types,
    offset_scores,
    sink_sums,
    uniform_previous,
)
from probe.pipeline.runner import stream

N = 4  # tokens per copy in the hand-worked patterns: BOS at 0, copies at 1…4 and 5…8


def one_hot(T: int, key_of) -> torch.Tensor:
    """``[1, 1, T, T]`` with each query i's weight on ``key_of(i)`` (or on itself if None)."""
    p = torch.zeros(1, 1, T, T)
    for i in range(T):
        k = key_of(i)
        p[0, 0, i, i if k is None else k] = 1
    return p


def test_scores_on_patterns_worked_out_by_hand():
    T = 1 + 2 * N
    previous = one_hot(T, lambda i: i - 1 if i >= 1 else None)
    assert offset_scores(previous, N)[0, :, 0].tolist() == [1, 0, 0]
    duplicate = one_hot(T, lambda i: i - N if i > N else None)
    assert offset_scores(duplicate, N)[0, :, 0].tolist() == [0, 1, 0]
    induction = one_hot(T, lambda i: i - N + 1 if i > N else None)
    assert offset_scores(induction, N)[0, :, 0].tolist() == [0, 0, 1]
    # causal uniform: A[i, j] = 1 / (i + 1); by hand over the queries each score averages
    uniform = torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1)[:, None]
    got = offset_scores(uniform[None, None], N)[0, :, 0]
    every = np.mean([1 / (i + 1) for i in range(1, 2 * N + 1)])  # queries 1…2N
    second = np.mean([1 / (i + 1) for i in range(N + 1, 2 * N + 1)])  # the second copy's
    expected = [every, second, second]
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6)
    # the previous-token null is that uniform head's score, causal or not (1/T: every key seen)
    assert uniform_previous(N, causal=True, keys=T) == pytest.approx(expected[0])
    everywhere = torch.full((1, 1, T, T), 1 / T)
    assert uniform_previous(N, causal=False, keys=T) == pytest.approx(
        offset_scores(everywhere, N)[0, 0, 0].item()
    )
    # with the BOS at 1 (a decoder's start token first), every query moves one right
    shifted = torch.tril(torch.ones(T + 1, T + 1)) / torch.arange(1, T + 2)[:, None]
    assert uniform_previous(N, 1, causal=True, keys=T + 1) == pytest.approx(
        offset_scores(shifted[None, None], N, 1)[0, 0, 0].item()
    )


def test_sink_alpha_by_hand():
    """α: mean attention to key 0 over real queries among the first 64."""
    p = torch.zeros(2, 1, 70, 70)
    p[0, 0, :, 0] = 0.5
    p[1, 0, :3, 0] = 1.0
    real = torch.zeros(2, 70, dtype=torch.bool)
    real[0] = True  # 70 real tokens: only the first 64 count
    real[1, :3] = True
    sums, queries = sink_sums(p, real)
    assert queries == 64 + 3 and sums.item() == pytest.approx(64 * 0.5 + 3 * 1.0)


@pytest.fixture(scope="module")
def bert_tokenizer():
    return wordpiece()


def test_the_unit_lays_out_repeats_and_nulls(bert_tokenizer):
    unit = RepeatedSequences(Source(seed=3), bert_tokenizer, 512,
                             options={"repeat_sequences": 6, "repeat_length": 7})  # fmt: skip
    repeat, null = unit.pair(2)
    cls, sep = bert_tokenizer.cls_token_id, bert_tokenizer.sep_token_id
    assert repeat[0] == null[0] == cls and repeat[-1] == null[-1] == sep  # an encoder's specials
    assert len(repeat) == len(null) == 1 + 2 * 7 + 1
    assert repeat[1:8] == repeat[8:15] == null[1:8] and null[8:15] != repeat[8:15]
    ordinary = set(ordinary_tokens(bert_tokenizer).tolist())
    assert set(repeat[1:-1] + null[1:-1]) <= ordinary and cls not in ordinary
    # keyed to the seed and the index: another process, another batching, the same sequences
    other = RepeatedSequences(Source(seed=3), bert_tokenizer, 512, shard=(0, 2),
                              options={"repeat_sequences": 6, "repeat_length": 7})  # fmt: skip
    assert other.pair(2) == (repeat, null) and other.size() == 2 * 3
    rows = [row.tolist() for batch in other.batches(4) for row in batch.input_ids]
    assert rows[2:4] == [repeat, null] and len(rows) == 6
    assert RepeatedSequences(Source(seed=4), bert_tokenizer, 512,
                             options={"repeat_length": 7}).pair(2) != (repeat, null)  # fmt: skip


def test_a_sequence_longer_than_the_model_is_refused(bert_tokenizer):
    with pytest.raises(probe.ProbeError, match=r"--repeat-length 300 .* use at most 255"):
        RepeatedSequences(Source(), bert_tokenizer, 512, options={"repeat_length": 300})


@pytest.fixture(scope="module")
def gpt2(bert_tokenizer):
    """A small random GPT-2 (2 layers, 4 heads), with a tokenizer whose [CLS] is the BOS."""
    torch.manual_seed(0)
    config = tf.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=200, n_positions=128)
    return tf.GPT2LMHeadModel(config).eval(), bert_tokenizer


def streamed(model, tokenizer, batch_size: int, shard=(0, 1), sequences: int = 24, n: int = 12):
    analysis = Taxonomy(context(2, 4, model=model, causal=True,
                                options={"repeat_length": n}))  # fmt: skip
    options = {"repeat_sequences": sequences, "repeat_length": n}
    unit = RepeatedSequences(Source(seed=0), tokenizer, 128, shard=shard, options=options)
    batches = (setattr(b, "unit", "repeats") or b for b in unit.batches(batch_size))
    stream(model.base_model, batches, [analysis])
    return analysis


@pytest.mark.slow
def test_the_trained_previous_token_head_holds_its_role_and_a_random_head_does_not():
    """On the tiny GPT-2 trained on repeated sequences, the head the tutorial calls the
    previous-token head gets the previous-token role from the taxonomy alone (no treebank), and
    no other head does; on the same model with random weights, no head gets it."""
    from induction import MODEL, PREVIOUS_TOKEN

    tokenizer = tf.AutoTokenizer.from_pretrained(MODEL)
    trained = tf.AutoModelForCausalLM.from_pretrained(MODEL).eval()
    torch.manual_seed(0)
    untrained = tf.AutoModelForCausalLM.from_config(trained.config).eval()
    held = {}
    for name, model in (("trained", trained), ("random", untrained)):
        tables = streamed(model, tokenizer, 20, sequences=40, n=20)._tables()
        heads = Taxonomy.heads(tables, Thresholds()).set_index(["layer", "head"])
        held[name] = heads.index[heads[str(Role.PREVIOUS_TOKEN)]].tolist()
        table = tables["taxonomy"].set_index(["layer", "head"])
        if name == "trained":
            best = table.loc[PREVIOUS_TOKEN]
            assert best.previous_token_low > best.previous_token_null + 0.5
        else:  # near uniform: within a little of the uniform head's score
            assert (table.previous_token - table.previous_token_null).abs().max() < 0.1
    assert held == {"trained": [PREVIOUS_TOKEN], "random": []}


@pytest.mark.slow
def test_intervals_do_not_depend_on_batches_or_processes(gpt2):
    model, tokenizer = gpt2
    one = streamed(model, tokenizer, 48)._tables()["taxonomy"]
    small = streamed(model, tokenizer, 6)._tables()["taxonomy"]
    first, second = (streamed(model, tokenizer, 10, (r, 2)) for r in (0, 1))
    first.merge(second)
    merged = first._tables()["taxonomy"]
    for other in (small, merged):
        pd.testing.assert_frame_equal(other, one, check_exact=False, rtol=1e-6, atol=1e-7)
    assert (one.sequences == 24).all()
    assert (one.induction_low < one.induction).all() and (one.induction < one.induction_high).all()


@pytest.mark.slow
def test_the_entry_point_gives_the_analysis_means(gpt2):
    """probe.head_types on the unit's own sequences equals the analysis's table."""
    model, tokenizer = gpt2
    unit = RepeatedSequences(Source(seed=0), tokenizer, 128,
                             options={"repeat_sequences": 24, "repeat_length": 12})  # fmt: skip
    pairs = [unit.pair(i) for i in range(24)]
    ours = probe.head_types(model, torch.tensor([r for r, _ in pairs]), 12,
                            torch.tensor([n for _, n in pairs]))  # fmt: skip
    table = streamed(model, tokenizer, 8)._tables()["taxonomy"]
    for score in ("previous_token", "duplicate_token", "induction"):
        np.testing.assert_allclose(ours[score], table[score], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(ours[f"{score}_null"], table[f"{score}_null"], rtol=1e-5,
                                   atol=1e-7)  # fmt: skip
    assert head_types is probe.head_types


def set_heads(n: int, repeats_only: bool):
    """A hook that makes layer 0, head 0 a previous-token head (on every sequence: it attends
    by position, as one does), layer 1, head 2 attend from each second-copy token to the one
    after its earlier copy and layer 1, head 3 to the earlier copy itself: on every sequence (a
    head that attends by position), or only on repeats (rows 0, 2, 4… of a batch of pairs: a
    head that finds the earlier copy by its content, as induction and duplicate-token heads
    do)."""

    def hook(p, name):
        out = p.clone()
        T = p.shape[-1]
        if parse(name).layer == 0:
            out[:, 0] = 0
            out[:, 0, 0, 0] = 1
            out[:, 0, torch.arange(1, T), torch.arange(T - 1)] = 1
        else:
            rows = torch.arange(0, len(p), 2 if repeats_only else 1)[:, None]
            queries = torch.arange(n + 1, 2 * n + 1)
            for head, offset in ((2, n - 1), (3, n)):
                out[rows, head, queries] = 0
                out[rows, head, queries, queries - offset] = 1
        return out

    return hook


@pytest.mark.parametrize("repeats_only", [True, False])
@pytest.mark.slow
def test_probe_finds_heads_set_by_hand(gpt2, repeats_only):
    """Through the mirrored model and the runner, the heads whose patterns were set are the ones
    found; the induction role needs the score above its null, so a head that attends to those
    positions on every sequence, repeat or not, does not get it."""
    model, tokenizer = gpt2
    points = {f"blocks.{layer}.attn.hook_pattern": set_heads(12, repeats_only) for layer in (0, 1)}
    with probe.hooks(model.base_model, points):  # the model the runner streams through
        analysis = streamed(model, tokenizer, 16, sequences=40)
    tables = analysis._tables()
    table = tables["taxonomy"].set_index(["layer", "head"])
    assert table.previous_token.idxmax() == (0, 0) and table.induction.idxmax() == (1, 2)
    assert table.loc[(0, 0), "previous_token"] == pytest.approx(1)
    uniform = uniform_previous(12, causal=True, keys=1 + 2 * 12)
    np.testing.assert_allclose(table.previous_token_null, uniform)  # a uniform head's
    best = table.loc[(1, 2)]
    assert best.induction == pytest.approx(1) and best.induction_low == pytest.approx(1)
    assert (best.induction_null == pytest.approx(1)) is not repeats_only  # nulls: the same place
    heads = Taxonomy.heads(tables, Thresholds()).set_index(["layer", "head"])
    held = {role: heads.index[heads[str(role)]].tolist()
            for role in (Role.PREVIOUS_TOKEN, Role.DUPLICATE_TOKEN, Role.INDUCTION)}  # fmt: skip
    expected = {Role.DUPLICATE_TOKEN: [(1, 3)], Role.INDUCTION: [(1, 2)]} if repeats_only else {}
    # the previous-token head attends by position, as it should: it holds its role either way
    nothing = {Role.DUPLICATE_TOKEN: [], Role.INDUCTION: []}
    assert held == {Role.PREVIOUS_TOKEN: [(0, 0)]} | nothing | expected
    # Every head type's null is one a head can beat: the head doing exactly that type's job
    # (by content where the type is about content) lies far above it, none at its null.
    for score, head in zip(SCORES, [(0, 0), (1, 3), (1, 2)], strict=True):
        row = table.loc[head]
        assert row[score] == pytest.approx(1)
        assert bool(row[f"{score}_low"] - row[f"{score}_null"] > 0.5) is (
            repeats_only or score == "previous_token"
        )


@pytest.mark.slow
def test_the_command_writes_the_table_the_roles_and_the_cards(minilm, tmp_path):
    """``probe analyze -a taxonomy`` on MiniLM: one row per head with every column filled (the
    copying score from its tied masked-LM-less embedding: W_Eᵀ, and said so), the repeats and
    the sentences both counted in run.json, the section and a card per head on the page."""
    out = tmp_path / "r"
    args = ["analyze", "-m", "minilm", "-t", "sample", "-n", "20", "-a", "taxonomy",
            "--repeat-sequences", "30", "--repeat-length", "10", "-o", str(out), "-q"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    table = pd.read_csv(out / "taxonomy.csv", keep_default_na=False)
    assert len(table) == 72 and (table.sequences == 30).all()
    assert table.copying.between(-1, 1).all() and set(table.unembedding) == {
        "input_embedding_transposed"
    }
    assert table.sink_alpha.between(0, 1).all() and (table.sink_queries > 0).all()
    run = json.loads((out / "run.json").read_text())
    assert run["inputs"]["repeats"]["sequences"] == 30
    assert run["inputs"]["sentence"]["analysed"] == 20
    own = {k: v for k, v in run["options"].items() if not k.startswith("qk_")}  # qk follows
    assert own == {"repeat_sequences": 30, "repeat_length": 10} and "qk" in run["analyses"]
    html = (out / "index.html").read_text()
    assert 'id="taxonomy"' in html and html.count("<dt>repeated sequence</dt>") == 72
    heads = pd.read_csv(out / "heads.csv", keep_default_na=False)
    assert {"induction_score", "copying_score", "sink_alpha"} <= set(heads.columns)


@pytest.mark.slow
def test_probe_finds_the_known_heads_of_a_trained_model(tmp_path):
    """``probe analyze -a taxonomy`` on the tiny GPT-2 trained on repeated sequences
    (tests/support/make_induction_model.py): its induction head is found, holds the role, and lies
    far above its null; its previous-token head scores highest on that score."""
    from induction import INDUCTION, MODEL, PREVIOUS_TOKEN

    out = tmp_path / "r"
    args = ["analyze", "-m", str(MODEL), "-t", "sample", "-n", "20", "-a", "taxonomy",
            "--repeat-sequences", "60", "--repeat-length", "20", "-o", str(out), "-q"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    table = pd.read_csv(out / "taxonomy.csv").set_index(["layer", "head"])
    assert table.induction.idxmax() == INDUCTION and table.previous_token.idxmax() == PREVIOUS_TOKEN
    best = table.loc[INDUCTION]
    assert best.induction_low > best.induction_null + 0.2
    heads = pd.read_csv(out / "heads.csv", keep_default_na=False).set_index(["layer", "head"])
    assert str(Role.INDUCTION) in heads.loc[INDUCTION, "roles"]
    holding = heads.index[heads.roles.str.contains(str(Role.PREVIOUS_TOKEN))].tolist()
    assert holding == [PREVIOUS_TOKEN]  # from the repeats alone
    # The 64-symbol vocabulary reads none of the sample's English: one warning line says so,
    # run.json records the share, and sink α (read on the sentences) is not measured.
    run = json.loads((out / "run.json").read_text())
    assert run["unknown_words"]["treebank"]["share"] == 1.0
    assert run["reads"] == {"taxonomy": ["repeats"], "qk": []} and "sentence" not in run["inputs"]
    warned = [line for line in result.output.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and "100% of the treebank's words" in warned[0]
    assert table.sink_alpha.isna().all()


def set_decoder_induction(n: int):
    """A hook on the decoder's second layer: head 1 attends from each second-copy token to the
    one after its earlier copy, on repeats only; the decoder reads the sequence one position
    right (after its start token), so the positions are those of the source plus one."""

    def hook(p, name):
        out = p.clone()
        rows = torch.arange(0, len(p), 2)[:, None]
        queries = torch.arange(n + 2, 2 * n + 2)
        out[rows, 1, queries] = 0
        out[rows, 1, queries, queries - n + 1] = 1
        return out

    return hook


@pytest.mark.parametrize("kind", ["bart", "t5"])
@pytest.mark.slow
def test_an_encoder_decoder_model_has_both_self_attentions_scored(bert_tokenizer, kind):
    """On an encoder-decoder model (a decoder of other heads than its encoder, for BART) the
    table holds every head of the encoder's and the decoder's self-attention, each with its
    copying score; a decoder induction head set by hand is found there and only there, and
    heads.csv keeps the encoder's heads."""
    from models import SEQ2SEQ

    from probe.weights.copying import copying_scores

    config = SEQ2SEQ[kind]()
    config.vocab_size = len(bert_tokenizer)
    if kind == "bart":
        config.decoder_attention_heads = 2
    torch.manual_seed(0)
    model = tf.AutoModel.from_config(config).eval()
    options = {"repeat_sequences": 24, "repeat_length": 6}
    analysis = Taxonomy(context(2, 4, model=model, options=options, tokenizer=bert_tokenizer))
    assert analysis.attention == ("encoder.attn", "decoder.attn")
    unit = RepeatedSequences(Source(seed=0), bert_tokenizer, 128, options=options)
    batches = (setattr(b, "unit", "repeats") or b for b in unit.batches(8))
    with probe.hooks(model, {"decoder.1.attn.hook_pattern": set_decoder_induction(6)}):
        stream(model, batches, [analysis])
    tables = analysis._tables()
    table = tables["taxonomy"]
    heads = 2 if kind == "bart" else 4
    assert table.groupby("attention", sort=False).size().to_dict() == {
        "encoder.attn": 8, "decoder.attn": 2 * heads,
    }  # fmt: skip
    found = table.set_index(["attention", "layer", "head"])
    assert found.induction.idxmax() == ("decoder.attn", 1, 1)
    assert found.loc[("decoder.attn", 1, 1), "induction_low"] == pytest.approx(1)
    assert found.loc[("decoder.attn", 1, 1), "induction_null"] < 0.5
    expected = copying_scores(model).astype({"attention": str})
    expected = expected.set_index(["attention", "layer", "head"]).copying
    np.testing.assert_allclose(found.copying, expected.loc[found.index], rtol=1e-6)
    roles = Taxonomy.heads(tables, Thresholds())
    assert len(roles) == 8 and not roles[str(Role.INDUCTION)].any()  # the encoder's heads
    # The entry point, on the decoder's heads the hook left alone, equals the analysis.
    ours = probe.head_types(model, torch.tensor([unit.pair(i)[0] for i in range(24)]), 6,
                            attention="decoder.attn").set_index(["layer", "head"])  # fmt: skip
    untouched = found.loc["decoder.attn"].drop((1, 1))
    np.testing.assert_allclose(ours.induction.drop((1, 1)), untouched.induction, rtol=1e-5,
                               atol=1e-7)  # fmt: skip


def test_any_count_of_sequences_streams(bert_tokenizer):
    """``--repeat-sequences 10**12``: the first batches come at once and memory holds a batch,
    not the count (sequences are generated from their index as they are read)."""
    import tracemalloc
    from itertools import islice

    unit = RepeatedSequences(Source(seed=0), bert_tokenizer, 512,
                             options={"repeat_sequences": 10**12, "repeat_length": 5})  # fmt: skip
    tracemalloc.start()
    try:
        batches = list(islice(unit.batches(8), 3))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [b.index.tolist() for b in batches][2] == list(range(16, 24))
    assert peak < 10 * 2**20, peak  # a list of the indices alone would take terabytes
