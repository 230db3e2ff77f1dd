"""Weights: what each head does, read from its weights alone.

The spectra of every head's W_Q W_Kᵀ and W_V W_O (``spectra``), the copying score of its full
OV circuit (``copying``), Q-, K- and V-composition between heads of different layers
(``composition``) and the checkpoint tensors they need (``checkpoint``).

May import: ``probe``'s foundation modules, ``capture`` and ``probe.attention``.
"""
