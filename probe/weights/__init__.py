"""Weights: what each head does, read from its weights alone.

The spectra of every head's W_Q W_Kᵀ and W_V W_O (``spectra``), the copying score of its full
OV circuit (``copying``) and the checkpoint tensors it needs (``checkpoint``).

May import: ``probe``'s foundation modules, ``capture`` and ``probe.attention``.
"""
