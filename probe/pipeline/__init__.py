"""The pipeline: a model loaded, a corpus streamed through it, and the work after the batches.

Loading a supported model and its tokenizer (``loading``), streaming batches through it while
each layer's captures reach the analyses (``runner``), and the helper process that fits while the
run finishes (``helper``), and how torch's threads wait (``threads``).

May import: ``probe``'s foundation modules, ``capture``, ``inputs`` and ``probe.attention``.
"""
