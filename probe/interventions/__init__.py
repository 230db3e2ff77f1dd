"""Interventions: edit a head's activations and measure the output.

Ablation of chosen heads (``ablation``), activation patching from one input into another
(``patching``), its gradient approximation for every head at once (``attribution``, with the
gradients it reads, ``gradients``), edge attribution and the circuit it finds (``edges``), the
prompt pairs and metrics they take (``pairs``), why a head attends where it does: each attention
score split into what wrote its query times what wrote its key (``qk``, with the stream's
sources it reads, ``qk_sources``), and the guard that leaves the model as it was after every
call (``guard``), all on the hook points of ``capture``.

May import: ``probe``'s foundation modules, ``capture`` and ``probe.attention``.
"""
