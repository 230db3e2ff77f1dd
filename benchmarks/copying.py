"""Copying scores of every head of a Llama-3-8B-shaped model with random weights.

    python benchmarks/copying.py [--layers 32] [--heads 32] [--kv-heads 8] [--d-model 4096]
                                 [--d-head 128] [--vocab 128256] [--no-check]

No model is built (32 GB of float32 weights): random float32 W_E [vocab, d_model] and an untied
W_U [d_model, vocab] (2 GB each at 128,256 x 4,096), then per layer W_V [kv_heads, d_model,
d_head] and W_O [heads, d_head, d_model], generated one layer at a time and not timed. Times
W_U W_E (the one product over the vocabulary) and the per-layer circuits and eigenproblems,
reports peak RSS, and checks one head's d_head x d_head circuit against a float64 product taken
in the other order, W_O (W_U (W_E W_V)).
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from probe.weights.copying import copying_score, embedding_product, ov_eigenvalues


def rss_gb() -> float:
    """Resident memory now, from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**30


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=4096)
    parser.add_argument("--d-head", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--no-check", action="store_true", help="skip the float64 check")
    args = parser.parse_args()
    d_model, d_head = args.d_model, args.d_head
    g = torch.Generator().manual_seed(0)
    print(f"{args.layers} layers x {args.heads} query heads ({args.kv_heads} value heads), "
          f"d_model {d_model}, d_head {d_head}, vocab {args.vocab}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip

    start = time.perf_counter()
    W_E = torch.randn(args.vocab, d_model, generator=g).mul_(0.02)  # [vocab, d_model]
    W_U = torch.randn(args.vocab, d_model, generator=g).mul_(0.02).T  # lm_head.weight.T
    print(f"random W_E, W_U (not timed):            {time.perf_counter() - start:7.1f} s, "
          f"RSS {rss_gb():.2f} GiB")  # fmt: skip

    start = time.perf_counter()
    W_UE = embedding_product(W_E, W_U)  # [d_model, d_model]
    vocabulary = time.perf_counter() - start

    heads, scores, generating = 0.0, [], 0.0
    for _ in range(args.layers):
        start = time.perf_counter()
        scale = d_model**-0.5
        W_V = torch.randn(args.kv_heads, d_model, d_head, generator=g).mul_(scale)
        W_O = torch.randn(args.heads, d_head, d_model, generator=g).mul_(scale)
        generating += time.perf_counter() - start
        start = time.perf_counter()
        scores.append(copying_score(ov_eigenvalues(W_UE, W_V, W_O)))
        heads += time.perf_counter() - start
    scores = torch.stack(scores)  # [layer, head]
    total = vocabulary + heads

    n = args.layers * args.heads
    print(f"W_U W_E, once:                          {vocabulary:7.1f} s")
    print(f"circuits + eigenvalues, {n} heads:     {heads:7.1f} s")
    print(f"total (random W_V, W_O not timed):      {total:7.1f} s   "
          f"({generating:.1f} s generating them)")  # fmt: skip
    print(f"peak RSS:                               {peak_rss_gb():7.2f} GiB "
          f"(W_E and W_U: {2 * W_E.numel() * 4 / 2**30:.2f} GiB)")  # fmt: skip
    print(f"copying scores: mean {scores.mean():+.4f}, range [{scores.min():+.4f}, "
          f"{scores.max():+.4f}]")  # fmt: skip

    if args.no_check:
        return
    # The last layer's head 0, its circuit in float64 the other way round, chunked over vocab.
    start = time.perf_counter()
    W_V0, W_O0 = W_V[0].double(), W_O[0].double()
    UEV = torch.zeros(d_model, d_head, dtype=torch.float64)
    for rows in torch.arange(args.vocab).split(8192):
        UEV += W_U[:, rows].double() @ (W_E[rows].double() @ W_V0)
    expected = copying_score(torch.linalg.eigvals(W_O0 @ UEV))
    error = abs(float(expected) - float(scores[-1, 0]))
    print(f"head 0 of the last layer, float64 W_O (W_U (W_E W_V)): {float(expected):+.6f}, "
          f"|difference| {error:.1e} ({time.perf_counter() - start:.1f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
