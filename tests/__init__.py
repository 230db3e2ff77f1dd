"""probe's tests, laid out like the code: ``<layer>/`` (one folder per part of
``project/test_layers.py``'s table) for each part's unit tests, ``end_to_end/`` for the runs of the
``probe`` command and of the tutorials, ``project/`` for the checks of the code base as a whole,
and ``support/`` for the helpers and model builders the tests import (``conftest.py`` puts it on
the path).

This file makes ``tests`` a package only so that pytest puts the repository's root on the path
for ``conftest.py``, not ``tests/`` itself: there, ``tests/analyses/`` (a folder without an
``__init__.py``) would stand in for the ``analyses`` package wherever the root is not on the path
(``pytest`` run as a script, an editable install). The folders below hold none, so a test module
imports by its file's name, which is unique across the folders."""
