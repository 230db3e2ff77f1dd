"""Capture: hook points and what they read from a model.

Holds the hook vocabulary (``names``, TransformerLens's), where each supported architecture keeps
its attention (``architectures``), the hook points on probe's own modules and mirrored onto
Hugging Face models (``hookpoints``, ``mirror``), what a trace captures (``cache``), and
attention patterns computed in blocks of query rows for long inputs (``rows``), each block's
softmax and statistics in one pass of a C kernel built on first use (``fused``).

May import: ``probe``'s foundation modules (``errors``, ``lazy``, ``options``, ``numerics``…), and
no other part of probe.
"""
