"""``probe figures REPORT``: the figures of every analysis in a report (or of a comparison, or
of a timeline: ``probe.app.timeline_paper``), drawn with seaborn for papers, into
``REPORT/figures`` by default.

The figures are those each analysis declares (``Analysis.plots``; a comparison's are
``probe.app.compare.PLOTS``), drawn from the report's tables alone: no model is loaded. The
folder is written whole or not at all, and replaced only with ``--overwrite`` and only if it
holds figures probe drew (as ``probe analyze`` writes a report: ``probe.app.output``). A report
keeps one figures folder: a second format adds its files beside the first's, and the files of a
format already there are replaced only with ``--overwrite`` (which replaces the whole folder).
The report's lock is held from the first table read to the last file written, so that no figure
is drawn from tables that ``probe analyze --overwrite`` is replacing.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from probe.app.output import check_free, is_report, locked, refuse_inputs, reserved
from probe.errors import ProbeError

if TYPE_CHECKING:
    import pandas as pd

    from analyses.figures import Plot

FORMATS = ("pdf", "svg", "png")
# Fixed metadata, so that the same tables give the same files.
METADATA = {"pdf": {"CreationDate": None}, "svg": {"Date": None}, "png": {}}


def declared(folder: Path) -> tuple[list[tuple[str, Plot]], dict[str, pd.DataFrame]]:
    """The figures a report, comparison or timeline folder declares, each with its analysis's
    name (or ``compare``, ``timeline``), and its tables.

    Raises
    ------
    ProbeError
        When the folder is neither a report nor a comparison, or a table cannot be read.
    """
    import analyses

    if (folder / "compare.json").is_file():
        import pandas as pd

        from probe.app.compare import PLOTS

        tables = {}
        for path in sorted(folder.glob("compare_*.csv")):
            try:
                tables[path.stem] = pd.read_csv(path)
            except (OSError, ValueError) as e:
                raise ProbeError(f"{path} cannot be read ({str(e).splitlines()[0]})") from None
        return [("compare", plot) for plot in PLOTS], tables
    if (folder / "timeline.csv").is_file():
        from probe.app.timeline_paper import plots, read_tables

        tables = read_tables(folder)
        return [("timeline", plot) for plot in plots(tables)], tables
    from probe.app.report import read_report

    run, tables, _ = read_report(folder)
    plots = [(name, plot) for name in run["analyses"] for plot in analyses.get(name).plots]
    return plots, tables


def write(report: Path, out: Path | None = None, format: str = "pdf",
          overwrite: bool = False) -> tuple[Path, list[str]]:  # fmt: skip
    """Draw every figure of ``report`` that its tables hold into ``out`` (default
    ``report/figures``), one ``<analysis>-<figure>.<format>`` file each.

    Returns
    -------
    The folder, and the names of the files written.

    Raises
    ------
    ProbeError
        On an unknown format, a folder that is no report, nothing to draw, or an ``out`` that
        exists without ``overwrite`` (checked before anything is drawn).
    """
    if format not in FORMATS:
        raise ProbeError(f"unknown --format {format!r}; use one of {', '.join(FORMATS)}")
    if not report.is_dir():
        raise ProbeError(f"{report} is not a folder; give a folder written by probe analyze")
    out = report / "figures" if out is None else out
    refuse_inputs(out, [report])
    kept = [] if overwrite else _other_formats(out, format)
    # with files of another format there, the folder is replaced by one that holds them too
    check_free(out, overwrite or bool(kept), kind="figures")
    with locked(report, reading=True):  # not while `analyze --overwrite` replaces the report
        return _draw(report, out, format, overwrite, kept)


def _draw(
    report: Path, out: Path, format: str, overwrite: bool, kept: list[Path]
) -> tuple[Path, list[str]]:
    plots, tables = declared(report)
    drawn = [(name, plot) for name, plot in plots if plot.present(tables)]
    if not drawn:
        raise ProbeError(f"{report} holds no table that a figure is drawn from")
    import matplotlib

    matplotlib.use("Agg")  # files only: no window, whatever the environment says
    import matplotlib.pyplot as plt

    from analyses.paper import draw_figure, theme

    names = []
    with reserved(out, overwrite or bool(kept), kind="figures") as staging:
        for path in kept:
            shutil.copy2(path, staging / path.name)
        for name, plot in drawn:
            figure = draw_figure(plot, tables)
            names.append(f"{name}-{plot.id}.{format}")
            with theme():  # the file's settings (fonts kept as text) apply when it is saved
                figure.savefig(staging / names[-1], format=format, metadata=METADATA[format])
            plt.close(figure)
    return out, names


def _other_formats(out: Path, format: str) -> list[Path]:
    """The figure files of other formats in a figures folder probe wrote, which a new format's
    files join; none where ``out`` is no such folder, or already holds ``format``'s files (those
    are replaced only with ``--overwrite``)."""
    if not is_report(out):
        return []
    files = [p for p in sorted(out.iterdir()) if p.is_file() and not p.name.startswith(".")]
    suffixes = {p.suffix.removeprefix(".") for p in files}
    if format in suffixes or not suffixes <= set(FORMATS):
        return []
    return files
