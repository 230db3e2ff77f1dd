"""Circuits against plain forward passes: patching every head, attribution, and EAP-IG.

    python benchmarks/circuits.py [--pairs 8] [--length 16] [--rounds 3]

Pairs: random token sequences of ``--length`` (the tokenizer's [CLS] ... [SEP]), each with a
corrupted copy whose middle tokens are redrawn. Metric: one direction of the first position's
hidden state (MiniLM has no LM head), one value per pair.

- patching: ``probe.patch`` of every head (72 on MiniLM) on the batch of pairs, against as many
  plain forward passes of the batch (goal ≤ 1.2x);
- attribution: ``probe.attribute`` (AtP) of every head, against one forward pass of the batch of
pairs (goal ≤ 4x);
- EAP-IG with 5 steps: ``probe.edges``, against one forward pass (goal ≤ 15x). MiniLM is a
  post-LayerNorm model, whose edges are not a sum, so this one runs on a randomly initialised
  GPT-2 of MiniLM's shape (6 layers, 12 heads, d_model 384, LM head).
"""

from __future__ import annotations

import argparse

import torch
from _common import timed

import probe


def pairs_for(vocab: int, n_pairs: int, length: int, seed: int = 0, cls=None, sep=None):
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(1000, vocab, (n_pairs, length), generator=g)
    if cls is not None:
        clean[:, 0], clean[:, -1] = cls, sep
    corrupted = clean.clone()
    middle = slice(length // 4, length // 2)
    corrupted[:, middle] = torch.randint(1000, vocab, corrupted[:, middle].shape, generator=g)
    mask = torch.ones_like(clean)
    return {"input_ids": clean, "attention_mask": mask}, {
        "input_ids": corrupted,
        "attention_mask": mask,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)

    model, tokenizer = probe.load("minilm")
    clean, corrupted = pairs_for(
        tokenizer.vocab_size, args.pairs, args.length, cls=tokenizer.cls_token_id,
        sep=tokenizer.sep_token_id,
    )  # fmt: skip
    w = torch.randn(model.config.hidden_size)

    def metric(out):
        return out.last_hidden_state[:, 0] @ w

    heads = model.config.num_hidden_layers * model.config.num_attention_heads

    @torch.no_grad()
    def plain(times: int) -> None:
        for _ in range(times):
            model(**corrupted)

    forward = timed(lambda: plain(1), args.rounds)
    floor = timed(lambda: plain(heads), args.rounds)
    patching = timed(lambda: probe.patch(model, clean, corrupted, metric), args.rounds)
    attribution = timed(lambda: probe.attribute(model, clean, corrupted, metric), args.rounds)
    print(f"MiniLM, {args.pairs} pairs of {args.length} tokens, {heads} heads")
    print(f"  one forward pass of the batch: {forward * 1e3:.1f} ms")
    print(
        f"  patching every head: {patching:.3f} s; {heads} plain forward passes {floor:.3f} s: "
        f"{patching / floor:.2f}x (goal <= 1.2x)"
    )
    ratio = attribution / forward
    print(f"  attribution (atp): {attribution * 1e3:.1f} ms: {ratio:.2f}x (goal <= 4x)")

    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=6, n_head=12, n_embd=384, vocab_size=30522, n_positions=512)
    gpt2 = GPT2LMHeadModel(config).eval()
    clean2, corrupted2 = pairs_for(config.vocab_size, args.pairs, args.length, seed=1)
    answer = clean2["input_ids"][:, -1]

    def logprob(out):
        logp = torch.log_softmax(out.logits[:, -2].float(), dim=-1)
        return logp[torch.arange(len(logp)), answer[: len(logp)]]

    @torch.no_grad()
    def plain2() -> None:
        gpt2(**corrupted2)

    forward2 = timed(plain2, args.rounds)
    eap_ig = timed(lambda: probe.edges(gpt2, clean2, corrupted2, logprob, steps=5), args.rounds)
    print("GPT-2 of MiniLM's shape (random weights), the same pairs' shape")
    print(f"  one forward pass of the batch: {forward2 * 1e3:.1f} ms")
    print(f"  EAP-IG, 5 steps: {eap_ig * 1e3:.1f} ms: {eap_ig / forward2:.2f}x (goal <= 15x)")


if __name__ == "__main__":
    main()
