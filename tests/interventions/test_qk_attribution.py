"""QK attribution (#64): every attention score split into query-side x key-side sources, exactly,
on every architecture it splits; the induction circuit found in its terms; a decoy and a patch
that move it as the split says; bad input refused in one line."""

import copy

import numpy as np
import pytest
import torch
from induction import INDUCTION, MODEL, PREVIOUS_TOKEN, repeated
from models import CONFIGS, ENCODERS, padded_batch, seq2seq_batch, small_model

import probe
from probe.capture.names import hook_name
from probe.interventions.guard import HOOK_DICTS
from probe.interventions.qk import SPLITS

SCORE = ["input", "layer", "head", "query_pos", "key_pos"]
# The architectures split, as tests/models.py builds them (ELECTRA's small config projects its
# embeddings, which is refused: see test_refused).
KINDS = [*sorted(k for k in SPLITS if k in CONFIGS and k != "electra"), "t5"]


def summed(terms):
    """Each score's terms summed, beside attrs["scores"]."""
    sums = terms.groupby(SCORE, observed=True).contribution.sum().rename("terms").reset_index()
    return terms.attrs["scores"].merge(sums, on=SCORE, validate="one_to_one")


@pytest.mark.parametrize("kind", KINDS)
def test_terms_sum_to_the_captured_score(kind):
    """Every query and every key it may see, of a padded batch, padding included: the terms sum
    to the score (before mask and cap) to 1e-4 of its magnitude, and where nothing is masked to
    what hook_attn_scores captured (Gemma 2: before its soft cap)."""
    model = small_model(kind)
    cap = getattr(model.config, "attn_logit_softcapping", None)
    if cap:  # queries large enough for the scores to reach the cap, where it bends them
        with torch.no_grad():
            for layer in model.layers:
                layer.self_attn.q_proj.weight.mul_(40)
    batch = seq2seq_batch() if kind == "t5" else padded_batch(kind)
    T = batch["input_ids"].shape[1]
    causal = kind not in ENCODERS and kind != "t5"
    keys = {q: list(range(q + 1 if causal else T)) for q in range(T)}
    terms = probe.qk_attribution(model, batch, key_positions=keys)
    table = summed(terms)
    assert len(table) == 3 * sum(len(k) for k in keys.values()) * 2 * 4  # inputs, pairs, heads
    scale = table.score.abs().max()
    assert (table.terms - table.score).abs().max() < 1e-4 * scale
    seen = table[table.captured > -1e30]  # not masked
    assert len(seen) > len(table) // 3  # Mistral: windows of 4 tokens
    captured = seen.captured.to_numpy(np.float64)
    if cap:
        assert np.abs(captured).max() > 0.8 * cap  # bent by the cap: a real test of it
        # The cap undone where float32's tanh can be inverted to 1e-4
        seen, captured = seen[np.abs(captured) < 0.9 * cap], captured[np.abs(captured) < 0.9 * cap]
        captured = cap * np.arctanh(captured / cap)
    assert np.abs(seen.terms.to_numpy() - captured).max() < 1e-4 * np.abs(captured).max()
    sources = set(terms.query_source.cat.categories)
    assert {"embed", "0-0", "0-3", "mlp0"} <= sources
    assert ("pos_bias" in sources) == (kind == "t5")


def test_default_is_each_querys_most_attended_key():
    model = small_model("gpt2")
    batch = padded_batch("gpt2")
    terms = probe.qk_attribution(model, batch, heads=[(1, 2)], top=3)
    with probe.trace(model, [hook_name("hook_pattern", 1)]) as cache:
        model(**batch)
    pattern = cache[hook_name("hook_pattern", 1)][:, 2]
    scores = terms.attrs["scores"]
    assert len(scores) == int(batch["attention_mask"].sum())  # each unpadded query once
    best = pattern[scores.input.to_numpy().copy(), scores.query_pos.to_numpy().copy()].argmax(-1)
    assert (best.numpy() == scores.key_pos.to_numpy()).all()
    # top=3: three terms and the rest per score, still summing to it
    assert terms.groupby(SCORE).size().eq(4).all()
    table = summed(terms)
    assert (table.terms - table.score).abs().max() < 1e-4 * table.score.abs().max()


