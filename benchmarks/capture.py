"""Capturing hook_pattern and hook_z on MiniLM against the plain eager forward pass.

    python benchmarks/capture.py [--sentences 1000] [--batch-size 32]

Floor: the eager model with output_attentions=True on the same batches. Also TransformerLens 4's
TransformerBridge.run_with_cache with the same hook names, when it is installed.
"""

from __future__ import annotations

import argparse

import torch
from _common import ewt_dev, timed
from transformers import AutoModel

import probe
from probe.corpus import Corpus, max_tokens
from probe.loading import resolve_name
from probe.treebank import read_conllu

NAMES = ("hook_pattern", "hook_z")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    model, tokenizer = probe.load("minilm")
    eager = AutoModel.from_pretrained(resolve_name("minilm"), attn_implementation="eager").eval()
    sentences = read_conllu(ewt_dev())[: args.sentences]
    corpus = Corpus(sentences, tokenizer, max_tokens(model.config, tokenizer))
    batches = [b.inputs for b in corpus.batches(args.batch_size)]
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    print(f"MiniLM, {corpus.analysed} EWT dev sentences, {tokens} tokens, {len(batches)} batches")

    @torch.inference_mode()
    def floor():
        for b in batches:
            eager(**b, output_attentions=True)

    @torch.inference_mode()
    def captured():
        with probe.trace(model, NAMES) as cache:
            for b in batches:
                cache.clear()
                model(**b)

    @torch.inference_mode()
    def captured_per_batch():
        for b in batches:
            with probe.trace(model, NAMES):
                model(**b)

    results = {
        "eager + output_attentions (floor)": timed(floor, args.rounds),
        "probe.trace(hook_pattern, hook_z)": timed(captured, args.rounds),
        "probe.trace entered per batch": timed(captured_per_batch, args.rounds),
    }
    try:
        from transformer_lens.model_bridge import TransformerBridge
    except ImportError:
        print("TransformerLens not installed: pip install transformer-lens to compare")
    else:
        bridge = TransformerBridge.boot_transformers(
            resolve_name("minilm"), device="cpu", tokenizer=tokenizer
        )

        @torch.inference_mode()
        def transformer_lens():
            for b in batches:
                bridge.run_with_cache(
                    b["input_ids"],
                    attention_mask=b["attention_mask"],
                    names_filter=lambda n: n.endswith(NAMES),
                )

        results["TransformerLens 4 TransformerBridge.run_with_cache"] = timed(
            transformer_lens, args.rounds
        )

    base = results["eager + output_attentions (floor)"]
    for name, seconds in results.items():
        print(f"{name:55s} {seconds:7.2f} s  {seconds / base:5.2f}x floor")


if __name__ == "__main__":
    main()
