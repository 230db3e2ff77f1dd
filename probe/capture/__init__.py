"""Capture: hook points and what they read from a model.

Holds the hook vocabulary (``names``, TransformerLens's), every fact kept about each supported
architecture, one row per model type (``architectures``), its attention weights split into heads
(``head_weights``), the model's description derived from both (``spec``), the hook points on
probe's own modules (``hookpoints``) and those mirrored onto Hugging Face models: attached for a
block (``mirror``), where they go (``sites``), the hooks that compute them (``hooks``), probe's
attention and mask functions (``attention_function``), a norm's arithmetic (``norms``) and the
ungrouped and mixed modes (``modes``); what a trace captures (``cache``), and attention patterns
computed in blocks of query rows for long inputs (``rows``), each block's softmax and statistics
in one pass of a C kernel built on first use (``fused``).

May import: ``probe``'s foundation modules (``errors``, ``lazy``, ``options``, ``numerics``…), and
no other part of probe.
"""