@pytest.mark.parametrize("max_bytes", [16_000, 40_000])
def test_chunks_give_the_same_terms(max_bytes):
    """Budgets that hold one head's projections and a few pairs at a time (the smallest is
    15,696 bytes here) give the table of one that holds them all."""
    model = small_model("llama")
    batch = padded_batch("llama")
    heads = [(1, 0), (1, 3)]
    whole = probe.qk_attribution(model, batch, heads=heads, top=5)
    chunked = probe.qk_attribution(model, batch, heads=heads, top=5, max_bytes=max_bytes)
    assert chunked.attrs["max_bytes"] == max_bytes < whole.attrs["max_bytes"]
    assert (chunked.query_source == whole.query_source).all()
    np.testing.assert_allclose(
        chunked.contribution.to_numpy(), whole.contribution.to_numpy(), rtol=1e-5, atol=1e-6
    )


def test_means_over_inputs():
    model = small_model("gpt2")
    ids = torch.randint(3, 99, (5, 6), generator=torch.Generator().manual_seed(0))
    terms = probe.qk_attribution(model, ids, heads=[(1, 1)], key_positions={5: [0, 4]})
    means = probe.qk_means(terms, side="key")
    by_hand = (
        terms.groupby(["input", "key_source"], observed=True).contribution.sum() / 2
    ).groupby("key_source", observed=True)
    row = means.iloc[0]
    assert row.inputs == 5 and row.low < row["mean"] < row.high
    assert row["mean"] == pytest.approx(by_hand.mean()[row.key_source], rel=1e-6)
    assert means["mean"].sum() == pytest.approx(terms.contribution.sum() / 10, rel=1e-5)


def hooks_of(model):
    return [{n: set(getattr(m, n, {})) for n in HOOK_DICTS} for m in model.modules()]


@pytest.mark.parametrize(
    ("call", "error", "says"),
    [
        ({"heads": [(2, 0)]}, ValueError, "heads: (2, 0) does not exist"),
        ({"heads": [(0, 4)]}, ValueError, "heads: (0, 4) does not exist"),
        ({"query_positions": [7]}, ValueError, "query_positions: position 7 is out of range"),
        ({"key_positions": {6: 9}}, ValueError, "key_positions: position 9 is out of range"),
        ({"key_positions": {2: 5}}, ValueError, "key 5 is after query 2"),
        ({"query_positions": 1, "key_positions": 3}, ValueError, "key 3 is after query 1"),
        ({"top": 0}, ValueError, "top must be"),
        ({"max_bytes": 1000}, probe.ProbeError, "max_bytes=1,000 is too small"),
    ],
)
def test_bad_input_one_line(call, error, says):
    model = small_model("gpt2")
    before = hooks_of(model)
    with pytest.raises(error) as raised:
        probe.qk_attribution(model, padded_batch("gpt2"), **call)
    assert says in str(raised.value) and "\n" not in str(raised.value)
    assert hooks_of(model) == before  # the model as it was, after the error too
    assert model.config._attn_implementation != "probe"


@pytest.mark.parametrize(
    ("kind", "says"),
    [("phi3", "fused [Q | K | V]"), ("qwen3", "query and key norms"), ("electra", "electra")],
)
def test_refused(kind, says):
    model = small_model(kind)
    with pytest.raises(probe.ProbeError, match="qk_attribution") as raised:
        probe.qk_attribution(model, padded_batch(kind))
    assert says in str(raised.value)


def test_one_input_and_one_head():
    model = small_model("gpt2")
    ids = torch.randint(3, 99, (6,), generator=torch.Generator().manual_seed(1))
    terms = probe.qk_attribution(model, ids, heads=(1, 2), query_positions=[5])
    assert set(terms["input"]) == {0} and set(terms["head"]) == {2}
    assert set(terms["query_pos"]) == {5}
    with pytest.raises(ValueError, match="decoder_input_ids"):
        probe.qk_attribution(small_model("t5"), ids[None])


def test_a_model_probe_cannot_trace():
    with pytest.raises(probe.ProbeError):
        probe.qk_attribution(torch.nn.Linear(2, 2), torch.zeros(1, 2, dtype=torch.long))


