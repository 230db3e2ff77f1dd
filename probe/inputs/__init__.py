"""Inputs: what the model reads, streamed.

Treebanks (``treebank``) and their downloads (``download``, ``pipes``), plain-text corpora
(``texts``) cut into windows of tokens (``windowing``; a long text in ``pieces``), coreference
documents (``coreference``), the treebank's words aligned to tokens (``alignment``), batches of
them (``corpus``), the input units an analysis declares (``units``), and the one question to the
hub before a model is fetched (``hub``).

May import: ``probe``'s foundation modules; never ``capture`` or any part above it.
"""
