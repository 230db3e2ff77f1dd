"""The head-types pass on repeated sequences against the plain forward pass over the same ones.

    python benchmarks/taxonomy.py [--sequences 200] [--length 50] [--batch-size 32]

Floor: the model as loaded (sdpa attention, no capture) over the very batches of the repeated
sequences and their nulls. Ours, two ways: the same batches streamed through the mirrored model
with every layer's whole pattern handed to the taxonomy analysis (``stream``), and the model's
own sdpa kernel running while the taxonomy reads blocks of query rows beside it
(``stream_rows``, the path ``probe analyze`` takes, since every reader of this unit takes rows).
The three are timed in turn, round after round, so load on a shared machine falls on all
alike. On MiniLM (a real BERT) and on a random decoder of the same size (GPT-2 shaped, 6 layers,
12 heads, d_model 384).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers as tf

import probe
from analyses import Context
from analyses.taxonomy import Taxonomy
from probe.inputs.units import Source
from probe.inputs.units.repeats import RepeatedSequences
from probe.options import parse_size
from probe.pipeline.runner import stream, stream_rows


def measure(model, tokenizer, args) -> tuple[float, float, float]:
    unit = RepeatedSequences(Source(seed=0), tokenizer, 10**6, options={
        "repeat_sequences": args.sequences, "repeat_length": args.length})  # fmt: skip
    batches = list(unit.batches(args.batch_size))
    for batch in batches:
        batch.unit = "repeats"
    L, H = model.config.num_hidden_layers, model.config.num_attention_heads

    @torch.inference_mode()
    def plain():
        for batch in batches:
            model(**batch.inputs)

    def taxonomy():
        return Taxonomy(Context(L, H, options={"repeat_length": args.length}))

    def whole():
        stream(model, batches, [taxonomy()])

    def rows():
        stream_rows(model, batches, [taxonomy()], parse_size("1GiB"))

    return interleaved((plain, whole, rows), args.rounds)


def interleaved(fns, rounds: int) -> tuple[float, ...]:
    """Median wall time of each of ``fns`` over ``rounds`` rounds, after one warm-up each; every
    round runs them all in turn."""
    times = [[] for _ in fns]
    for round in range(rounds + 1):
        for fn, spent in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            if round:
                spent.append(time.perf_counter() - start)
    return tuple(statistics.median(spent) for spent in times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequences", type=int, default=200)
    parser.add_argument("--length", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    minilm, tokenizer = probe.load("minilm")
    config = tf.GPT2Config(n_layer=6, n_head=12, n_embd=384, vocab_size=tokenizer.vocab_size)
    decoder = tf.GPT2Model(config).eval()
    tokens = 2 * args.sequences * (2 * args.length + 2)
    print(f"{2 * args.sequences} sequences (repeats and nulls) of n = {args.length}, about "
          f"{tokens} tokens, batches of {args.batch_size}, medians of {args.rounds}")  # fmt: skip
    for name, model in (("MiniLM (BERT)", minilm), ("random GPT-2 shape", decoder)):
        floor, whole, rows = measure(model, tokenizer, args)
        print(
            f"{name:20s} plain {floor:6.2f} s   whole patterns {whole:6.2f} s "
            f"({whole / floor:.2f}x)   row blocks {rows:6.2f} s ({rows / floor:.2f}x)  (≤ 1.1x)"
        )


if __name__ == "__main__":
    main()
