"""Head roles and statistics on patterns set by hand through probe.hooks."""

import math

import numpy as np
import pytest
import torch
import transformers as tf
from by_hand import set_patterns
from scipy.spatial.distance import jensenshannon
from streams import context, feed
from tokenizers_util import wordpiece

import probe
from analyses.roles import Roles
from analyses.vocabulary import Thresholds
from probe.app.publish import join_heads
from probe.inputs.corpus import Corpus
from probe.inputs.treebank import Sentence
from probe.pipeline.runner import stream

WORDS = [
    ["the", "cat", "sat", "on", "the", "mat", "."],
    ["the", "dogs", "were", "barking", "at", "strangers", "yesterday", ",", "unbelievably", "."],
    ["she", "gave", "her", "brother", "a", "wonderful", "book", "."],
]


def sentence(words):
    n = len(words)
    return Sentence(words, [-1] + [0] * (n - 1), ["root"] + ["dep"] * (n - 1),
                    ["PUNCT" if w in ".," else "X" for w in words])  # fmt: skip


@pytest.fixture(scope="module")
def analysed():
    torch.manual_seed(0)
    config = tf.BertConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                           intermediate_size=64, vocab_size=200)  # fmt: skip
    model = tf.BertModel(config).eval()
    tokenizer = wordpiece()
    corpus = Corpus([sentence(w) for w in WORDS], tokenizer, max_length=64)
    lengths = np.array([len(tokenizer(w, is_split_into_words=True).input_ids) for w in WORDS])
    analysis = Roles(context(2, 4), js_query_share=1.0)
    with probe.hooks(model, {"blocks.0.attn.hook_pattern": set_patterns}):
        stream(model, corpus.batches(batch_size=2), [analysis])
    return analysis.finish(), lengths, corpus


def roles_of(tables, thresholds=Thresholds()):
    heads = join_heads([Roles], tables, thresholds, n_layers=2, n_heads=4)
    return heads.set_index(["layer", "head"]).roles


def test_statistics_by_hand(analysed):
    tables, n, _ = analysed
    stats = tables["head_stats"].set_index(["layer", "head"])
    total = n.sum()
    prev, cls, uniform = stats.loc[(0, 0)], stats.loc[(0, 1)], stats.loc[(0, 2)]
    assert prev.previous == pytest.approx((n - 1).sum() / total)
    assert prev["max_at_-1"] == pytest.approx((n - 1).sum() / total)
    assert prev.self == pytest.approx(len(n) / total) and prev.entropy == pytest.approx(
        0, abs=1e-12
    )
    assert prev.confidence == pytest.approx(1)
    assert cls.special == pytest.approx(1) and cls.cls_entropy == pytest.approx(0, abs=1e-12)
    assert cls.cls_like == pytest.approx(1) and cls.sep_like == pytest.approx(0, abs=1e-12)
    assert uniform.entropy == pytest.approx((n * np.log(n)).sum() / total)
    assert uniform.entropy_normalised == pytest.approx(1)
    assert uniform.special == pytest.approx(2 * len(n) / total)  # [CLS] and [SEP] of n keys
    assert uniform.cls_like == pytest.approx(uniform.sep_like) == pytest.approx(len(n) / total)
    # the previous-token head: [CLS] attends to itself and the first word to [CLS]
    assert prev.cls_like == pytest.approx(2 * len(n) / total) and prev.sep_like == 0
    assert uniform.cls_entropy == pytest.approx(np.log(n).mean())
    # punctuation: "." in every sentence, and "," in the second
    punct_tokens = np.array([1, 2, 1])
    assert uniform.punct == pytest.approx((punct_tokens / n * n).sum() / total)


def test_roles_are_exactly_the_set_ones(analysed):
    tables, n, _ = analysed
    share = (n - 1).sum() / n.sum()  # queries with a previous token
    roles = roles_of(tables, Thresholds(previous_token=share - 1e-9))
    assert roles[(0, 0)] == "previous-token"
    assert roles[(0, 1)] == "sink"
    assert roles[(0, 2)] == "broad"
    # The threshold decides: at 0 every head is broad (a threshold is a share, in [0, 1]).
    assert all("broad" in r for r in roles_of(tables, Thresholds(broad=0.0)))


def test_role_intervals_are_keyed_to_sentences_and_flag_uncertain_roles(analysed):
    """Each role statistic's 95% interval holds its estimate and does not depend on the batch
    size; a role granted at a threshold inside the interval is uncertain, one far below is not."""
    tables, n, corpus = analysed
    stats = tables["head_stats"]
    # The statistics are sums of float32 attention weights (relative rounding ~1e-7): batched
    # anew, they round differently, so bounds are compared at float32's precision, not float64's.
    float32 = 1e-6
    for metric in ("max_at_-1", "max_at_+1", "sink_share", "entropy_normalised"):
        value = stats.special + stats.punct if metric == "sink_share" else stats[metric]
        assert (stats[f"{metric}_low"] <= value + float32).all()
        assert (value <= stats[f"{metric}_high"] + float32).all()
    assert (stats["max_at_-1_high"] > stats["max_at_-1_low"]).any()  # sentences differ
    torch.manual_seed(0)
    config = tf.BertConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                           intermediate_size=64, vocab_size=200)  # fmt: skip
    model = tf.BertModel(config).eval()
    other = Roles(context(2, 4), js_query_share=1.0)
    with probe.hooks(model, {"blocks.0.attn.hook_pattern": set_patterns}):
        stream(model, corpus.batches(batch_size=3), [other])  # the same tokens, batched anew
    again = other.finish()["head_stats"]
    columns = [c for c in stats.columns if c.endswith(("_low", "_high"))]
    np.testing.assert_allclose(again[columns], stats[columns], rtol=float32, atol=float32)
    share = (n - 1).sum() / n.sum()
    heads = join_heads([Roles], tables, Thresholds(previous_token=share - 1e-9), 2, 4)
    heads = heads.set_index(["layer", "head"])
    low = stats.set_index(["layer", "head"])["max_at_-1_low"][(0, 0)]
    assert low < share - 1e-9 and heads.uncertain_roles[(0, 0)] == "previous-token"
    sure = join_heads([Roles], tables, Thresholds(previous_token=low / 2), 2, 4)
    assert sure.set_index(["layer", "head"]).uncertain_roles[(0, 0)] == ""


