"""Interventions: edit a head's activations and measure the output.

Ablation of chosen heads (``ablation``) and activation patching from one input into another
(``patching``), both on the hook points of ``capture``.

May import: ``probe``'s foundation modules, ``capture`` and ``probe.attention``.
"""
