"""Multi-head attention as in "Attention Is All You Need", with a hook point on every step.

    head_i     = softmax(Q W_i^Q (K W_i^K)ᵀ / √d_k) V W_i^V
    MultiHead  = Concat(head_1, …, head_h) W^O = Σ_i head_i W_i^O

Weights are stored per head, in the paper's orientation, so ``W_Q[i]`` is W_i^Q.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from probe.hookpoints import HookPoint


class MultiHeadAttention(nn.Module):
    """Multi-head attention whose per-head Q, K, V, scores, pattern, z and result are hookable.

    Parameters
    ----------
    d_model : int
        Width of the residual stream.
    n_heads : int
        Number of heads h; each has d_head = d_model / h.
    bias : bool
        Learn b_Q, b_K, b_V and b_O (otherwise they are fixed zeros).
    dropout : float
        Dropout on the attention pattern while training.
    batch_first : bool
        Inputs and outputs are ``[batch, pos, d_model]`` (probe's way, the default); False for
        ``[pos, batch, d_model]``, as ``torch.nn.MultiheadAttention`` has by default.

    It can stand in for ``torch.nn.MultiheadAttention`` (see ``from_torch``), e.g. as the
    ``self_attn`` of a ``torch.nn.TransformerEncoderLayer``: ``forward`` takes torch's
    keywords, and returns torch's ``(output, weights)`` when ``need_weights`` is given.

    Attributes
    ----------
    W_Q, W_K, W_V : Parameter ``[n_heads, d_model, d_head]``
    W_O : Parameter ``[n_heads, d_head, d_model]``
    b_Q, b_K, b_V : ``[n_heads, d_head]``;  b_O : ``[d_model]``
    """

    # What torch's transformer layers look up on their attention. No fused input projection:
    # their fused fast path does not apply, so they call ``forward``, hooks and all.
    in_proj_bias = None
    _qkv_same_embed_dim = True

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        bias: bool = True,
        dropout: float = 0.0,
        batch_first: bool = True,
    ):
        super().__init__()
        for name, value in (("d_model", d_model), ("n_heads", n_heads)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), not {dropout!r}")
        if d_model % n_heads:
            raise ValueError(
                f"d_model ({d_model}) must be divisible by n_heads ({n_heads}): "
                "each head gets d_model / n_heads dimensions"
            )
        self.d_model, self.n_heads, self.d_head = d_model, n_heads, d_model // n_heads
        self.dropout, self.batch_first = dropout, batch_first
        self.embed_dim, self.num_heads = d_model, n_heads  # torch's names
        h, d, k = n_heads, d_model, self.d_head
        self.W_Q, self.W_K, self.W_V = (nn.Parameter(torch.empty(h, d, k)) for _ in range(3))
        self.W_O = nn.Parameter(torch.empty(h, k, d))
        for name in ("b_Q", "b_K", "b_V"):
            self._bias(name, torch.zeros(h, k), bias)
        self._bias("b_O", torch.zeros(d), bias)
        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()
        self.hook_attn_scores, self.hook_pattern = HookPoint(), HookPoint()
        self.hook_z, self.hook_result = HookPoint(), HookPoint()
        self.reset_parameters()

    def _bias(self, name: str, zeros: torch.Tensor, learned: bool) -> None:
        if learned:
            self.register_parameter(name, nn.Parameter(zeros))
        else:
            self.register_buffer(name, zeros)

    def reset_parameters(self) -> None:
        # Xavier-uniform on the full d_model x d_model maps, as torch.nn.MultiheadAttention does.
        bound = math.sqrt(6.0 / (2 * self.d_model))
        for W in (self.W_Q, self.W_K, self.W_V, self.W_O):
            nn.init.uniform_(W, -bound, bound)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        *,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        causal: bool = False,
        need_weights: bool | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """Attend from ``query`` to ``key``/``value`` (both default to ``query``).

        Parameters
        ----------
        query : ``[batch, q_pos, d_model]`` (``[q_pos, batch, d_model]`` if not batch_first)
        key, value : ``[batch, k_pos, d_model]``, optional
        key_padding_mask : ``[batch, k_pos]``, optional
            Bool (True marks keys to ignore) or float (added to the scores), torch's convention.
        attn_mask : ``[q_pos, k_pos]`` or ``[batch * n_heads, q_pos, k_pos]``, optional
            Bool (True = not allowed) or float (added to the scores), as in
            ``torch.nn.MultiheadAttention``.
        causal, is_causal : bool
            Each query sees only keys at its position or before (``is_causal``: torch's name).
        need_weights : bool, optional
            Given, return torch's ``(output, weights)``: the pattern averaged over heads
            ``[batch, q_pos, k_pos]`` (per head with ``average_attn_weights=False``), or None
            when False.

        Returns
        -------
        torch.Tensor ``[batch, q_pos, d_model]``, or ``(output, weights)`` (see need_weights)
        """
        key = query if key is None else key
        value = key if value is None else value
        if not self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        causal = causal or is_causal

        q = self.hook_q(torch.einsum("bpm,hmk->bphk", query, self.W_Q) + self.b_Q)
        k = self.hook_k(torch.einsum("bpm,hmk->bphk", key, self.W_K) + self.b_K)
        v = self.hook_v(torch.einsum("bpm,hmk->bphk", value, self.W_V) + self.b_V)

        scores = torch.einsum("bqhk,bphk->bhqp", q, k) / math.sqrt(self.d_head)
        scores = self.hook_attn_scores(self._mask(scores, key_padding_mask, attn_mask, causal))
        pattern = self.hook_pattern(F.softmax(scores, dim=-1))
        pattern = F.dropout(pattern, self.dropout, self.training)
        z = self.hook_z(torch.einsum("bhqp,bphk->bqhk", pattern, v))

        if self.hook_result.active:
            result = self.hook_result(torch.einsum("bqhk,hkm->bqhm", z, self.W_O))
            out = result.sum(dim=2) + self.b_O
        else:
            out = torch.einsum("bqhk,hkm->bqm", z, self.W_O) + self.b_O
        if not self.batch_first:
            out = out.transpose(0, 1)
        if need_weights is None:
            return out
        if not need_weights:
            return out, None
        return out, pattern.mean(1) if average_attn_weights else pattern

    def _mask(self, scores, key_padding_mask, attn_mask, causal) -> torch.Tensor:
        """Scores ``[batch, head, q, k]`` with disallowed positions at -inf, allowed ones shifted
        by a float ``attn_mask``."""
        batch, heads, n_q, n_k = scores.shape
        if attn_mask is not None:
            if attn_mask.dim() == 3:
                attn_mask = attn_mask.view(batch, heads, n_q, n_k)
            if attn_mask.dtype == torch.bool:
                scores = scores.masked_fill(attn_mask, float("-inf"))
            else:
                scores = scores + attn_mask
        if causal:
            future = torch.ones(n_q, n_k, dtype=torch.bool, device=scores.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        if key_padding_mask is not None:
            if key_padding_mask.dtype == torch.bool:
                scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
            else:
                scores = scores + key_padding_mask[:, None, None, :]
        return scores

    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention) -> MultiHeadAttention:
        """A ``MultiHeadAttention`` computing the same function as ``m`` (batch_first or not).

        Parameters
        ----------
        m : torch.nn.MultiheadAttention
            Without ``kdim``/``vdim`` different from ``embed_dim``, ``add_bias_kv`` or
            ``add_zero_attn``.
        """
        if not m._qkv_same_embed_dim or m.bias_k is not None or m.add_zero_attn:
            raise ValueError(
                "from_torch supports MultiheadAttention with kdim = vdim = embed_dim, "
                "and without add_bias_kv or add_zero_attn"
            )
        d, h = m.embed_dim, m.num_heads
        out = cls(
            d, h, bias=m.in_proj_bias is not None, dropout=m.dropout, batch_first=m.batch_first
        )
        out.to(m.in_proj_weight.dtype)
        w_q, w_k, w_v = m.in_proj_weight.detach().chunk(3)
        with torch.no_grad():
            # torch computes x Wᵀ, so Wᵀ's column block i is W_i in the paper's orientation.
            for W, w in ((out.W_Q, w_q), (out.W_K, w_k), (out.W_V, w_v)):
                W.copy_(w.T.reshape(d, h, d // h).transpose(0, 1))
            out.W_O.copy_(m.out_proj.weight.detach().T.reshape(h, d // h, d))
            if m.in_proj_bias is not None:
                b_q, b_k, b_v = m.in_proj_bias.detach().chunk(3)
                out.b_Q.copy_(b_q.view(h, -1))
                out.b_K.copy_(b_k.view(h, -1))
                out.b_V.copy_(b_v.view(h, -1))
            if m.out_proj.bias is not None:
                out.b_O.copy_(m.out_proj.bias.detach())
        return out
