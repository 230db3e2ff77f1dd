"""What the ``probe`` command prints: its consoles (``make_console``), the one-line error that
ends a command (``fail``), a command-line mistake click finds in one line too
(``OneLineUsage``), the progress bars of ``probe analyze`` (``run_progress``,
``bars``), the summary of what a run found (``summary``), a path as a link (``link``), and
the one line for an output that cannot be written (``refused``).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.style import Style
from rich.text import Text
from typer.core import TyperGroup

from probe.app.signals import stopping


def make_console(*, stderr: bool = True, quiet: bool = False) -> Console:
    """A console that wraps to the terminal's width, at spaces, and where its output is not a
    terminal (a file, a pipe, a CI log), not at all: a line stays one line, whatever its length
    (rich would cut it at 80 columns, mid-phrase)."""
    console = Console(stderr=stderr, quiet=quiet)
    console.soft_wrap = not console.is_terminal
    return console


err = make_console()  # an error is one line even on a terminal (fail): whole when copied


def fail(message: str, status: int = 1) -> NoReturn:
    """End the command with ``message``, one line on stderr, and exit status ``status``."""
    stopping()  # a further signal is ignored: the error is printed whole, then we exit
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(status)


# The core of the click typer runs on (typer 0.24 and later carry a copy of their own): its
# exceptions are the ones the commands raise.
click = sys.modules[TyperGroup.make_context.__module__]


class UsageLine(click.UsageError):
    """A mistake click found on the command line, shown as probe's own are: one line."""

    def show(self, file=None) -> None:
        where = f"; '{self.ctx.command_path} --help' lists the options" if self.ctx else ""
        message = self.format_message().rstrip(".")
        click.echo(f"error: {message}{where}", file=file, err=file is None)


class OneLineUsage(TyperGroup):
    """The ``probe`` command's group: what click refuses while it reads the command line (an
    unknown option, a value of the wrong type: ``--circuit-resamples 2.5``) is one line naming
    the flag, with its usual exit status 2, where click would print the usage, a hint and the
    error (three lines). ``probe`` alone still prints the help."""

    def make_context(self, *args, **kwargs):
        with _one_line():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx):
        with _one_line():  # the subcommands read their options here
            return super().invoke(ctx)


@contextlib.contextmanager
def _one_line() -> Iterator[None]:
    try:
        yield
    except (UsageLine, getattr(click, "NoArgsIsHelpError", UsageLine)):
        raise  # ``probe`` alone: the help
    except click.UsageError as e:
        raise UsageLine(e.format_message(), e.ctx) from None


def run_progress(console: Console, quiet: bool) -> Progress:
    """The progress bars of ``probe analyze``, drawn only on a terminal and without ``quiet``."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=quiet or not console.is_terminal,
    )


def bars(progress: Progress) -> Callable[[str, int | None], Callable[[Iterable], Iterator]]:
    """``progress``, as the run shows progress (``probe.app.execute.Progress``): a bar per unit
    streamed, advanced by each batch's size (or by the count the batch gives)."""

    def bar(description: str, total: int | None):
        def wrap(batches: Iterable) -> Iterator:
            task = progress.add_task(description, total=total)
            for batch in batches:
                yield batch
                progress.advance(task, len(batch) if batch.progress is None else batch.progress)

        return wrap

    return bar


def link(label: str, path: Path) -> Text:
    """``label`` and ``path``, which a terminal that can opens on a click (a path is text, never
    markup)."""
    return Text.assemble(label, (str(path), Style(link=path.resolve().as_uri())))


def summary(console: Console, path: Path) -> None:
    """What the run found, as each analysis summarises its tables; then the report's path."""
    import analyses
    from probe.app.report import read_report

    run, tables, _ = read_report(path)
    windows = run.get("inputs", {}).get("text", {}).get("windows", 0)
    read = run.get("sentences_read", run["sentences_analysed"])  # none: no treebank was read
    console.print(
        f"[bold]{escape(run['model'])}[/]: "
        + (f"{run['sentences_analysed']} sentences, " if read else "")
        + (f"{windows} corpus windows, " if run.get("corpus") else "")
        + f"{run['layers']} layers x {run['heads']} heads, {run['timings_s']['total']:.1f} s"
    )
    for name in run["analyses"]:
        cls = analyses.get(name)
        answer = cls.answer(tables, run)
        if answer is not None:  # what the page opens with, first
            heads = ", ".join(f"{layer}-{head}" for layer, head in answer.heads)
            console.print(f"{name}: {answer.text}" + (f" {heads}" if heads else ""),
                          highlight=False, markup=False)  # fmt: skip
        for line in cls.summary(tables):
            console.print(f"{name}: {line}", highlight=False, markup=False)
    counts = tables["heads"].roles.str.split(";").explode().loc[lambda r: r != ""].value_counts()
    if len(counts):
        console.print("roles: " + ", ".join(f"{n} {role}" for role, n in counts.items()))
    console.print(link("report: ", path / "index.html"))


def writing_stdout(e: OSError) -> bool:
    """Whether ``e`` came from writing to stdout (click's ``echo``, rich's console), not from
    the command's own work: a frame where it was raised holds stdout, or its ``write``."""
    out = {id(sys.stdout), id(getattr(sys.stdout, "buffer", None)), id(sys.__stdout__)}
    frames = []
    tb = e.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in frames[-3:]:  # the write, and the two calls around it
        for value in frame.f_locals.values():
            if id(value) in out or id(getattr(value, "__self__", None)) in out:
                return True
    return False


def refused(e: OSError) -> NoReturn:
    """One line for an output that cannot be written, the unwritten rest dropped so that the
    interpreter's own last flush cannot print a traceback of its own."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())  # what stdout holds goes nowhere, without an error
        os.close(null)
        sys.stdout.flush()
    reason = e.strerror or str(e)
    with contextlib.suppress(OSError):
        os.write(2, f"error: could not write to standard output: {reason}\n".encode())
    raise SystemExit(1)
