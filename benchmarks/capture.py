"""Capturing every layer's attention pattern and z on MiniLM: probe, TransformerLens and nnsight,
each against the same model run plainly, with sdpa and with eager attention.

    python benchmarks/capture.py [--sentences 300] [--batch-size 32] [--rounds 3]

Like with like: each tool's captured run is timed against a plain forward pass of the very model
it hooks. TransformerLens 4's TransformerBridge loads MiniLM only with a masked-LM head (30,522
logits per token), so its floor is that model (``BertForMaskedLM``) run plainly; probe and
nnsight hook the base model, their floor is the base model. Patterns exist under sdpa only
where a tool computes them beside the kernel (probe) or recomputes the attention itself
(TransformerLens); nnsight reads what the model returns, so it captures z under sdpa, and z and
the pattern under eager with ``output_attentions=True`` (its floor then returns them too).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import ewt_dev
from transformers import AutoModel, BertForMaskedLM

import probe
from probe.inputs.corpus import Corpus, max_tokens
from probe.inputs.treebank import read_conllu
from probe.pipeline.loading import resolve_name

NAMES = ("hook_pattern", "hook_z")


def probe_rows(batches, implementation):
    model = AutoModel.from_pretrained(
        resolve_name("minilm"), attn_implementation=implementation
    ).eval()

    @torch.inference_mode()
    def plain():
        for b in batches:
            model(**b)

    @torch.inference_mode()
    def captured():
        for b in batches:
            with probe.trace(model, NAMES):
                model(**b)

    return "probe.trace", "BertModel", plain, captured


def transformer_lens_rows(batches, implementation, tokenizer):
    from transformer_lens.model_bridge import TransformerBridge

    hf = BertForMaskedLM.from_pretrained(
        resolve_name("minilm"), attn_implementation=implementation
    ).eval()
    bridge = TransformerBridge.boot_transformers(
        resolve_name("minilm"), hf_model=hf, tokenizer=tokenizer, device="cpu"
    )

    @torch.inference_mode()
    def plain():
        for b in batches:
            hf(**b)

    @torch.inference_mode()
    def captured():
        for b in batches:
            bridge.run_with_cache(
                b["input_ids"],
                attention_mask=b["attention_mask"],
                names_filter=lambda n: n.endswith(NAMES),
            )

    return "TransformerLens run_with_cache", "BertForMaskedLM", plain, captured


def nnsight_rows(batches, implementation):
    from nnsight import NNsight

    model = AutoModel.from_pretrained(
        resolve_name("minilm"), attn_implementation=implementation
    ).eval()
    wrapped = NNsight(model)
    eager = implementation == "eager"
    kwargs = {"output_attentions": True} if eager else {}

    @torch.inference_mode()
    def plain():
        for b in batches:
            model(**b, **kwargs)

    @torch.inference_mode()
    def captured():
        for b in batches:
            saved = []  # nnsight runs the block's body itself: results go into an outer list
            with wrapped.trace(**b, **kwargs):
                for layer in wrapped.encoder.layer:  # (z [batch, pos, d_model], pattern | None)
                    saved.append(layer.attention.self.output.save())
            assert len(saved) == model.config.num_hidden_layers

    what = "z and pattern" if eager else "z"
    return f"nnsight trace ({what})", "BertModel", plain, captured


def interleaved(plain, captured, rounds: int) -> tuple[float, float]:
    """Median times of ``plain()`` and ``captured()``, run in turns (after one warm-up each), so
    that a busy machine slows both alike."""
    times: tuple[list[float], list[float]] = ([], [])
    plain(), captured()
    for _ in range(rounds):
        for fn, kept in zip((plain, captured), times, strict=True):
            start = time.perf_counter()
            fn()
            kept.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sentences", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    model, tokenizer = probe.load("minilm")
    sentences = read_conllu(ewt_dev())[: args.sentences]
    corpus = Corpus(sentences, tokenizer, max_tokens(model.config, tokenizer))
    batches = [b.inputs for b in corpus.batches(args.batch_size)]
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    print(
        f"MiniLM, {corpus.analysed} EWT dev sentences, {tokens} tokens, {len(batches)} batches, "
        f"{torch.get_num_threads()} threads; median of {args.rounds} rounds"
    )
    print(f"{'tool':38} {'attention':9} {'floor (plain run of)':20} {'plain s':>8} "
          f"{'captured s':>10} {'ratio':>6}")  # fmt: skip
    for implementation in ("sdpa", "eager"):
        setups = [probe_rows(batches, implementation)]
        try:
            setups.append(transformer_lens_rows(batches, implementation, tokenizer))
        except ImportError:
            print("TransformerLens not installed: pip install transformer-lens to compare")
        try:
            setups.append(nnsight_rows(batches, implementation))
        except ImportError:
            print("nnsight not installed: pip install nnsight to compare")
        for tool, floor, plain, captured in setups:
            base, hooked = interleaved(plain, captured, args.rounds)
            print(
                f"{tool:38} {implementation:9} {floor:20} {base:8.2f} {hooked:10.2f} "
                f"{hooked / base:5.2f}x"
            )


if __name__ == "__main__":
    main()
