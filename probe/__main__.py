"""``python -m probe``: the ``probe`` command, as the installed script runs it (a part of the
app, ``probe.app.start``, for all its place at the package's top)."""

from probe.app.start import command

if __name__ == "__main__":
    command()