def test_the_table_must_fit():
    with pytest.raises(probe.ProbeError, match="pass top=10"):
        probe.qk_attribution(small_model("bert"), padded_batch("bert"), max_bytes=100_000)


# The induction model: layer 0's previous-token head writes the key of every layer-1 head.
N = 20
INDUCTION_PAIRS = {i: i - N + 1 for i in range(N + 1, 2 * N + 1)}  # the token after the first copy


@pytest.fixture(scope="module")
def induction():
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(MODEL, dtype=torch.float32).eval()


def key_side(terms, source):
    """Each score's terms with ``source`` on the key side, ``[input, query]``."""
    part = terms[terms.key_source == source].groupby(["input", "query_pos"]).contribution.sum()
    return torch.tensor(part.unstack().to_numpy())


@pytest.mark.slow
def test_induction_keys_come_from_the_previous_token_head(induction):
    ids = repeated(32, N, seed=3)
    previous = str(probe.HeadId(*PREVIOUS_TOKEN))
    for layer, head in [(1, h) for h in range(4)]:
        terms = probe.qk_attribution(
            induction, ids, heads=[(layer, head)], key_positions=INDUCTION_PAIRS
        )
        scores = terms.attrs["scores"]
        share = (scores.key_top == previous).mean()
        queries = scores.query_top.value_counts(normalize=True)
        print(f"{layer}-{head}: key side {previous} at {share:.1%}; query side {queries.to_dict()}")
        assert share >= 0.9
        if (layer, head) == INDUCTION:  # the query side, as found (printed with -s)
            print(probe.qk_means(terms, side="query").head(5).to_string())


@pytest.mark.slow
def test_a_decoy_moves_it(induction):
    """The previous-token head's W_O zeroed: its key-side term is 0, and with the layer-0 MLP and
    layer 1's norm frozen at the clean run's (so that only the head's direct write changes) the
    induction head's score falls by exactly what the split gave that head on both sides."""
    ids = repeated(8, N, seed=4)
    heads = [INDUCTION]
    previous = str(probe.HeadId(*PREVIOUS_TOKEN))
    clean = probe.qk_attribution(induction, ids, heads=heads, key_positions=INDUCTION_PAIRS)
    decoy = copy.deepcopy(induction)
    d_head = 16
    with torch.no_grad():
        rows = slice(PREVIOUS_TOKEN[1] * d_head, (PREVIOUS_TOKEN[1] + 1) * d_head)
        decoy.transformer.h[0].attn.c_proj.weight[rows] = 0  # Conv1D: W_O's rows of the head
    moved = probe.qk_attribution(decoy, ids, heads=heads, key_positions=INDUCTION_PAIRS)
    assert key_side(moved, previous).abs().max() == 0

    mlp, scale = hook_name("hook_mlp_out", 0), hook_name(f"ln1.{'hook_scale'}", 1)
    scores = hook_name("hook_attn_scores", 1)
    with probe.trace(induction, [mlp, scale, scores]) as frozen:
        induction(ids)
    fixed = {mlp: lambda x, hook: frozen[mlp], scale: lambda x, hook: frozen[scale]}
    with probe.hooks(decoy, fixed), probe.trace(decoy, [scores]) as after:
        decoy(ids)
    q = torch.tensor(list(INDUCTION_PAIRS))
    before = frozen[scores][:, INDUCTION[1], q, q - N + 1]
    drop = before - after[scores][:, INDUCTION[1], q, q - N + 1]
    on_both = clean[(clean.key_source == previous) | (clean.query_source == previous)]
    direct = torch.tensor(
        on_both.groupby(["input", "query_pos"]).contribution.sum().unstack().to_numpy()
    )
    error = (drop - direct).abs().max() / before.abs().max()
    print(f"decoy, frozen: the score's fall minus the head's terms, {error:.1e} of the largest")
    assert error < 1e-4
    # Unfrozen, the MLP and the norm take part of the loss back: the score still falls.
    with probe.trace(decoy, [scores]) as free:
        decoy(ids)
    fall = (frozen[scores] - free[scores])[:, INDUCTION[1], q, q - N + 1]
    term = key_side(clean, previous)
    print(f"key-side term {term.mean():.3f}; the score falls {fall.mean():.3f} unfrozen")
    assert (fall > 0).float().mean() >= 0.9


