"""Why a head attends where it does: each attention score split exactly into what wrote its query
and what wrote its key (QK attribution).

A head's pre-softmax score is s_ij = q_i · k_j · scaling (+ a position bias). The query q_i is
a linear function of the residual stream at i once the norm's scale is frozen at the value the
clean run computed (TransformerLens's ``apply_ln_to_stack`` convention), and the stream is a sum
of what wrote it: the embeddings, every earlier head, every earlier MLP and the biases. So is the
key k_j. s_ij is then the sum, over every (query source a, key source b), of
``q_a(i) · k_b(j) · scaling``: the terms this module returns, which add up to the score the model
computed, to float rounding.

- Rotary models: each source's part of the query and the key is rotated as the whole is (the
  rotation is linear).
- Grouped-query attention: each query head with the key/value head it reads.
- Soft-capped scores (Gemma 2): the split is of the score before the cap.
- Position biases (T5's relative bias): a term of their own, ``pos_bias``.
- Post-LayerNorm models (BERT): the stream is renormalised after each sum; each source's
  contribution is carried through every later norm with its scale frozen, so that the split
  stays exact. Gemma's norms of each attention's output are frozen the same way.

Memory: a head's terms are formed for a chunk of (query, key) pairs at a time, within
``max_bytes``; an earlier head's contribution is carried as its z (``d_head`` wide) and the
fixed map its W_O and the frozen norms make, never as a ``d_model`` vector per position.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from probe.capture.architectures import architecture, blocks
from probe.capture.head_weights import head_weights
from probe.capture.hookpoints import trace
from probe.capture.names import hook_name
from probe.capture.spec import describe
from probe.errors import ProbeError
from probe.heads import HeadId
from probe.interventions.gradients import memory_budget
from probe.interventions.guard import keeps_model
from probe.interventions.qk_sources import (
    SCALE,
    Reserved,
    first_stream,
    frozen_norm,
    next_stream,
    projected,
    rotation,
    scale_of,
)
from probe.interventions.qk_table import Layer, head_terms

# Architectures whose streams this module knows how to split (the others are refused in one
# line): pre-LayerNorm decoders, post-LayerNorm encoders with an embedding norm, T5's encoder.
SPLITS = ("bert", "roberta", "distilbert", "electra", "gpt2", "gpt_neox", "opt", "llama",
          "mistral", "qwen2", "gemma2", "t5")  # fmt: skip
# Bytes per row of the returned table (codes, positions and the float), for the budget check.
ROW_BYTES = 40


@keeps_model
@torch.no_grad()
def qk_attribution(
    model: nn.Module,
    inputs: Mapping[str, Any] | torch.Tensor,
    heads: Sequence[tuple[int, int]] | None = None,
    *,
    query_positions: int | Sequence[int] | None = None,
    key_positions: int | Sequence[int] | Mapping[int, int | Sequence[int]] | None = None,
    top: int | None = None,
    max_bytes: int | None = None,
) -> pd.DataFrame:
    """Split each chosen attention score into what wrote its query times what wrote its key.

    For head h of layer L and query i, key j, the pre-softmax score s_ij is split into terms
    ``q_a(i) · k_b(j) · scaling``, one per query-side source a and key-side source b, which
    sum to s_ij. Sources: ``embed``, ``pos_embed`` (where the model adds one; BERT's
    ``token_type_embed``), each earlier head ``"L-H"``, each earlier MLP ``"mlpL"``, and the
    biases, each its own row: the norms' (``ln1_biasL``, ``ln2_biasL``, ``embed_ln_bias``), the
    attention outputs' (``attn_biasL``) and the query and key projections' (``b_Q``, ``b_K``);
    T5's relative position bias is the term ``pos_bias`` (both sources). Norm scales are frozen
    at the clean run's values (TransformerLens's ``apply_ln_to_stack``), which makes the split
    linear and exact; rotary queries and keys are rotated part by part; under grouped-query
    attention each query head meets the key head it reads; Gemma 2's soft cap is left out (the
    split is of the score before it).

    Parameters
    ----------
    model : transformers.PreTrainedModel
        One of ``SPLITS``, in eval mode; an encoder-decoder model's encoder self-attention. It is
        left exactly as it was (hooks removed, even on error).
    inputs : mapping or torch.Tensor
        What the model is called with (a tokenizer's output, with ``attention_mask`` for a
        padded batch; T5 also needs ``decoder_input_ids``), or input ids ``[batch, pos]``.
    heads : sequence of (layer, head), optional
        The heads to split (default: every head).
    query_positions : int or sequence of int, optional
        The queries, the same for every input (default: every position that is not padding).
    key_positions : int, sequence of int, or mapping, optional
        Default: for each head and query, the key it attends to most. An int or sequence: each
        of those keys for every query. A mapping ``{query: key or keys}``: those pairs (then
        ``query_positions`` is its keys).
    top : int, optional
        Keep the ``top`` largest terms (by magnitude) of each score and put the rest in one row
        (``query_source`` and ``key_source`` ``"rest"``), so that each score's rows still sum to
        it. Default: every term (refused where the table would not fit ``max_bytes``).
    max_bytes : int, optional
        The memory budget (default: half the memory free on the model's device, as the other
        interventions): the terms are formed a head and a chunk of pairs at a time within it.

    Returns
    -------
    pandas.DataFrame
        One row per term: ``input`` (the row of the batch), ``layer``, ``head``, ``query_pos``,
        ``key_pos``, ``query_source``, ``key_source``, ``contribution``. ``attrs["scores"]``
        has one row per score (input, layer, head, query_pos, key_pos): ``score`` (before any
        mask or soft cap, from the captured queries and keys: what the terms sum to),
        ``captured`` (``hook_attn_scores``: after the mask and Gemma 2's cap), ``top10_share``
        (the share of the score its ten largest terms, by magnitude, sum to), and the largest
        query-side and key-side source (a side's terms summed over the other side's sources:
        the score the source gives through its side with the other side whole), ``query_top``,
        ``query_top_contribution``, ``key_top``, ``key_top_contribution``.
        ``attrs["conventions"]`` says how norms, rotation, soft caps and biases are treated.

    Raises
    ------
    ValueError
        Naming the argument: a head the model does not have, a position out of range, a key
        after its query in a causal model, ``top`` below 1.
    ProbeError
        A model probe cannot trace, or whose stream this function cannot split (a fused
        [Q | K | V] projection such as Phi-3's, query and key norms, an embedding projection);
        a table that does not fit ``max_bytes`` (pass ``top``).

    Examples
    --------
    >>> terms = probe.qk_attribution(model, batch, heads=[(1, 1)])
    >>> terms.groupby("key_source", observed=True).contribution.sum().nlargest(3)
    """
    spec = describe(model)  # a model probe cannot trace is refused here
    attention = spec.attention()
    _check_model(model, spec)
    batch = _batch(inputs)
    if spec.encoder_decoder and "decoder_input_ids" not in batch:
        raise ValueError("inputs: an encoder-decoder model needs decoder_input_ids too")
    T = batch["input_ids"].shape[1]
    chosen = _heads(heads, attention.n_layers, attention.n_heads)
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 1):
        raise ValueError(f"top must be a whole number of at least 1, not {top!r}")
    positions = _positions(query_positions, key_positions, T, spec.causal)
    budget = memory_budget(model, max_bytes)
    last = max(layer for layer, _ in chosen)
    cache, rotations = _capture(model, batch, attention.name, last, attention.rotary)
    return _split(model, spec, cache, rotations, batch, chosen, positions, top, budget)


def _check_model(model: nn.Module, spec) -> None:
    kind = spec.model_type
    arch = architecture(model)
    if arch.fused == "linear":
        raise ProbeError(
            f"qk_attribution cannot split {kind}'s fused [Q | K | V] projection into per-head "
            "query and key maps; use a model with separate or GPT-2-style projections"
        )
    if arch.q_norm:
        raise ProbeError(f"qk_attribution does not split {kind}'s query and key norms yet")
    if kind not in SPLITS or getattr(model.base_model, "embeddings_project", None) is not None:
        raise ProbeError(
            f"qk_attribution does not split {kind}'s residual stream (supported: "
            f"{', '.join(SPLITS)}; ELECTRA only with its embeddings as wide as its stream)"
        )


def _batch(inputs: Mapping[str, Any] | torch.Tensor) -> dict[str, Any]:
    if isinstance(inputs, torch.Tensor):
        inputs = {"input_ids": inputs}
    if not isinstance(inputs, Mapping) or "input_ids" not in inputs:
        raise TypeError("inputs must be a tensor of input ids or a mapping with input_ids")
    batch = dict(inputs)
    ids = batch["input_ids"]
    if not isinstance(ids, torch.Tensor) or ids.dim() not in (1, 2) or ids.numel() == 0:
        raise ValueError("inputs: input_ids must be a non-empty tensor [pos] or [batch, pos]")
    if ids.dim() == 1:
        batch = {k: v[None] if isinstance(v, torch.Tensor) and v.dim() == 1 else v
                 for k, v in batch.items()}  # fmt: skip
    return batch


def _heads(heads, n_layers: int, n_heads: int) -> list[HeadId]:
    if heads is None:
        return [HeadId(layer, head) for layer in range(n_layers) for head in range(n_heads)]
    if isinstance(heads, tuple) and len(heads) == 2 and all(isinstance(h, int) for h in heads):
        heads = [heads]  # one head
    chosen = []
    for h in heads:
        try:
            layer, head = (int(x) for x in h)
        except (TypeError, ValueError):
            raise ValueError(f"heads: {h!r} is not a (layer, head) pair") from None
        if not (0 <= layer < n_layers and 0 <= head < n_heads):
            raise ValueError(
                f"heads: ({layer}, {head}) does not exist; the model has {n_layers} layers of "
                f"{n_heads} heads (0-based)"
            )
        chosen.append(HeadId(layer, head))
    if not chosen:
        raise ValueError("heads: give at least one (layer, head), or None for every head")
    return sorted(set(chosen))


def _positions(query_positions, key_positions, T: int, causal: bool):
    """The queries (None: every unpadded one of each input), the keys (None: each query's
    most-attended key, per head), the pairs asked for (or None) and whether keys after their
    query are left out."""

    def listed(value, name) -> list[int]:
        values = [value] if isinstance(value, int | np.integer) else list(value)
        for p in values:
            if isinstance(p, bool) or not isinstance(p, int | np.integer):
                raise TypeError(f"{name} must be ints, not {p!r}")
            if not 0 <= p < T:
                raise ValueError(f"{name}: position {p} is out of range; the inputs have {T}")
        return [int(p) for p in values]

    queries = keys = pairs = None
    if isinstance(key_positions, Mapping):
        if query_positions is not None:
            raise ValueError("give the queries once: as key_positions' keys or query_positions")
        pairs = [(q, k) for q, ks in key_positions.items() for k in listed(ks, "key_positions")]
        listed([q for q, _ in pairs], "key_positions' queries")
        if not pairs:
            raise ValueError("key_positions: no (query, key) pair to split")
    else:
        if query_positions is not None:
            queries = listed(query_positions, "query_positions")
        if key_positions is not None:
            keys = listed(key_positions, "key_positions")
        if queries is not None and keys is not None:
            pairs = [(q, k) for q in queries for k in keys]
    if causal and pairs is not None:
        late = [(q, k) for q, k in pairs if k > q]
        if late:
            q, k = late[0]
            raise ValueError(
                f"key_positions: key {k} is after query {q}, which a causal model's query "
                "cannot see"
            )
    return queries, keys, pairs, causal


def _capture(model, batch, site: str, last: int, rotary: bool):
    """Trace what the split reads, up to layer ``last``; on rotary models also each layer's
    (cos, sin), taken from its attention's call."""
    names = [hook_name(p) for p in ("hook_embed", "hook_pos_embed")]  # the model's own
    names += [hook_name(f"embed_ln.{SCALE}")]
    for layer in range(last + 1):
        names += [hook_name(p, layer, site) for p in ("hook_z", "hook_attn_scores", "hook_pattern",
                  "hook_q", "hook_k", "hook_resid_pre", "hook_mlp_out")]  # fmt: skip
        names += [hook_name(f"{n}.{SCALE}", layer, site) for n in ("ln1", "ln2", "ln1_post")]
        if rotary:
            names += [hook_name(p, layer, site) for p in ("hook_rot_q", "hook_rot_k")]
    rotations: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    handles = []
    if rotary:
        arch = architecture(model, site)
        for layer, block in enumerate(blocks(model, site)[: last + 1]):

            def keep(_module, args, kwargs, layer=layer):
                found = kwargs.get("position_embeddings")
                if found is None:
                    found = next((a for a in args[1:] if isinstance(a, tuple)), None)
                rotations[layer] = found

            module = block.get_submodule(arch.attention)
            handles.append(module.register_forward_pre_hook(keep, with_kwargs=True))
    try:
        wanted = set(names)
        with trace(model, lambda name: name in wanted) as cache:
            model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    return cache, rotations


def _split(model, spec, cache, rotations, batch, chosen, positions, top, budget):
    attention = spec.attention()
    site = attention.name
    arch = architecture(model)
    layers = blocks(model)
    dtype = torch.promote_types(next(model.parameters()).dtype, torch.float32)
    ids = batch["input_ids"]
    B, T = ids.shape
    mask = batch.get("attention_mask")
    valid = torch.ones(B, T, dtype=torch.bool) if mask is None else mask.bool().cpu()
    relative = spec.model_type == "t5"
    position_bias = cache[hook_name("hook_pos_embed")].to(dtype) if relative else None

    stream = first_stream(model, spec, cache, dtype, ids)
    rows: list[dict[str, np.ndarray]] = []
    scores: list[dict[str, np.ndarray]] = []
    names: dict[str, int] = {}
    last = chosen[-1].layer
    reserved = Reserved()
    for layer, weights in enumerate(head_weights(model)):
        if layer > last:
            break
        block = layers[layer]
        here = [h.head for h in chosen if h.layer == layer]
        if here:
            ln1 = None
            if not arch.post_ln:  # folded into the projections (folded), not applied here
                scale = scale_of(cache, "ln1", layer, site)
                ln1 = frozen_norm(block.get_submodule(arch.ln1), scale, dtype)
            read = stream.stacked()
            module = block.get_submodule(arch.attention)
            rotate = rotation(module, rotations.get(layer), dtype) if attention.rotary else None
            found = _layer_terms(cache, site, layer, here, weights, read, ln1, rotate, module,
                                 valid, positions, top, budget, dtype, position_bias,
                                 names, last, reserved)  # fmt: skip
            rows += found[0]
            scores += found[1]
        if layer == last:
            break
        stream = next_stream(model, arch, cache, site, layer, block, weights, stream, dtype)

    table = _table(rows, scores, names)
    table.attrs["conventions"] = {
        "norms": "each norm's scale frozen at the clean run's value (TransformerLens's "
        "apply_ln_to_stack), its bias a source of its own; post-LayerNorm models' later norms "
        "frozen the same way",
        "rotary": attention.rotary and "each source's query and key part rotated as the whole",
        "softcap": getattr(model.config, "attn_logit_softcapping", None) is not None
        and "the split is of the score before the soft cap (attrs['scores'].captured is after)",
        "position_bias": relative and "T5's relative position bias: the term pos_bias",
        "scaling": "each term is q_a(i) · k_b(j) times the attention's own scaling",
    }
    table.attrs["max_bytes"] = budget
    return table


def _table(rows, scores, names) -> pd.DataFrame:
    """The chunks' rows as one table, its sources categorical, and the scores in its attrs."""
    sources = pd.CategoricalDtype(list(names))
    table = pd.DataFrame({
        key: np.concatenate([r[key] for r in rows]) if rows else np.array([], dtype=np.int64)
        for key in ("input", "layer", "head", "query_pos", "key_pos", "query_source",
                    "key_source", "contribution")
    })  # fmt: skip
    for side in ("query_source", "key_source"):
        table[side] = pd.Categorical.from_codes(table[side].astype(np.int64), dtype=sources)
    table.attrs["scores"] = pd.DataFrame(
        {key: np.concatenate([s[key] for s in scores]) for key in scores[0]} if scores else {}
    )
    return table


def _layer_terms(cache, site, layer, here, weights, read, norm, rotate, module, valid, positions,
                 top, budget, dtype, position_bias, names, last, reserved):  # fmt: skip
    """One layer's chosen heads: the rows of the table and of its scores. Each source's part of
    every query and key asked for is projected once for a group of heads (as many as fit half
    the budget), then each head's terms are formed a chunk of pairs at a time."""
    q_ref = cache[hook_name("hook_rot_q" if rotate else "hook_q", layer, site)].to(dtype)
    q_consts, k_consts = _constants(norm, weights, layer, dtype)
    q_names, k_names = [*read.names, *q_consts], [*read.names, *k_consts]
    extra = ["pos_bias"] if position_bias is not None else []
    for name in [*q_names, *k_names, *extra, *(["rest"] if top else [])]:
        names.setdefault(name, len(names))
    at = Layer(
        layer, q_ref, cache[hook_name("hook_rot_k" if rotate else "hook_k", layer, site)].to(dtype),
        cache[hook_name("hook_attn_scores", layer, site)],
        float(getattr(module, "scaling", q_ref.shape[-1] ** -0.5)), weights.kv_head, q_names,
        k_names, torch.tensor([names[n] for n in q_names]),
        torch.tensor([names[n] for n in k_names]), names, top, position_bias,
    )  # fmt: skip
    Sq, Sk = len(q_names), len(k_names)
    n_terms = Sq * Sk + len(extra)
    size = torch.finfo(dtype).bits // 8
    left, per_pair, per_row, per_head_row = _sizes(read, Sq, Sk, n_terms, weights, size, budget,
                                                   layer)  # fmt: skip
    pattern = cache[hook_name("hook_pattern", layer, site)]
    pairs_of = {head: _pairs_of(pattern[:, head], valid, positions) for head in here}
    for head, (b, _, _) in pairs_of.items():
        _check_table(len(b) * (min(n_terms, top + 1) if top else n_terms), budget, layer, head)
    most = max(len(p[0]) for p in pairs_of.values())
    maps = size * 2 * len(read.head_names) * weights.W_Q.shape[2] ** 2  # per head of a group
    group = max(1, min(len(here), (left // 2) // max(1, per_head_row * most + maps)))
    T = valid.shape[1]
    # A side's buffer, reserved for the most any layer up to the last can need (each later one
    # adds at most its heads and five more sources: its attention's and norms' biases, its MLP)
    more, per_source = (last - layer) * (weights.n_heads + 5), valid.numel() * weights.W_Q.shape[2]
    sides = (("q", Sq, weights.n_heads), ("k", Sk, len(weights.W_K)))
    q_space, k_space = (partial(reserved.empty, side, bound=(S + more) * per_source * heads,
                                limit=(left // 2) // size) for side, S, heads in sides)  # fmt: skip
    for start in range(0, len(here), group):
        heads = here[start : start + group]
        kvs = sorted({int(weights.kv_head[h]) for h in heads})
        b = torch.cat([pairs_of[h][0] for h in heads])
        q_rows, q_at = torch.unique(b * T + torch.cat([pairs_of[h][1] for h in heads]),
                                    return_inverse=True)  # fmt: skip
        k_rows, k_at = torch.unique(b * T + torch.cat([pairs_of[h][2] for h in heads]),
                                    return_inverse=True)  # fmt: skip
        chunk = max(1, (left // 2) // max(1, per_row + per_head_row * len(heads)))
        # The scaling on the query side: once a row, not once a term (d_head / Sk times fewer)
        Q = projected(read, q_rows, T, weights.W_Q[heads].to(dtype) * at.scaling,
                       [c[heads] * at.scaling for c in q_consts.values()], norm, rotate,
                       chunk, q_space)  # fmt: skip
        K = projected(read, k_rows, T, weights.W_K[kvs].to(dtype),
                       [c[kvs] for c in k_consts.values()], norm, rotate, chunk,
                       k_space)  # fmt: skip
        pair_chunk = max(1, (left - (Q.numel() + K.numel()) * size) // per_pair)
        taken = 0
        for n, head in enumerate(heads):
            found = pairs_of[head]
            mine = slice(taken, taken + len(found[0]))
            taken += len(found[0])
            kv = kvs.index(int(weights.kv_head[head]))
            parts = Q[:, :, n].transpose(0, 1), K[:, :, kv].transpose(0, 1)  # [rows, source, d]
            head_terms(at, head, *parts, found, q_at[mine], k_at[mine], pair_chunk)
    return at.rows, at.scores


def _constants(norm, weights, layer, dtype) -> tuple[dict, dict]:
    """The constant rows of each side, ``[head, d_head]`` each: the norm's bias through the
    projection, and the projection's."""
    q_consts, k_consts = {}, {}
    if norm is not None and norm.bias is not None:
        q_consts[f"ln1_bias{layer}"] = torch.einsum("d,hdk->hk", norm.bias, weights.W_Q.to(dtype))
        k_consts[f"ln1_bias{layer}"] = torch.einsum("d,hdk->hk", norm.bias, weights.W_K.to(dtype))
    if weights.b_Q.any():
        q_consts["b_Q"] = weights.b_Q.to(dtype)
    if weights.b_K.any():
        k_consts["b_K"] = weights.b_K.to(dtype)
    return q_consts, k_consts


def _sizes(read, Sq, Sk, n_terms, weights, size, budget, layer):
    """What a layer holds: the budget left beside its stacked sources, and the bytes per pair
    of a chunk, per row projected and per head and row projected."""
    d_model, d_head = weights.W_Q.shape[1:]
    held = read.dense + read.z + read.gain + read.basis + read.bias_gain
    fixed = sum(x.numel() * x.element_size() for x in held)
    # Per pair of a chunk: its gathered parts, the terms and their magnitudes, order and rows.
    per_pair = size * ((Sq + Sk) * d_head + 4 * n_terms)
    # Per row projected: the dense sources gathered (a chunk at a time), and per head its parts.
    per_row = size * len(read.dense_names) * d_model
    per_head_row = size * (Sq + Sk) * d_head
    smallest = fixed + 2 * per_pair + 2 * (per_row + per_head_row)
    if budget < smallest:
        raise ProbeError(
            f"max_bytes={budget:,} is too small for layer {layer}'s sources; give at least "
            f"max_bytes={smallest:,}"
        )
    return budget - fixed, per_pair, per_row, per_head_row


def _check_table(rows: int, budget: int, layer: int, head: int) -> None:
    if rows * ROW_BYTES > budget:
        raise ProbeError(
            f"the table would hold {rows:,} rows for head {layer}-{head} alone "
            f"({rows * ROW_BYTES / 2**20:,.0f} MiB), over max_bytes={budget:,}; pass top=10 "
            "(each score's ten largest terms and the rest in one row), or fewer heads or "
            "positions"
        )


def _pairs_of(pattern, valid, positions):
    """Rows (input, query, key) of one head, ``[pairs]`` each: the pairs asked for in every
    input; else each query (every unpadded one by default) with each key asked for (in a causal
    model, those it can see) or with the key this head attends to most."""
    queries, keys, pairs, causal = positions
    B = valid.shape[0]
    if pairs is not None:
        qk = torch.tensor(pairs)
        b = torch.arange(B).repeat_interleave(len(qk))
        return b, qk[:, 0].repeat(B), qk[:, 1].repeat(B)
    if queries is None:
        b, i = valid.nonzero(as_tuple=True)
    else:
        q = torch.tensor(queries)
        b, i = torch.arange(B).repeat_interleave(len(q)), q.repeat(B)
    if keys is None:
        return b, i, pattern.float().cpu()[b, i].argmax(-1)
    k = torch.tensor(keys)
    b, i, j = b.repeat_interleave(len(k)), i.repeat_interleave(len(k)), k.repeat(len(i))
    seen = j <= i if causal else torch.ones_like(j, dtype=torch.bool)
    return b[seen], i[seen], j[seen]
