"""The app: the ``probe`` command (``cli``), a run of the analyses from plan to report (``run``),
the report folder, its page and tables (``output``, ``folder``, ``tables``, ``report``,
``examples``, ``findings``), ``probe compare``, ``probe figures`` and ``probe.plot``, and
``probe experiment`` (``experiment``, ``training``, ``answers``).

May import: every part of probe's library and the analyses (their registry); nothing imports it
but the front door's ``probe.plot``, on first use.
"""
