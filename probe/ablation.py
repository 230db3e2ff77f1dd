"""Head ablation: remove chosen heads' contributions, on top of ``probe.hooks``."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from probe.hookpoints import hooks


@contextmanager
def ablate(
    model: nn.Module,
    heads: Iterable[tuple[int, int]],
    mode: str = "zero",
    means: Mapping[int, torch.Tensor] | None = None,
) -> Iterator[None]:
    """Ablate heads while the ``with`` block runs, by replacing their ``hook_z``.

    Zero ablation removes head i's term head_i W_i^O from the layer output exactly. Mean
    ablation replaces head i's z by a mean z, so the layer keeps the head's average
    contribution but loses its dependence on the input.

    Parameters
    ----------
    model : nn.Module
        A Hugging Face model, or a module built from ``probe.MultiHeadAttention``
        (use layer 0 for a bare module).
    heads : iterable of (layer, head)
        0-based.
    mode : {"zero", "mean"}
    means : mapping of layer to tensor ``[n_heads, d_head]``, optional
        Mean z per head (e.g. ``cache.stack("hook_z").mean((1, 2))`` over a reference set);
        by default, the mean over the current batch's positions.
    """
    if mode not in ("zero", "mean"):
        raise ValueError(f"mode must be 'zero' or 'mean', not {mode!r}")
    by_layer: dict[int, list[int]] = defaultdict(list)
    for layer, head in heads:
        by_layer[int(layer)].append(int(head))

    def replace(layer: int):
        chosen = by_layer[layer]

        def fn(z: torch.Tensor, name: str) -> torch.Tensor:  # z: [batch, pos, head, d_head]
            z = z.clone()
            if mode == "zero":
                z[:, :, chosen] = 0
            elif means is not None:
                z[:, :, chosen] = means[layer][chosen].to(z)
            else:
                z[:, :, chosen] = z[:, :, chosen].mean(dim=(0, 1), keepdim=True)
            return z

        return fn

    bare = any(name == "hook_z" for name, _ in model.named_modules())
    names = {
        ("hook_z" if bare else f"blocks.{layer}.attn.hook_z"): replace(layer) for layer in by_layer
    }
    with hooks(model, names):
        yield
