"""Multi-head attention as in "Attention Is All You Need", with a hook point on every step.

    head_i     = softmax(Q W_i^Q (K W_i^K)ᵀ / √d_k) V W_i^V
    MultiHead  = Concat(head_1, …, head_h) W^O = Σ_i head_i W_i^O

Weights are stored per head, in the paper's orientation, so ``W_Q[i]`` is W_i^Q.

Two choices the paper makes can be changed, to study them: each head's width ``d_head``
(d_model / h by default; "wide" heads project to all of d_model), and how the scores are
parametrised (``qk``): "factored" learns W_i^Q and W_i^K (the paper); "bilinear" learns one
W_i = W_i^Q W_i^Kᵀ of d_model x d_model per head (W_i^Q is W_i, W_i^K the identity); "shared"
learns one W_i^Q = W_i^K, whose scores are symmetric in query and key.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from probe.capture.hookpoints import HookPoint


class MultiHeadAttention(nn.Module):
    """Multi-head attention whose per-head Q, K, V, scores, pattern, z and result are hookable.

    It can stand in for ``torch.nn.MultiheadAttention`` (see ``from_torch``), e.g. as the
    ``self_attn`` of a ``torch.nn.TransformerEncoderLayer``: ``forward`` takes torch's
    keywords, and returns torch's ``(output, weights)`` when ``need_weights`` is given.

    Parameters
    ----------
    d_model : int
        Width of the residual stream.
    n_heads : int
        Number of heads h.
    d_head : int, optional
        Width of each head's queries, keys and values; d_model / h by default (d_model for
        "wide" heads).
    qk : {"factored", "bilinear", "shared"}
        How the scores are parametrised (see the module's docstring). The scores are divided
        by √d_head in every case.
    bias : bool
        Learn b_Q, b_K, b_V and b_O (otherwise they are fixed zeros).
    dropout : float
        Dropout on the attention pattern while training.
    batch_first : bool
        Inputs and outputs are ``[batch, pos, d_model]`` (probe's way, the default); False for
        ``[pos, batch, d_model]``, as ``torch.nn.MultiheadAttention`` has by default.

    Attributes
    ----------
    W_Q, W_K, W_V : ``[n_heads, d_model, d_head]``
        ``[n_heads, d_model, d_model]`` for W_Q and W_K with qk="bilinear" (W_K is then a
        fixed identity); with qk="shared", W_K is W_Q, one parameter.
    W_O : Parameter ``[n_heads, d_head, d_model]``
    b_Q, b_K, b_V : ``[n_heads, d_head]``
        b_Q and b_K ``[n_heads, d_model]`` with qk="bilinear", b_K fixed at zero.
    b_O : ``[d_model]``
    """

    QK = ("factored", "bilinear", "shared")

    # What torch's transformer layers look up on their attention. No fused input projection:
    # their fused fast path does not apply, so they call ``forward``, hooks and all.
    in_proj_bias = None
    _qkv_same_embed_dim = True

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        d_head: int | None = None,
        qk: str = "factored",
        bias: bool = True,
        dropout: float = 0.0,
        batch_first: bool = True,
    ):
        super().__init__()
        sizes = [("d_model", d_model), ("n_heads", n_heads)]
        for name, value in [*sizes, *([("d_head", d_head)] if d_head is not None else [])]:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), not {dropout!r}")
        if qk not in self.QK:
            raise ValueError(f"qk must be one of {', '.join(self.QK)}, not {qk!r}")
        if d_head is None and d_model % n_heads:
            raise ValueError(
                f"d_model ({d_model}) must be divisible by n_heads ({n_heads}): "
                "each head gets d_model / n_heads dimensions (or give d_head)"
            )
        self.d_model, self.n_heads = d_model, n_heads
        self.d_head = d_head or d_model // n_heads
        self.qk, self.dropout, self.batch_first = qk, dropout, batch_first
        self.embed_dim, self.num_heads = d_model, n_heads  # torch's names
        h, d, k = n_heads, d_model, self.d_head
        k_qk = d if qk == "bilinear" else k  # width in which queries meet keys
        self.W_Q = nn.Parameter(torch.empty(h, d, k_qk))
        self._bias("b_Q", torch.zeros(h, k_qk), bias)
        if qk == "factored":
            self.W_K = nn.Parameter(torch.empty(h, d, k))
            self._bias("b_K", torch.zeros(h, k), bias)
        elif qk == "shared":  # one parameter under both names: symmetric scores
            self.W_K, self.b_K = self.W_Q, self.b_Q
        else:  # bilinear: W_i^Q is W_i, keys are the stream itself
            self.register_buffer("W_K", torch.eye(d).expand(h, d, d).clone())
            self.register_buffer("b_K", torch.zeros(h, d))
        self.W_V = nn.Parameter(torch.empty(h, d, k))
        self.W_O = nn.Parameter(torch.empty(h, k, d))
        self._bias("b_V", torch.zeros(h, k), bias)
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
        # Xavier-uniform on the full input and output maps (d_model x h·d_head), as
        # torch.nn.MultiheadAttention does; a bilinear W_i on its own d_model x d_model.
        bound = math.sqrt(6.0 / (self.d_model + self.n_heads * self.d_head))
        learned = [self.W_Q, self.W_V, self.W_O] + ([self.W_K] if self.qk == "factored" else [])
        for W in learned:
            nn.init.uniform_(W, -bound, bound)
        if self.qk == "bilinear":  # W_i with the variance of a factored W_i^Q W_i^Kᵀ
            bound = math.sqrt(3.0 * self.d_head) * bound**2
            nn.init.uniform_(self.W_Q, -bound, bound)

    def parameter_counts(self) -> dict[str, int]:
        """Learned numbers in each part: ``{"QK": …, "V": …, "O": …, "bias": …}``.

        QK is 2·h·d_model·d_head for factored heads, h·d_model² for bilinear ones (one W_i
        each) and h·d_model·d_head for shared ones; V and O are h·d_model·d_head each.
        """
        learned = {id(p): (name, p) for name, p in self.named_parameters()}.values()
        parts = {"QK": 0, "V": 0, "O": 0, "bias": 0}
        for name, p in learned:
            part = "bias" if name.startswith("b_") else {"W_V": "V", "W_O": "O"}.get(name, "QK")
            parts[part] += p.numel()
        return parts

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
