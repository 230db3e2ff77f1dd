"""A norm's arithmetic computed beside it, without running the module (and the hooks on it): its
input centred (LayerNorm) or not (RMSNorm), its scale, and its output from a normalised input
with the model's gain (``probe.capture.architectures.norm_gain``) and the norm's bias.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from probe.capture.architectures import norm_gain


def centred(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x`` less its mean over the last axis where ``norm`` is a LayerNorm; an RMSNorm reads
    ``x`` as it is."""
    return x - x.mean(-1, keepdim=True) if isinstance(norm, nn.LayerNorm) else x


def scale(norm: nn.Module, centred_x: torch.Tensor) -> torch.Tensor:
    """The norm's scale, ``[..., 1]``: the root mean square of its centred input, plus its eps."""
    eps = getattr(norm, "eps", None) or getattr(norm, "variance_epsilon", 1e-6)
    return (centred_x.pow(2).mean(-1, keepdim=True) + eps).sqrt()


def normalise(model: nn.Module, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm`` (LayerNorm or RMSNorm, one of ``model``'s) applied to ``x`` ``[..., d_model]`` by
    its own statistics, with its gain and bias, without running the module."""
    if type(norm) is nn.LayerNorm:  # torch's own kernel: one pass, as the model
        return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
    x = centred(norm, x)
    return affine(model, norm, x / scale(norm, x))


def affine(model: nn.Module, norm: nn.Module, normalized: torch.Tensor) -> torch.Tensor:
    """A norm's output from its normalised input: times its gain (``norm_gain``: Gemma's
    1 + weight), plus its bias."""
    bias = getattr(norm, "bias", None)
    out = normalized * norm_gain(model, norm.weight)
    return out if bias is None else out + bias
