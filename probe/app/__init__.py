"""The app: the ``probe`` command (``cli``), a run of the analyses from plan to report (``run``),
the report folder, its page and tables (``output``, ``folder``, ``tables``, ``report``, ``page``,
``examples``, ``findings``), ``probe compare``, ``probe figures``, ``probe experiment``
(``experiment``, ``training``, ``answers``), and ``probe timeline`` (``timeline``,
``timeline_tables``, ``timeline_page``; compare's per-head change, ``changes``). The notebook
figures, ``probe.plot``, belong to the app too; they live at ``probe/plot.py`` so that
``from probe import plot`` finds them.

May import: every part of probe's library and the analyses (their registry); nothing imports it
but ``probe.plot``.
"""