@pytest.mark.slow
def test_agrees_with_patching_the_key(induction):
    """One source patched out of the key's input only (its contribution through the frozen norm
    subtracted from the keys, the model's attention computing the rest) changes the score by
    the split's key-side term of that source."""
    ids = repeated(8, N, seed=5)
    layer, head = INDUCTION
    terms = probe.qk_attribution(induction, ids, heads=[INDUCTION], key_positions=INDUCTION_PAIRS)
    result, scale = hook_name("hook_result", 0), hook_name(f"ln1.{'hook_scale'}", layer)
    scores = hook_name("hook_attn_scores", layer)
    with probe.trace(induction, [result, scale, scores]) as clean:
        induction(ids)
    block = induction.transformer.h[layer]
    for source, h in [(str(probe.HeadId(*PREVIOUS_TOKEN)), PREVIOUS_TOKEN[1]), ("0-1", 1)]:
        x = clean[result][:, :, h]  # the head's write to the stream
        normed = (x - x.mean(-1, keepdim=True)) / clean[scale] * block.ln_1.weight
        d_model = x.shape[-1]
        W_K = block.attn.c_attn.weight[:, d_model : 2 * d_model]  # Conv1D: [in, Q | K | V]
        delta = (normed @ W_K).unflatten(-1, (4, -1))

        def patched(k, hook, delta=delta):
            return k - delta

        edit = {hook_name("hook_k", layer): patched}
        with probe.hooks(induction, edit), probe.trace(induction, [scores]) as after:
            induction(ids)
        q = torch.tensor(list(INDUCTION_PAIRS))
        before = clean[scores][:, head, q, q - N + 1]
        change = before - after[scores][:, head, q, q - N + 1]
        term = key_side(terms, source)
        error = (change - term).abs().max() / before.abs().max()
        print(f"{source} patched out of the keys: change minus term {error:.1e} of the largest")
        assert error < 1e-4


@pytest.mark.parametrize("Sq, Sk, extra, k", [(50, 40, 0, 10), (50, 40, 1, 10), (5, 40, 0, 10),
                                              (3, 3, 1, 10), (200, 160, 0, 11)])  # fmt: skip
def test_the_largest_terms_are_topks(Sq, Sk, extra, k):
    """The largest terms found among the rows whose largest term is largest are those of
    ``topk`` over every term: the same magnitudes, at indices that hold them."""
    from probe.interventions.qk_table import largest_terms

    flat = torch.randn(37, Sq * Sk + extra, generator=torch.Generator().manual_seed(Sq + extra),
                       dtype=torch.float64).abs()  # fmt: skip
    found, expected = largest_terms(flat, Sq, Sk, k), flat.topk(min(k, flat.shape[1]), 1)
    assert torch.equal(found.values, expected.values)
    assert torch.equal(flat.gather(1, found.indices), expected.values)


