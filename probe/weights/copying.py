"""The copying score of every attention head, from its weights (Elhage et al. 2021, "A
Mathematical Framework for Transformer Circuits").

A head's full OV circuit maps the token it attends to onto the logits it adds (layer norms and
biases left out):

    W_E W_V^h W_O^h W_U                    [vocab, vocab]

A head that copies maps each token onto itself, so the circuit's eigenvalues are positive:

    copying(h) = Σ Re λ / Σ |λ|    over the eigenvalues λ of W_E W_V^h W_O^h W_U

is 1 for a head that copies every token it attends to, -1 for one that suppresses it, and near 0
for a rotation or an unrelated map.

The vocab x vocab matrix is never formed. AB and BA have the same nonzero eigenvalues, so with
A = W_E W_V^h and B = W_O^h W_U they are those of the d_head x d_head matrix

    W_O^h (W_U W_E) W_V^h,

whose only product over the vocabulary, W_U W_E [d_model, d_model], is taken once per model (in
chunks of the vocabulary) and shared by every head of every layer. The cost is vocab·d_model²
once, then d_model²·d_head per key/value head and d_model·d_head² per query head.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from enum import StrEnum

import pandas as pd
import torch
from torch import nn

from probe.capture.head_weights import iter_head_weights, materialized
from probe.capture.names import Attention, Stack
from probe.capture.spec import describe
from probe.errors import ProbeError

COLUMNS = ["attention", "layer", "head", "copying", "unembedding"]


class Unembedding(StrEnum):
    """What stood for W_U: the ``unembedding`` column of ``copying_scores``."""

    TIED = "tied"  # the model's output embedding, which is its input embedding
    OUTPUT_EMBEDDING = "output_embedding"  # the model's own: lm_head, embed_out, an MLM decoder
    INPUT_EMBEDDING_TRANSPOSED = "input_embedding_transposed"  # none reads the stream: W_Eᵀ


# Linear maps between an architecture's embeddings and its residual stream, relative to the base
# model: into the stream after W_E, and out of it before the output embedding.
_PROJECTIONS = {
    "albert": ("encoder.embedding_hidden_mapping_in", ""),
    "electra": ("embeddings_project", ""),
    "opt": ("decoder.project_in", "decoder.project_out"),
}


@torch.no_grad()
def embedding_product(W_E: torch.Tensor, W_U: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """W_U W_E: the one product over the vocabulary.

    Parameters
    ----------
    W_E : ``[vocab, d_in]``
        The input embedding.
    W_U : ``[d_out, vocab]``
        The unembedding (a transposed view of an output embedding's weight is fine).
    chunk : int
        Vocabulary rows per product: products in float32 (float64 for float64 weights), summed
        in float64, so a bfloat16 model is converted ``chunk`` rows at a time.

    Returns
    -------
    ``[d_out, d_in]``, float32 (float64 for float64 weights)
    """
    dtype = torch.promote_types(W_E.dtype, torch.float32)
    W_UE = torch.zeros(W_U.shape[0], W_E.shape[1], dtype=torch.float64, device=W_E.device)
    for start in range(0, W_E.shape[0], chunk):
        rows = slice(start, start + chunk)
        W_UE += W_U[:, rows].to(dtype) @ W_E[rows].to(dtype)
    return W_UE.to(dtype)


@torch.no_grad()
def ov_eigenvalues(W_UE: torch.Tensor, W_V: torch.Tensor, W_O: torch.Tensor) -> torch.Tensor:
    """The eigenvalues of each head's full OV circuit W_E W_V^h W_O^h W_U, taken from the
    d_head x d_head W_O^h (W_U W_E) W_V^h.

    Parameters
    ----------
    W_UE : ``[d_model, d_model]``
        W_U W_E (``embedding_product``).
    W_V : ``[n_kv_heads, d_model, d_head]``
        One layer's value weights. With grouped-query attention (fewer key/value heads than
        query heads) query head h reads value head h // (n_heads / n_kv_heads).
    W_O : ``[n_heads, d_head, d_model]``
        The layer's output weights.

    Returns
    -------
    ``[n_heads, d_head]`` complex128
        The circuit's nonzero eigenvalues and as many zeros as make d_head. Products in float32
        (float64 for float64 weights), the eigenproblem in float64 on the CPU.
    """
    dtype = torch.promote_types(W_O.dtype, torch.float32)
    W_UE, W_V, W_O = W_UE.to(W_O.device, dtype), W_V.to(dtype), W_O.to(dtype)
    # (W_U W_E W_V)ᵀ = W_Vᵀ (W_U W_E)ᵀ: one [n_kv_heads·d_head, d_model] @ [d_model, d_model].
    UEV = (W_V.mT @ W_UE.mT).mT  # [n_kv_heads, d_model, d_head]
    # The query heads that read one value head (n_heads / n_kv_heads of them, in a row) as one.
    n_heads, d_head, d_model = W_O.shape
    grouped = W_O.reshape(UEV.shape[0], -1, d_model)  # [n_kv_heads, group·d_head, d_model]
    circuit = (grouped @ UEV).reshape(n_heads, d_head, d_head)  # W_O^h W_U W_E W_V^h
    circuit = circuit.double().cpu()
    with _one_thread():
        return torch.linalg.eigvals(circuit)


def copying_score(eigenvalues: torch.Tensor) -> torch.Tensor:
    """Σ Re λ / Σ |λ| over the last dimension ``[..., n]`` -> ``[...]`` float64; NaN where every
    λ is 0."""
    return eigenvalues.real.sum(-1) / eigenvalues.abs().sum(-1)


def copying(
    W_E: torch.Tensor,
    W_U: torch.Tensor,
    layers: Iterable[tuple[torch.Tensor, torch.Tensor]],
    chunk: int = 8192,
) -> torch.Tensor:
    """The copying score of every head, from the matrices.

    Parameters
    ----------
    W_E : ``[vocab, d_model]``
    W_U : ``[d_model, vocab]``
    layers : iterable of (W_V, W_O)
        Per layer ``W_V`` ``[n_kv_heads, d_model, d_head]`` and ``W_O``
        ``[n_heads, d_head, d_model]``, as ``HeadWeights`` has them; read one at a time, so a
        generator keeps one layer in memory.
    chunk : int
        Vocabulary rows per product (see ``embedding_product``).

    Returns
    -------
    ``[n_layers, n_heads]`` float64
    """
    W_UE = embedding_product(W_E, W_U, chunk)
    return torch.stack([copying_score(ov_eigenvalues(W_UE, W_V, W_O)) for W_V, W_O in layers])


def copying_scores(model: nn.Module, chunk: int = 8192) -> pd.DataFrame:
    """The copying score of every self-attention head of a Hugging Face model.

    W_E is the input embedding of the head's stack, through the linear map into the residual
    stream where the architecture has one (ALBERT, ELECTRA, OPT's ``project_in``). W_U is the
    model's output embedding (``get_output_embeddings``: a language-modelling head, tied or not;
    a masked-LM head's decoder, its transform left out as layer norms are; through OPT's
    ``project_out``); for a model loaded without its head, the head's weight read from its
    checkpoint (an untied W_U is no transpose of W_E: on a Llama whose heads copy, W_Eᵀ gives
    them the opposite sign). Where no unembedding reads the stream, W_Eᵀ stands in, and the
    ``unembedding`` column says so: a checkpoint without a head (a sentence encoder), a
    masked-LM head narrower than the stream (ALBERT, ELECTRA with a smaller embedding), and an
    encoder-decoder model's encoder.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A supported architecture (``probe.capture.architectures.SUPPORTED``). Encoder-decoder
        models:
        the encoder's self-attention (with the encoder's embedding) and the decoder's (with the
        decoder's embedding and the model's output embedding); not cross-attention.
    chunk : int
        Vocabulary rows per product (see ``embedding_product``).

    Returns
    -------
    pandas.DataFrame
        One row per (attention, layer, head), 0-based: ``attention`` (``blocks.attn``,
        ``encoder.attn``, ``decoder.attn``), ``layer``, ``head``, ``copying`` (Σ Re λ / Σ |λ|,
        in [-1, 1]) and ``unembedding``, what stood for W_U (an ``Unembedding``:
        ``tied``, ``output_embedding``, ``input_embedding_transposed``).
    """
    from probe.capture import arguments

    arguments.module(model, "copying_scores")
    arguments.embedded(model, "copying_scores")
    arguments.whole_number(chunk, "chunk", at_least=1)
    rows = []
    for attention in (a.name for a in describe(model).attentions):
        if attention == Attention.CROSS:
            continue
        W_UE, unembedding = _vocabulary(model, Attention(attention), chunk)
        for layer, w in enumerate(iter_head_weights(model, attention)):
            if w.W_O.shape[-1] != W_UE.shape[0]:
                raise ProbeError(
                    f"{attention}: the embeddings reach width {W_UE.shape[0]}, the residual "
                    f"stream is {w.W_O.shape[-1]} wide; copying scores need the map between them"
                )
            scores = copying_score(ov_eigenvalues(W_UE, w.W_V, w.W_O))
            rows += [
                (str(attention), layer, head, float(score), str(unembedding))
                for head, score in enumerate(scores)
            ]
    return pd.DataFrame(rows, columns=COLUMNS)


@torch.no_grad()
def _vocabulary(model: nn.Module, attention: Attention, chunk: int):
    """W_U W_E ``[d_model, d_model]`` for one attention's stream, and what stood for W_U."""
    stack = attention.stack
    part = model
    if stack == Stack.ENCODER:
        part = model.get_encoder()
    elif stack == Stack.DECODER:
        part = model.get_decoder()
    embedding = part.get_input_embeddings()
    # An encoder-decoder model's encoder writes into a stream that no unembedding reads.
    output = None if stack == Stack.ENCODER else model.get_output_embeddings()
    into, out_of = (
        _module(model.base_model, path)
        for path in _PROJECTIONS.get(model.config.model_type, ("", ""))
    )
    with ExitStack() as offloaded:
        for m in (embedding, output, into, out_of):
            if m is not None:
                offloaded.enter_context(materialized(m))
        W_E = embedding.weight  # [vocab, d_embed]
        A_in = None if into is None else into.weight.T  # [d_embed, d_model]
        d_model = W_E.shape[1] if A_in is None else A_in.shape[1]
        A_out = None if out_of is None else out_of.weight.T  # [d_model, d_out]
        weight, tied = _output_weight(model, stack, embedding, output)
        if weight is not None and weight.shape[1] == (d_model if A_out is None else A_out.shape[1]):
            W_U = weight.T  # [d_out, vocab]
            unembedding = Unembedding.TIED if tied else Unembedding.OUTPUT_EMBEDDING
        else:
            W_U = W_E.T  # and A_in's transpose out of the stream, where W_E goes through A_in
            A_out = None if A_in is None else A_in.T
            unembedding = Unembedding.INPUT_EMBEDDING_TRANSPOSED
        W_UE = embedding_product(W_E, W_U, chunk)
        if A_in is not None:
            W_UE = W_UE @ A_in.to(W_UE.dtype)
        if A_out is not None:
            W_UE = A_out.to(W_UE.dtype) @ W_UE
    return W_UE, unembedding


def _output_weight(model: nn.Module, stack: Stack, embedding: nn.Module, output: nn.Module | None):
    """The unembedding's weight ``[vocab, d_out]`` that reads this stack's stream, and whether it
    is the input embedding's: the model's output embedding, or for a model loaded without its
    language-model head, the head the checkpoint holds (``probe.weights.checkpoint``); None where
    there is none (an encoder's stream, a checkpoint without a head)."""
    if stack == Stack.ENCODER:
        return None, False
    if output is not None:
        return output.weight, output.weight is embedding.weight
    from probe.weights.checkpoint import unembedding

    weight, tied = unembedding(model)
    if tied:
        return embedding.weight, True
    return (None if weight is None else weight.to(embedding.weight.device)), False


def _module(base: nn.Module, path: str) -> nn.Module | None:
    """The submodule at ``path``, or None where there is none (OPT without ``project_in``)."""
    try:
        return base.get_submodule(path) if path else None
    except AttributeError:
        return None


@contextmanager
def _one_thread() -> Iterator[None]:
    """LAPACK's eigensolver gains nothing from threads on d_head x d_head matrices, and on a
    busy machine loses much (30x seen on 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
