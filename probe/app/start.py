"""The ``probe`` command's first lines: a signal that arrives while the command starts ends it
in one line with the shell's status, as one that arrives later does, instead of a traceback from
the middle of an import or a silent end (``probe.app.signals``). Then ``probe.app.cli`` runs.
"""

from __future__ import annotations

from probe.app.signals import answer_start


def command() -> None:
    """The installed ``probe`` command: ``probe.app.cli.command``, started as above."""
    answer_start()
    from probe.app.cli import command as cli_command

    cli_command()
