"""Word alignment across tokenizer families, and Clark et al.'s word-level attention by hand."""

import numpy as np
import pytest
import torch
from by_hand import WORD_OF_TOKEN, hand_batch
from streams import context, feed
from tokenizers_util import FAMILIES, TEXT

from analyses.syntax import Syntax
from analyses.vocabulary import Direction
from probe.inputs.alignment import head_predictions, word_attention, word_tokenizer
from probe.inputs.corpus import NO_TOKENS, TOO_LONG, Corpus
from probe.inputs.treebank import Sentence


def sentence(words):
    n = len(words)
    return Sentence(words, [-1] + [0] * (n - 1), ["root"] + ["dep"] * (n - 1), ["X"] * n)


WORDS = ["Unbelievably", ",", "the", "dogs", "were", "barking", "at", "strangers", "."]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_word_gets_its_own_tokens(family):
    tokenizer = FAMILIES[family]()
    (batch,) = Corpus([sentence(WORDS)], tokenizer, max_length=100).batches()
    word_of_token = batch.word_of_token[0].tolist()
    pieces = tokenizer.convert_ids_to_tokens(batch.input_ids[0].tolist())
    for w, word in enumerate(WORDS):
        tokens = [p for p, owner in zip(pieces, word_of_token, strict=True) if owner == w]
        assert tokens, f"{word!r} has no token"
        text = "".join(tokens).replace("##", "").replace("Ġ", "").replace("▁", "")
        assert text == word.lower() if family == "wordpiece" else text == word
    special = [p for p, owner in zip(pieces, word_of_token, strict=True) if owner < 0]
    assert (
        special
        == {"wordpiece": ["[CLS]", "[SEP]"], "unigram": ["</s>"], "byte_level_bpe": []}[family]
    )
    assert max(word_of_token) == len(WORDS) - 1


def test_byte_level_words_are_tokenized_as_inside_running_text():
    tokenizer = FAMILIES["byte_level_bpe"]()
    fixed = word_tokenizer(tokenizer)
    assert fixed is not tokenizer
    running = tokenizer.tokenize(" " + " ".join(WORDS[2:6]))
    split = fixed.convert_ids_to_tokens(fixed(WORDS[2:6], is_split_into_words=True)["input_ids"])
    assert split == running and split[0].startswith("Ġ")
    wordpiece = FAMILIES["wordpiece"]()
    assert word_tokenizer(wordpiece) is wordpiece  # nothing to fix: the very same tokenizer


def test_words_without_tokens_and_long_sentences_are_counted():
    tokenizer = FAMILIES["wordpiece"]()
    sentences = [
        sentence(["the", "\u200b", "cat"]),
        sentence(TEXT[0].split()),
        sentence(["a"] * 30),
    ]
    corpus = Corpus(sentences, tokenizer, max_length=20)
    (batch,) = corpus.batches()
    assert corpus.skipped == {NO_TOKENS: 1, TOO_LONG: 1}
    assert (corpus.read, corpus.analysed) == (3, 1) and batch.index.tolist() == [1]


# The hand-worked example: "the cats sleep", with "cats" split into "cat" + "##s".
# Tokens: [CLS] the cat ##s sleep [SEP]; gold heads: the -> cats (det), cats -> sleep (nsubj).
TOKEN_ATTENTION = torch.tensor(
    [  # to: [CLS] the  cat  ##s  sleep [SEP]
        [0.5, 0.1, 0.1, 0.1, 0.1, 0.1],  # [CLS] (dropped)
        [0.1, 0.0, 0.1, 0.1, 0.6, 0.1],  # the
        [0.2, 0.1, 0.1, 0.1, 0.4, 0.1],  # cat
        [0.0, 0.3, 0.2, 0.1, 0.2, 0.2],  # ##s
        [0.1, 0.1, 0.2, 0.4, 0.1, 0.1],  # sleep
        [0.2, 0.2, 0.2, 0.2, 0.1, 0.1],  # [SEP] (dropped)
    ]
)


def test_word_level_attention_by_hand():
    words = word_attention(TOKEN_ATTENTION[None, None], WORD_OF_TOKEN, 3)[0, 0]
    expected = torch.tensor(
        [  # to: the         cats               sleep
            [0.0, 0.1 + 0.1, 0.6],  # the
            [(0.1 + 0.3) / 2, (0.1 + 0.1 + 0.2 + 0.1) / 2, (0.4 + 0.2) / 2],  # cats: mean of rows
            [0.1, 0.2 + 0.4, 0.1],  # sleep
        ]
    )
    torch.testing.assert_close(words, expected)


