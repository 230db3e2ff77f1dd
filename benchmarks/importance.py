"""The importance analysis against one plain forward pass over the same sentences.

    python benchmarks/importance.py [--sentences 200] [--rounds 1]

Sentences: the first 200 of EWT dev, as `--analyses importance` keeps them. Floor: one forward
pass of the model as Hugging Face loads it (its default attention) over them, in the very
batches the analysis runs (8 sentences, padded). Ours: the analysis's whole finishing work:
the mean z of every head, the reference outputs, each head ablated alone, the pruning curve,
and with a language-model head the gradient importance. Two models: MiniLM (no
language-model head: the hidden state's relative change), and MiniLM with a masked-LM head
(its checkpoint has none, so the head is random: the cost, not the numbers, is measured).
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import ewt_dev
from transformers import AutoModel, AutoModelForMaskedLM, AutoTokenizer

from analyses import Context
from analyses.importance import Importance
from probe.inputs.corpus import Corpus
from probe.inputs.treebank import iter_conllu
from probe.pipeline.loading import resolve_name


def measure(model, tokenizer, sentences: int, rounds: int) -> tuple[float, float, int]:
    context = Context(
        model.config.num_hidden_layers, model.config.num_attention_heads, model=model,
        options={"importance_sentences": sentences}, mask_token_id=tokenizer.mask_token_id,
    )  # fmt: skip
    keeper = Importance(context)
    for batch in Corpus(
        iter_conllu(ewt_dev()), tokenizer, 512, max_sentences=2 * sentences
    ).batches():
        keeper.begin_batch(batch)
    order = sorted(keeper.kept)
    batches = [keeper._inputs(order[i : i + 8], "cpu")[0] for i in range(0, len(order), 8)]
    floor, ours = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        with torch.inference_mode():
            for inputs in batches:
                model(**inputs)
        floor.append(time.perf_counter() - start)
        analysis = Importance(context)
        analysis.kept = dict(keeper.kept)
        start = time.perf_counter()
        analysis.finish()
        ours.append(time.perf_counter() - start)
    return min(floor), min(ours), len(order)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sentences", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    source = resolve_name("minilm")
    tokenizer = AutoTokenizer.from_pretrained(source)
    models = {
        "MiniLM, hidden state": AutoModel.from_pretrained(source).eval(),
        "MiniLM + masked-LM head, KL and gradient": AutoModelForMaskedLM.from_pretrained(
            source
        ).eval(),
    }
    heads = 6 * 12
    print(f"importance over the first {args.sentences} EWT dev sentences ({heads} heads), "
          f"best of {args.rounds}")  # fmt: skip
    for name, model in models.items():
        floor, ours, n = measure(model, tokenizer, args.sentences, args.rounds)
        print(f"{name:44} forward {floor:6.2f} s   importance {ours:7.1f} s   "
              f"{ours / floor:5.1f}x one forward pass ({n} sentences)")  # fmt: skip
    print(
        f"(by construction about {heads} + 2 + 9 forward passes: each head, the means and the "
        "references, the pruning curve; plus a forward and backward pass with a head)"
    )


if __name__ == "__main__":
    main()
