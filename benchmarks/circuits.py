"""Circuits against plain forward passes: patching every head, attribution, and EAP-IG (their
memory at Llama-3-8B's width: ``benchmarks/circuit_memory.py``).

    python benchmarks/circuits.py [--pairs 8] [--length 16] [--rounds 5] [--only patching]
        [--threads 1]

Pairs: random token sequences of ``--length`` (the tokenizer's [CLS] ... [SEP]), each with a
corrupted copy whose middle tokens are redrawn. Metric: one direction of the first position's
hidden state (MiniLM has no LM head), one value per pair.

- patching: ``probe.patch`` of every head (72 on MiniLM) on the batch of pairs, against as many
  plain forward passes of the batch (goal ≤ 1.2x);
- attribution: ``probe.attribute`` (AtP) of every head, against one plain forward pass of the
  same batch of pairs (goal ≤ 4x);
- EAP-IG with 5 steps: ``probe.edges``, against one plain forward pass of the same batch (goal ≤
  15x). MiniLM is a post-LayerNorm model, whose edges are not a sum, so this one runs on a
  randomly initialised GPT-2 of MiniLM's shape (6 layers, 12 heads, d_model 384, LM head);
- guard: what the model-restoring guard (``probe.interventions.guard``: the door's checks, and
  the model's modes, flags, gradients, hooks and attention implementation recorded and put
  back) costs each call, against the patching call it wraps (goal: at most 1% of it).

Each measurement and its floor run in pairs, alternating which goes first, after a warm-up of
both: the ratio is the median of the rounds' ratios, so that load shared with other processes
(printed, from /proc/loadavg) falls alike on both. On a shared machine ``--threads 1`` gives
steadier numbers: there, two threads' plain forward passes were seen to swing tenfold.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from _common import timed  # noqa: F401  (sets the offline environment before transformers)

import probe

GOALS = {"patching": 1.2, "attribution": 4.0, "eap-ig": 15.0, "guard": 0.01}


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


def load() -> str:
    """The 1-minute load average (the machine is shared)."""
    path = Path("/proc/loadavg")
    return path.read_text().split()[0] if path.exists() else "?"


def paired(floor, subject, rounds: int, repeats: int = 1) -> tuple[float, float, float]:
    """Median seconds of ``floor()`` and ``subject()``, and the median of their per-round ratio;
    each round runs both, alternating which goes first, after one warm-up of each. A short
    floor runs ``repeats`` times a round, its median taken, so that one slow call does not set
    the round's ratio."""
    floor(), subject()
    floors, subjects, ratios = [], [], []
    for r in range(rounds):
        times = {}
        for name, fn in (("floor", floor), ("subject", subject))[:: 1 if r % 2 == 0 else -1]:
            took = []
            for _ in range(repeats if name == "floor" else 1):
                start = time.perf_counter()
                fn()
                took.append(time.perf_counter() - start)
            times[name] = statistics.median(took)
        floors.append(times["floor"])
        subjects.append(times["subject"])
        ratios.append(times["subject"] / times["floor"])
    return statistics.median(floors), statistics.median(subjects), statistics.median(ratios)


def report(name: str, floor_label: str, floor: float, took: float, ratio: float, before: str):
    goal = GOALS[name]
    verdict = "meets" if ratio <= goal else "misses"
    print(
        f"  {name}: {took * 1e3:.1f} ms; {floor_label} {floor * 1e3:.1f} ms: {ratio:.2f}x "
        f"(goal <= {goal}x: {verdict} it); load {before} -> {load()}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", choices=sorted(GOALS), action="append")
    parser.add_argument("--threads", type=int, help="torch's threads (default: torch's own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    which = args.only or list(GOALS)
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} threads; load {load()}")

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

    print(f"MiniLM, {args.pairs} pairs of {args.length} tokens, {heads} heads")
    if "patching" in which:
        before = load()
        floor, took, ratio = paired(
            lambda: plain(heads), lambda: probe.patch(model, clean, corrupted, metric), args.rounds
        )
        report("patching", f"{heads} plain forward passes", floor, took, ratio, before)
    if "attribution" in which:
        before = load()
        floor, took, ratio = paired(
            lambda: plain(1),
            lambda: probe.attribute(model, clean, corrupted, metric),
            args.rounds,
            repeats=5,
        )
        report("attribution", "one plain forward pass", floor, took, ratio, before)

    if "guard" in which:
        guard_share(model, lambda: probe.patch(model, clean, corrupted, metric), args.rounds)
    if "eap-ig" not in which:
        return
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=6, n_head=12, n_embd=384, vocab_size=30522, n_positions=512)
    gpt2 = GPT2LMHeadModel(config).eval()
    clean2, corrupted2 = pairs_for(config.vocab_size, args.pairs, args.length, seed=1)
    answer = clean2["input_ids"][:, -1]

    def logprob(logits):
        logp = torch.log_softmax(logits[:, -2].float(), dim=-1)
        return logp[torch.arange(len(logp)), answer[: len(logp)]]

    @torch.no_grad()
    def plain2() -> None:
        gpt2(**corrupted2)

    print("GPT-2 of MiniLM's shape (random weights), pairs of the same shape")
    before = load()
    floor, took, ratio = paired(
        plain2,
        lambda: probe.edges(gpt2, clean2, corrupted2, logprob, steps=5),
        args.rounds,
        repeats=5,
    )
    report("eap-ig", "one plain forward pass", floor, took, ratio, before)


def guard_share(model, call, rounds: int) -> None:
    """The guard's own time a call (median of 200), and its share of ``call``'s median time."""
    from probe.interventions.guard import check_model, model_kept

    def guard() -> None:
        check_model(model)
        with model_kept(model):
            pass

    each = []
    for _ in range(200):
        start = time.perf_counter()
        guard()
        each.append(time.perf_counter() - start)
    calls = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        calls.append(time.perf_counter() - start)
    own, whole = statistics.median(each), statistics.median(calls)
    share = own / whole
    print(f"guard: {own * 1e3:.2f} ms a call (min {min(each) * 1e3:.2f} ms) against "
          f"{whole:.2f} s for patching: {share:.2%} of it "
          f"(goal ≤ {GOALS['guard']:.0%})")  # fmt: skip


if __name__ == "__main__":
    main()