def test_bootstrap_intervals_are_seeded():
    def best(seed):
        analysis = Syntax(context(1, 1, seed=seed), n_boot=200)
        g = torch.Generator().manual_seed(42)  # the same random attention for both seeds
        for i in range(40):  # 40 sentences, each with its own bootstrap weights
            feed(
                analysis,
                hand_batch(i),
                torch.softmax(3 * torch.randn(1, 1, 1, 6, 6, generator=g), -1),
            )
        return analysis.finish()["syntax_best"].set_index("relation").loc["all"]

    first, again, other = best(0), best(0), best(1)
    assert (first.ci_low, first.ci_high) == (again.ci_low, again.ci_high)
    assert first.ci_low < first.accuracy < first.ci_high
    assert (first.ci_low, first.ci_high) != (other.ci_low, other.ci_high)


def test_every_heads_interval_is_its_own_bootstrap():
    """syntax.csv's interval for each head, recomputed outside the analysis: each sentence's
    correct count weighted by its keyed Poisson(1) draws, the 2.5th and 97.5th percentiles of
    the replicates' accuracies, widened to Wilson's interval where that is wider."""
    from scipy import stats

    from probe.keys import poisson

    n_boot, g = 200, torch.Generator().manual_seed(7)
    analysis = Syntax(context(1, 2, seed=3), n_boot=n_boot)
    correct = []  # per sentence: [direction, head] words of every relation right
    for i in range(30):
        pattern = torch.softmax(3 * torch.randn(1, 1, 2, 6, 6, generator=g), -1)
        feed(analysis, hand_batch(i), pattern)
        words = word_attention(pattern[:, 0], WORD_OF_TOKEN, 3)
        predicted = head_predictions(words, torch.tensor([3]))[0]  # [direction, head, word]
        gold = torch.tensor([1, 2])  # the -> cats, cats -> sleep
        correct.append((predicted[:, :, :2] == gold).sum(-1).numpy())
    correct = np.stack(correct)  # [sentence, direction, head]
    weights = poisson(3, "syntax-bootstrap", np.arange(30)[None], np.arange(n_boot)[:, None])
    replicate = np.einsum("bs,sdh->bdh", weights, correct) / (2 * weights.sum(1))[:, None, None]
    low, high = np.percentile(replicate, [2.5, 97.5], axis=0)
    syntax = analysis.finish()["syntax"].query("relation == 'all'")
    for row in syntax.itertuples():
        d = Direction(row.direction).index
        assert row.correct == correct[:, d, row.head].sum()
        # never narrower than Wilson's interval on the words (SciPy's), which holds at small n
        wilson = stats.binomtest(row.correct, row.total).proportion_ci(0.95, method="wilson")
        low[d, row.head] = min(low[d, row.head], wilson.low)
        high[d, row.head] = max(high[d, row.head], wilson.high)
        assert row.ci_low == pytest.approx(low[d, row.head], abs=1e-6)
        assert row.ci_high == pytest.approx(high[d, row.head], abs=1e-6)
    assert (syntax.ci_high - syntax.ci_low).min() > 0


def test_predictions_and_scores_by_hand():
    words = word_attention(TOKEN_ATTENTION[None, None], WORD_OF_TOKEN, 3)
    predicted = head_predictions(words, torch.tensor([3]))[0, :, 0]
    # dependent -> head: the -> sleep (0.6 > 0.2), cats -> sleep (0.3 > 0.2), sleep -> cats.
    assert predicted[0].tolist() == [2, 2, 1]
    # head -> dependent: who attends most to "the"? cats (0.2 > 0.1); to "cats"? sleep (0.6).
    assert predicted[1].tolist()[:2] == [1, 2]

    analysis = Syntax(context(1, 1), n_boot=10)
    feed(analysis, hand_batch(), TOKEN_ATTENTION[None, None, None])
    tables = analysis.finish()
    syntax = tables["syntax"].set_index(["relation", "direction"])
    assert syntax.loc[("det", "dependent_to_head"), "correct"] == 0
    assert syntax.loc[("det", "head_to_dependent"), "correct"] == 1
    assert syntax.loc[("nsubj", "dependent_to_head"), "correct"] == 1
    assert syntax.loc[("all", "dependent_to_head"), ["correct", "total"]].tolist() == [1, 2]
    assert syntax.loc[("all", "head_to_dependent"), "accuracy"] == 1.0
    assert "root" not in set(tables["syntax"].relation)
    baselines = tables["syntax_baselines"].set_index(["relation", "offset"])
    assert baselines.loc[("det", 1), "correct"] == 1 and baselines.loc[("det", 2), "correct"] == 0
    assert baselines.loc[("all", 1), "accuracy"] == 1.0
    best = tables["syntax_best"].set_index("relation")
    assert best.loc["det", "direction"] == "head_to_dependent"
    assert best.loc["det", "baseline_offset"] == 1
