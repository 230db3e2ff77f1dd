"""Factored QK/OV spectra of a 7B-shaped model against dense SVDs of the formed products.

    python benchmarks/spectra.py [--layers 32] [--heads 32] [--d-model 4096] [--dense 2]

Random float32 weights shaped like a 7B model (d_model 4096, d_head 128, 32 heads x 32 layers):
all heads' QK and OV spectra from the factors, against a dense float64 SVD of a few formed
d_model x d_model products, extrapolated to all heads.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from probe.capture.head_weights import HeadWeights
from probe.weights.spectra import _layer_rows


def random_layer(heads: int, d_model: int, d_head: int, g: torch.Generator) -> HeadWeights:
    scale = d_model**-0.5

    def w(*shape):
        return torch.randn(*shape, generator=g) * scale

    zeros = torch.zeros(heads, d_head)
    return HeadWeights(
        w(heads, d_model, d_head), w(heads, d_model, d_head), w(heads, d_model, d_head),
        w(heads, d_head, d_model), zeros, zeros, zeros, torch.zeros(d_model), torch.arange(heads),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--d-model", type=int, default=4096)
    parser.add_argument("--dense", type=int, default=2, help="formed products to SVD densely")
    args = parser.parse_args()
    d_head = args.d_model // args.heads
    g = torch.Generator().manual_seed(0)
    print(f"{args.layers} layers x {args.heads} heads, d_model {args.d_model}, d_head {d_head}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip

    factored, rows = 0.0, []
    for layer in range(args.layers):
        w = random_layer(args.heads, args.d_model, d_head, g)
        start = time.perf_counter()
        rows += _layer_rows(layer, w)
        factored += time.perf_counter() - start
    n_products = 2 * args.layers * args.heads

    dense, worst = 0.0, 0.0
    for i in range(args.dense):
        w = random_layer(args.heads, args.d_model, d_head, g)
        A, B = (w.W_Q[0], w.W_K[0]) if i % 2 == 0 else (w.W_V[0], w.W_O[0].T)
        start = time.perf_counter()
        s = np.linalg.svd((A.double() @ B.double().T).numpy(), compute_uv=False)
        dense += time.perf_counter() - start
        mine = _layer_rows(0, w)[0 if i % 2 == 0 else args.heads]["singular_values"]
        worst = max(worst, np.abs(mine - s[:d_head]).max() / s[0])
    dense_all = dense / args.dense * n_products

    print(f"factored, all {n_products} products:       {factored:9.1f} s")
    print(f"dense SVD, {args.dense} products:              {dense:9.1f} s")
    print(f"dense SVD extrapolated to {n_products}:    {dense_all:9.1f} s")
    print(f"speed-up:                               {dense_all / factored:9.0f}x")
    print(f"max relative error vs dense:            {worst:9.1e}")


if __name__ == "__main__":
    main()
