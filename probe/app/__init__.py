"""The app: the ``probe`` command (``cli``), one run of ``probe analyze`` (``run``), the report
(``report``, ``findings``, ``tables``, ``folder``, ``output``, ``examples``), ``probe compare``
(``compare``), the figures (``figures``, and ``plot`` for notebooks) and ``probe experiment heads``
(``experiment``, ``training``, ``answers``). It uses the analyses through their registry.

May import: everything below it (the analyses and the library).
"""