def test_js_divergence_between_set_heads(analysed):
    tables, n, _ = analysed
    sim = tables["head_similarity"].set_index(["layer_a", "head_a", "layer_b", "head_b"])
    # previous-token and [CLS] heads agree on queries 0 and 1 (both look at [CLS]), else log 2.
    assert sim.js_divergence[(0, 0, 0, 1)] == pytest.approx((n - 2).sum() * math.log(2) / n.sum())
    for h in range(4):
        assert sim.js_divergence[(0, h, 0, h)] == pytest.approx(0, abs=1e-6)


def test_js_divergence_against_scipy():
    torch.manual_seed(1)
    p = torch.softmax(torch.randn(2, 1, 3, 5, 5), -1)  # [batch, layer, head, q, k]
    analysis = Roles(context(1, 3))
    analysis._add_js(p[:, 0].permute(1, 0, 2, 3).reshape(3, 10, 5))  # every query
    expected = np.zeros((3, 3))
    for b in range(2):
        for q in range(5):
            for a in range(3):
                for c in range(3):
                    expected[a, c] += jensenshannon(p[b, 0, a, q], p[b, 0, c, q]) ** 2 / 10
    np.testing.assert_allclose(analysis.js.numpy() / analysis.js_queries, expected, atol=1e-6)


def test_memory_does_not_grow_with_the_corpus(analysed):
    _, _, corpus = analysed
    analysis = Roles(context(2, 4))

    def state_bytes():
        return sum(
            v.numel() * v.element_size()
            for k, v in vars(analysis).items()
            if torch.is_tensor(v) and not k.startswith("_")  # the state, not the batch at hand
        )

    batch = next(corpus.batches(2))
    T = batch.input_ids.shape[1]
    patterns = torch.softmax(
        torch.randn(2, 2, 4, T, T, generator=torch.Generator().manual_seed(0)), -1
    )
    feed(analysis, batch, patterns)
    once = state_bytes()
    for _ in range(20):
        feed(analysis, batch, patterns)
    assert state_bytes() == once


def test_js_divergence_of_a_causal_model_against_scipy():
    """A causal model's sampled queries are measured in groups over the keys they can see: the
    divergences are those of the whole rows."""
    tokenizer = wordpiece()
    batch = next(Corpus([sentence(w) for w in WORDS], tokenizer, max_length=64).batches(3))
    real = batch.attention_mask.bool()
    B, T = real.shape
    torch.manual_seed(2)
    scores = torch.randn(B, 2, 3, T, T).masked_fill(~torch.ones(T, T).tril().bool(), -1e9)
    p = torch.softmax(scores, -1)  # [batch, layer, head, q, k], causal
    analysis = Roles(context(2, 3, causal=True), js_query_share=1.0)
    feed(analysis, batch, p)
    expected = np.zeros((6, 6))
    heads = p.permute(0, 3, 1, 2, 4).reshape(B, T, 6, T)  # [batch, q, layer·head, k]
    for b, q in real.nonzero().tolist():
        for x in range(6):
            for y in range(6):
                expected[x, y] += jensenshannon(heads[b, q, x], heads[b, q, y]) ** 2
    assert analysis.js_queries == int(real.sum()) > 3 * 8  # more queries than groups
    np.testing.assert_allclose(analysis.js.numpy(), expected, atol=1e-5)


def test_a_role_two_analyses_grant_is_held_where_either_grants_it():
    """The roles analysis and the head types both grant previous-token: heads.csv holds it
    where either does, once."""
    import pandas as pd

    from analyses import Analysis
    from analyses.vocabulary import Role

    def granting(name: str, held: list[bool]) -> type[Analysis]:
        def heads(cls, tables, thresholds):
            return pd.DataFrame({"layer": [0, 0, 0], "head": [0, 1, 2],
                                 str(Role.PREVIOUS_TOKEN): held})  # fmt: skip

        return type(name, (Analysis,), {"name": name, "head_columns": {},
                                        "heads": classmethod(heads)})  # fmt: skip

    first, second = granting("a", [True, False, False]), granting("b", [False, True, False])
    heads = join_heads([first, second], {}, Thresholds(), 1, 3)
    assert heads.roles.tolist() == ["previous-token", "previous-token", ""]
    assert list(heads.columns) == ["layer", "head", "roles"]
