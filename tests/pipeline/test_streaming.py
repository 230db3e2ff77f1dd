"""Memory does not grow with depth or with the corpus: the runner holds one layer at a time, the
corpus is read lazily, and every analysis keeps a state of fixed size."""

import gc
import itertools
import weakref

import pandas as pd
import pytest
import torch
import transformers as tf
from streams import context, feed
from tokenizers_util import wordpiece

from analyses.probing import AttentionProbe
from probe.inputs.corpus import Corpus
from probe.inputs.treebank import Sentence
from probe.pipeline.runner import stream

WORDS = [
    "the",
    "old",
    "dogs",
    "were",
    "barking",
    "at",
    "the",
    "strangers",
    "in",
    "the",
    "dark",
    "street",
]


def chain(n: int) -> Sentence:
    """A sentence of ``n`` words, each the dependent of the next (the last is the root)."""
    words = list(itertools.islice(itertools.cycle(WORDS), n))
    heads = [*range(1, n), -1]
    return Sentence(words, heads, ["dep"] * (n - 1) + ["root"], ["X"] * n)


def small_bert(layers: int):
    config = tf.BertConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=layers,
                           intermediate_size=64, vocab_size=200)  # fmt: skip
    return tf.BertModel(config).eval()


class Watcher:
    """Checks, at every layer, that no capture of an earlier layer is still alive."""

    def __init__(self):
        self.alive, self.layers = [], 0

    def begin_batch(self, batch):
        self.earlier = []

    def update(self, batch, layer, capture):
        gc.collect()
        self.alive.append(sum(ref() is not None for ref in self.earlier))
        self.earlier += [weakref.ref(capture["hook_pattern"]), weakref.ref(capture.words)]
        self.layers += 1

    def end_batch(self, batch):
        pass


@pytest.mark.slow
def test_the_runner_holds_one_layer_at_a_time():
    watcher = Watcher()
    corpus = Corpus([chain(9), chain(5), chain(12)], wordpiece(), max_length=64)
    stream(small_bert(6), corpus.batches(batch_size=2), [watcher])
    assert watcher.layers == 2 * 6  # two batches of six layers
    assert watcher.alive == [0] * 12


def test_the_forward_pass_stops_after_the_last_capture():
    """Nothing after the last layer's pattern reaches a consumer: the last block's MLP and the
    pooler do not run, while every layer's pattern equals the full forward pass's."""
    model = small_bert(3)
    model.set_attn_implementation("eager")  # the reference: attentions returned by the model
    corpus = Corpus([chain(9), chain(5), chain(12)], wordpiece(), max_length=64)
    batches = list(corpus.batches(batch_size=2))
    ran = []
    hooks = [module.register_forward_hook(lambda *_, name=name: ran.append(name))
             for name, module in model.named_modules()
             if name in ("encoder.layer.1.output", "encoder.layer.2.output", "pooler")]  # fmt: skip
    seen = {}

    class Keeper(Watcher):
        def update(self, batch, layer, capture):
            seen[len(self.alive), layer] = capture["hook_pattern"].clone()
            self.alive.append(0)

    stream(model, batches, [Keeper()])
    for hook in hooks:
        hook.remove()
    assert ran == ["encoder.layer.1.output"] * len(batches)  # never the last block's or pooler
    with torch.inference_mode():
        for i, batch in enumerate(batches):
            full = model(**batch.inputs, output_attentions=True).attentions
            for layer in range(3):
                torch.testing.assert_close(seen[3 * i + layer, layer], full[layer])


def test_the_corpus_is_read_lazily():
    endless = (chain(4 + i % 7) for i in itertools.count())
    corpus = Corpus(endless, wordpiece(), max_length=64, chunk_size=16)
    first = next(corpus.batches(batch_size=4))
    assert len(first) == 4 and corpus.read == 16  # one chunk read, not the endless stream
    capped = Corpus((chain(5) for _ in itertools.count()), wordpiece(), 64, max_sentences=10)
    assert sum(len(b) for b in capped.batches(batch_size=3)) == 10 and capped.read == 10


@pytest.mark.slow
def test_probe_features_stay_within_their_budgets():
    n_heads, n_layers = 4, 3
    pair_bytes = 2 * n_layers * n_heads * 4
    probe = AttentionProbe(
        context(n_layers, n_heads), train_bytes=200 * pair_bytes, eval_bytes=300 * pair_bytes
    )
    corpus = Corpus([chain(6 + i % 9) for i in range(120)], wordpiece(), max_length=64)
    g = torch.Generator().manual_seed(0)
    for batch in corpus.batches(batch_size=8):
        T = batch.input_ids.shape[1]
        patterns = torch.softmax(torch.randn(len(batch), n_layers, n_heads, T, T, generator=g), -1)
        feed(probe, batch, patterns)
        assert probe.X.nbytes == 200 * pair_bytes  # allocated once, never grown
        held = sum(e.features.nbytes for e in probe.held.values())
        assert held <= 300 * pair_bytes
    assert probe.filled == 200 and probe.seen > 200  # the sample is full and was offered more
    table = probe.finish()["probe"].set_index("parser")
    assert table.loc["attention_probe", "train_pairs"] == 200
    assert table.loc["attention_probe", "words"] > 0


@pytest.mark.slow
def test_a_probe_that_hands_its_fit_off_finishes_as_one_that_does_not():
    """``hand_off`` starts the fit (in the helper process when there is one) before the run
    finishes the other analyses; the table is the one ``finish`` alone gives. A probe with
    nothing to evaluate hands nothing off."""
    probes = [AttentionProbe(context(2, 3)) for _ in range(3)]
    corpus = Corpus([chain(4 + i % 7) for i in range(60)], wordpiece(), max_length=64)
    g = torch.Generator().manual_seed(0)
    for batch in corpus.batches(batch_size=8):
        T = batch.input_ids.shape[1]
        patterns = torch.softmax(torch.randn(len(batch), 2, 3, T, T, generator=g), -1)
        for probe in probes[:2]:
            feed(probe, batch, patterns)
    handed, alone, empty = probes
    assert handed.hand_off() and not empty.hand_off()
    pd.testing.assert_frame_equal(handed.finish()["probe"], alone.finish()["probe"])
    assert empty.finish()["probe"].words.item() == 0


def test_probe_says_why_it_could_not_evaluate():
    """Held-out sentences too long for the evaluation budget are counted, not silently lost."""
    probe = AttentionProbe(context(1, 4), eval_bytes=10 * 2 * 4 * 4)  # 10 pairs: 3 words at most
    corpus = Corpus([chain(6 + i % 5) for i in range(40)], wordpiece(), max_length=64)
    g = torch.Generator().manual_seed(0)
    for batch in corpus.batches(batch_size=8):
        T = batch.input_ids.shape[1]
        feed(probe, batch, torch.softmax(torch.randn(len(batch), 1, 4, T, T, generator=g), -1))
    (row,) = probe.finish()["probe"].to_dict("records")
    assert row["parser"] == "attention_probe" and row["words"] == 0
    assert row["held_out_too_long"] > 0 and row["train_pairs"] > 0
