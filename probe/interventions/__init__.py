"""Interventions: edit a head's activations and measure the output.

Ablation of chosen heads (``ablation``), activation patching from one input into another
(``patching``), its gradient approximation for every head at once (``attribution``, with the
gradients it reads, ``gradients``), edge attribution and the circuit it finds (``edges``), and
the prompt pairs they run on (``pairs``), all on the hook points of ``capture``.

May import: ``probe``'s foundation modules, ``capture`` and ``probe.attention``.
"""