@pytest.mark.parametrize("prune", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_top_keeps_the_largest_terms_of_the_whole_table(kind, prune, monkeypatch):
    """``top=3`` finds each score's largest terms, without forming the others (pruned by the
    norm bound, ``PRUNE_FROM`` lowered to 0 for these small models) or among every term: the
    same sources and values as the three largest of the whole table, the rest in one row
    (where a score has more than three), each score's rows summing to it; ``top10_share``
    alike."""
    from probe.interventions import qk_table

    monkeypatch.setattr(qk_table, "PRUNE_FROM", 0 if prune else 10**9)
    model = small_model(kind)
    batch = seq2seq_batch() if kind == "t5" else padded_batch(kind)
    whole = probe.qk_attribution(model, batch)
    top = probe.qk_attribution(model, batch, top=3)
    table = summed(top)
    scores = whole.attrs["scores"].merge(top.attrs["scores"], on=SCORE, suffixes=("", "_top"))
    whole.attrs, top.attrs = {}, {}  # pandas compares DataFrames' attrs when it merges them
    key = [*SCORE, "query_source", "key_source"]
    largest = (whole.assign(size=whole.contribution.abs())
               .sort_values([*SCORE, "size"], ascending=[True] * 5 + [False], kind="stable")
               .groupby(SCORE, observed=True).head(3))  # fmt: skip
    kept = top[top.query_source != "rest"]
    assert len(kept) == len(largest) and top.groupby(SCORE, observed=True).size().max() == 4
    both = largest.merge(kept, on=key, suffixes=("", "_top"), validate="one_to_one")
    assert len(both) == len(largest)  # the same terms (no ties among float products here)
    scale = whole.contribution.abs().max()
    assert (both.contribution - both.contribution_top).abs().max() < 1e-5 * scale
    assert (table.terms - table.score).abs().max() < 1e-4 * table.score.abs().max()
    np.testing.assert_allclose(scores.top10_share_top, scores.top10_share, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("Sq", "Sk", "bias", "top"),
                         [(50, 40, False, 10), (50, 40, True, 10), (3, 3, True, 10),
                          (85, 85, False, 10), (1, 7, False, 10), (60, 1, False, 30),
                          (85, 85, True, 60)])  # fmt: skip
def test_pruned_largest_is_topk_of_every_term(Sq, Sk, bias, top):
    """On parts of widely spread norms (a few large sources, many small, as a residual stream's),
    and of equal norms (nothing to prune): the n largest terms, signed, and their indices, as
    ``topk`` over every term finds them; also where n is more than the sample holds."""
    from probe.interventions.qk_table import pruned_largest

    g = torch.Generator().manual_seed(Sq + Sk + bias)
    for spread in (3.0, 0.0):
        q = torch.randn(23, Sq, 8, generator=g, dtype=torch.float64)
        k = torch.randn(23, Sk, 8, generator=g, dtype=torch.float64)
        q = q * torch.exp(spread * torch.randn(23, Sq, 1, generator=g, dtype=torch.float64))
        k = k * torch.exp(spread * torch.randn(23, Sk, 1, generator=g, dtype=torch.float64))
        extra = torch.randn(23, generator=g, dtype=torch.float64) if bias else None
        flat = torch.bmm(q, k.transpose(1, 2)).flatten(1)
        if bias:
            flat = torch.cat([flat, extra[:, None]], 1)
        n = min(top, flat.shape[1])
        expected = flat.abs().topk(n, 1)
        values, index = pruned_largest(q, k, n, extra)
        torch.testing.assert_close(values.abs(), expected.values, rtol=1e-12, atol=0)
        torch.testing.assert_close(flat.gather(1, index), values, rtol=1e-12, atol=0)


def test_reserved_memory_is_reused_across_layers_and_exact_off_the_cpu():
    """The parts' buffer: a layer's request is a view of the reservation where it fits (so its
    pages are not mapped afresh), a larger one replaces it; on another device (meta here) a
    request takes exactly its size, the device's allocator doing the rest."""
    from probe.interventions.qk_sources import Reserved

    cpu = torch.device("cpu")
    reserved = Reserved()
    first = reserved.empty("q", (2, 3), torch.float32, cpu, bound=100, limit=50)
    assert reserved.buffers["q"].numel() == 50 and first.shape == (2, 3)
    second = reserved.empty("q", (5, 10), torch.float32, cpu, bound=100, limit=50)
    assert second.data_ptr() == first.data_ptr() and second.shape == (5, 10)
    keys = reserved.empty("k", (4,), torch.float32, cpu, bound=10, limit=50)
    assert keys.data_ptr() != second.data_ptr()  # a buffer a side
    larger = reserved.empty("q", (8, 10), torch.float32, cpu, bound=100, limit=50)
    assert larger.shape == (8, 10) and reserved.buffers["q"].numel() == 80
    wider = reserved.empty("q", (8, 10), torch.float64, cpu, bound=100, limit=50)
    assert wider.dtype == torch.float64
    meta = Reserved().empty("q", (2, 3), torch.float32, torch.device("meta"), bound=100, limit=50)
    assert meta.shape == (2, 3) and meta.untyped_storage().nbytes() == 6 * 4
