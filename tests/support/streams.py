"""Feed captures to analyses by hand, without a model: the runner's calls, in its order."""

import torch

from analyses import Context
from probe.inputs.corpus import Batch
from probe.pipeline.runner import LayerCapture


def feed(consumer, batch: Batch, patterns: torch.Tensor) -> None:
    """One batch through ``consumer``, with patterns ``[batch, layer, head, q_pos, k_pos]``."""
    consumer.begin_batch(batch)
    for layer in range(patterns.shape[1]):
        consumer.update(batch, layer, LayerCapture({"hook_pattern": patterns[:, layer]}, batch))
    consumer.end_batch(batch)


def context(n_layers: int, n_heads: int, **kwargs) -> Context:
    return Context(n_layers, n_heads, **kwargs)
