"""The app: the ``probe`` command (``start``, its answers to signals ``signals``, its commands
``cli``, the options analyze and timeline share ``command_options``, what they print
``console``), a run of the analyses from plan to report (``analyze``: its settings and checks
``plan``, ``execute``, its run card ``card``, ``publish``), the report folder, its page and
tables (``output``, ``folder``, ``tables``, ``report``, ``page``, ``examples``, ``findings``),
``probe compare``, ``probe figures``, ``probe experiment`` (``experiment``, ``training``,
``answers``), and ``probe timeline`` (its plan and integrity ``timeline``, its run
``timeline_run``, its loss ``timeline_loss``, its tables ``timeline_tables``, its outputs
``timeline_publish``, its page ``timeline_page`` and seaborn figures ``timeline_paper``;
compare's per-head change, ``changes``). The notebook figures, ``probe.plot``, belong to the
app too; they live at ``probe/plot.py`` so that ``from probe import plot`` finds them.

May import: every part of probe's library and the analyses (their registry); nothing imports it
but ``probe.plot``.
"""
