"""Patterns: what heads' attention says, scored and shown.

Head types on repeated sequences and attention sinks (``headtypes``), retrieval heads
(``retrieval``), statistics of one long input without a T × T pattern (``long_context``), and
the interactive viewer (``viewer``).

May import: every other part of probe's library (``capture``, ``inputs``, ``weights``,
``interventions``, ``run``); never ``analyses`` or ``probe.app``.
"""
