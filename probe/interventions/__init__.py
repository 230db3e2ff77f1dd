"""Interventions: edit a head's activations and measure the output.

Ablation of chosen heads (``ablation``; each head's effect ablated alone, many in one pass,
``ablation_rows``), activation patching from one input into another
(``patching``), its gradient approximation for every head at once (``attribution``, with the
gradients it reads, ``gradients``), the graph of edges between components (``graph``), edge
attribution (``edge_scores``, with the gradients at the heads' inputs it multiplies,
``head_input_grads``), exact edge patching (``edge_patching``) and the circuit it finds
(``circuit``; ``edges`` re-exports these for one release), the circuit's stability and
faithfulness (``stability``, ``faithfulness``, with MIB's scores, gathered by ``trust``), the
prompt pairs and metrics they take (``pairs``), why a head attends where it does: each attention
score split into what wrote its query times what wrote its key (``qk``, with the stream's sources
it reads, ``qk_sources``, and the rows of its table, ``qk_table``), and the guard that leaves the
model as it was after every call (``guard``), all on the hook points of ``capture``.

May import: ``probe``'s foundation modules, ``capture`` and ``probe.attention``.
"""
