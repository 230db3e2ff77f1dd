"""Syntax scoring of MiniLM over the EWT dev split against the eager forward pass, and memory.

    python benchmarks/syntax.py [--batch-size 32]

Time: the syntax analysis (capture, word-level attention, counts, bootstrap replicates) over all
batches, against the eager model with output_attentions=True over the same batches.
Memory: peak resident memory while streaming 200 and 2,000 sentences, above what the loaded
model and the encoded corpus hold, after a warm-up pass (see ``held`` and ``trimmed``).
"""

from __future__ import annotations

import argparse
import threading
import time

import torch
from _common import ewt_dev, timed
from transformers import AutoModel

import probe
from analyses import Context
from analyses.syntax import Syntax
from probe.inputs.corpus import Corpus, max_tokens
from probe.inputs.treebank import read_conllu
from probe.pipeline.loading import resolve_name
from probe.pipeline.runner import release_memory, stream


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class PeakMemory:
    """Samples resident memory every few milliseconds while the block runs."""

    def __enter__(self):
        self.start, self.peak, self.running = rss_bytes(), rss_bytes(), True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def growth(self) -> int:
        return self.peak - self.start


def trimmed(batches):
    """Return freed memory to the OS after each batch, so that resident memory shows what is
    held rather than what glibc keeps (the runner trims only at the end: trimming costs page
    faults)."""
    for item in batches:
        yield item
        release_memory()


def held(model, corpus, batch_size: int) -> int:
    """Peak resident memory above the start while the syntax analysis streams ``corpus``."""
    release_memory()
    analysis = Syntax(Context(6, 12))
    with PeakMemory() as memory:
        stream(model, trimmed(corpus.batches(batch_size)), [analysis])
        analysis.finish()
    return memory.growth


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    model, tokenizer = probe.load("minilm")
    eager = AutoModel.from_pretrained(resolve_name("minilm"), attn_implementation="eager").eval()
    limit = max_tokens(model.config, tokenizer)
    corpus = Corpus(read_conllu(ewt_dev()), tokenizer, limit)
    batches = [b.inputs for b in corpus.batches(args.batch_size)]
    print(f"MiniLM, EWT dev: {corpus.analysed} sentences, {len(batches)} batches")

    @torch.inference_mode()
    def floor():
        for b in batches:
            eager(**b, output_attentions=True)

    def syntax():
        analysis = Syntax(Context(6, 12))
        stream(model, corpus.batches(args.batch_size), [analysis])
        analysis.finish()

    base, mine = timed(floor, args.rounds), timed(syntax, args.rounds)
    print(f"eager + output_attentions (floor)  {base:6.2f} s")
    print(f"syntax analysis, all tables        {mine:6.2f} s   {mine / base:4.2f}x floor")

    # Memory, in this process: a first pass over the whole split fills torch's and BLAS's
    # per-shape caches (bounded by the distinct batch shapes, not by the corpus); then 200 and
    # 2,000 sentences are streamed in turn, twice, and the larger peak of each is kept.
    small = Corpus(read_conllu(ewt_dev())[:200], tokenizer, limit)
    held(model, corpus, args.batch_size)
    peaks = {200: 0, 2000: 0}
    for _ in range(2):
        for n, part in ((200, small), (2000, corpus)):
            peaks[n] = max(peaks[n], held(model, part, args.batch_size))
    for n, peak in peaks.items():
        print(f"peak memory held while streaming {n:5d} sentences: {peak / 2**20:6.1f} MiB")
    print(f"ratio 2000 / 200 sentences: {peaks[2000] / peaks[200]:.2f}")


if __name__ == "__main__":
    main()
