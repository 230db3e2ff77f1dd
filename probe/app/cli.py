"""The ``probe`` command's commands: ``probe analyze``, ``probe timeline``, ``probe report``,
``probe compare``, ``probe figures`` and ``probe experiment``, each answering a user's mistake
and a signal in one line (``answered``); the console they print to is ``probe.app.console``,
their answers to signals ``probe.app.signals``; the options analyze and timeline share,
``probe.app.command_options``.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import inspect
import json
import logging
import os
import sys
import typing
from collections.abc import Callable, Iterator
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from analyses import REGISTRY, ContractError, defaults
from analyses.vocabulary import Thresholds
from probe.app.analyze import analyze as analyze_run
from probe.app.command_options import settings_of, warmups, with_declared_options
from probe.app.console import (
    OneLineUsage,
    bars,
    fail,
    link,
    make_console,
    refused,
    run_progress,
    summary,
    writing_stdout,
)
from probe.app.plan import Settings, plan
from probe.app.signals import (
    TerminatedError,
    catch_hangups,
    commanded,
    exit_status,
    signal_name,
)
from probe.app.timeline_run import plan_timeline, run_timeline
from probe.distributed import Ranks
from probe.errors import ProbeError
from probe.inputs.hub import bound_waits
from probe.inputs.treebank import BUNDLED_SENTENCES
from probe.options import ATTENTION_BUDGET
from probe.pipeline import helper, threads

app = typer.Typer(
    cls=OneLineUsage,  # click's own refusals in one line too
    help="What does each attention head do? Analyse a model, write a self-contained report.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's help: flags as flags, defaults in full
)


def _version(value: bool) -> None:
    if value:
        from probe import __version__  # light: names are imported on first use

        typer.echo(f"probe {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Show the version and exit."
    ),
) -> None:
    """probe: hook points, weight circuits, syntax and head roles for multi-head attention."""


def _quiet_libraries() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    transformers.logging.disable_progress_bar()


@contextlib.contextmanager
def answered(
    left: str,
    errors: tuple[type[BaseException], ...] = (ProbeError,),
    *,
    interrupted: str = "stopped by SIGINT (Ctrl-C)",
    why: str = "",
    ranked: bool = False,
) -> Iterator[None]:
    """A command's work, answered in one line (``probe.app.console.fail``): SIGTERM and SIGHUP
    unwind it as Ctrl-C does (``catch_hangups``); a user's mistake (``errors``) says what it
    is; a signal says which, ``why`` it may have come, and what it ``left`` ("no report was
    written"), with the shell's exit status. ``ranked``: the message names its process under
    torchrun (``_who``)."""
    catch_hangups()
    try:
        yield
    except errors as e:
        fail(_who(ranked) + str(e))
    except KeyboardInterrupt as e:
        fail(f"{_who(ranked)}{interrupted}; {left}", exit_status(e))
    except TerminatedError as e:
        fail(f"{_who(ranked)}stopped by {e}{why}; {left}", exit_status(e))


def _answers_signals(command: Callable) -> Callable:
    """``command``, with a signal that arrives outside its own answer to one (while it imports
    what it needs, or prints its summary) answered in one line too; the handlers it set are put
    back when it returns (``commanded``: nothing is left bound in a process that goes on)."""

    @functools.wraps(command)
    def answered_outside(*args, **kwargs):
        with commanded():  # from the start's answers (probe.app.start), or the caller's, to these
            try:
                return command(*args, **kwargs)
            except (KeyboardInterrupt, TerminatedError) as e:
                fail(_who() + f"stopped by {signal_name(e)}", exit_status(e))

    return answered_outside


def _who(ranked: bool = True) -> str:
    """``rank 1: `` before a message, under torchrun (every process reports its own)."""
    if not ranked:
        return ""
    ranks = Ranks.from_environment()
    return f"rank {ranks.rank}: " if ranks.size > 1 else ""


def analyze(
    model: str = typer.Option(
        ..., "--model", "-m", help="Alias (bert-base, gpt2, minilm…), hub id or local folder."
    ),
    treebank: list[str] = typer.Option(
        None,
        "--treebank",
        "-t",
        help="CoNLL-U file(s), ud:en_ewt or ud:en_gum [-dev|-test], or sample "
        f"({BUNDLED_SENTENCES['sample']} hand-written sentences); default: UD English EWT dev, "
        f"bundled ({BUNDLED_SENTENCES['ewt-dev']:,} sentences).",
        show_default=False,
    ),
    corpus: str = typer.Option(
        None,
        "--corpus",
        help="Plain text for the analyses that need no annotation (roles, importance, taxonomy's "
        "sinks, cross): a .txt (one text per line), .jsonl, .json, .csv or .parquet file, a "
        "folder of them, or hf:NAME[:CONFIG][@SPLIT] (🤗 datasets); the others read the treebank.",
        show_default=False,
    ),
    text_column: str = typer.Option(
        "text", "--text-column", help="The corpus's column of texts (.jsonl .json .csv .parquet)."
    ),
    max_texts: int = typer.Option(
        None, "--max-texts", min=1, help="Use the corpus's first N texts."
    ),
    context: int = typer.Option(
        None,
        "--context",
        min=2,
        help="Tokens per corpus window; longer texts are cut into consecutive windows "
        "[default: the model's maximum, at most 512].",
        show_default=False,
    ),
    out: Path = typer.Option(
        None,
        "--out",
        "-o",
        help="Output folder; default: reports/<model>, or reports/<model>-<treebank> for "
        "another treebank than the default.",
        show_default=False,
    ),
    max_sentences: int = typer.Option(
        None, "--max-sentences", "-n", min=1, help="Use the first N sentences."
    ),
    batch_size: int = typer.Option(32, "--batch-size", "-b", min=1, help="Sentences per batch."),
    device: str = typer.Option(
        "cpu", "--device", help="cpu, cuda or auto (under torchrun: each process's own GPU)."
    ),
    device_map: str = typer.Option(
        None,
        "--device-map",
        help="Spread a model too large for one device over GPUs, CPU and disk (accelerate): "
        "auto, balanced or sequential.",
    ),
    max_memory: str = typer.Option(
        None, "--max-memory", help="With --device-map: memory per device, e.g. 0=70GiB,cpu=200GiB."
    ),
    offload_folder: Path = typer.Option(
        None, "--offload-folder", help="With --device-map: where layers that fit nowhere go."
    ),
    dtype: str = typer.Option(None, "--dtype", help="float32 (default), float16 or bfloat16."),
    analyses: str = typer.Option(
        None,
        "--analyses",
        "-a",
        help="Comma-separated analyses to run, in this order, of: "
        f"{', '.join(REGISTRY)}; default: {','.join(defaults())}, those that apply to the model.",
        show_default=False,
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the bootstrap, the probe's split and MDS."),
    lm_head: bool = typer.Option(
        False, "--lm-head", help="Load the model's language-model head (importance uses it)."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output folder."),
    revision: str = typer.Option(None, "--revision", help="Hub branch, tag or commit."),
    trust_remote_code: bool = typer.Option(
        False, "--trust-remote-code", help="Run code shipped with the model (only if you trust it)."
    ),
    threshold: list[str] = typer.Option(
        None,
        "--threshold",
        help="Override a role threshold, e.g. --threshold sink=0.5 (repeatable); names: "
        f"{', '.join(Thresholds.names())}.",
        show_default=False,
    ),
    quiet: bool = typer.Option(
        False, "--quiet", "-q", help="No progress bars or summary: only the report's path."
    ),
    attention_budget: str = typer.Option(
        ATTENTION_BUDGET,
        "--attention-budget",
        help="Memory for one block of attention rows (512MiB, 4GiB): analyses that keep sums "
        "read long inputs' patterns a block of query rows at a time.",
    ),
    **options,
) -> None:
    """Run every analysis of every head over a treebank and write an HTML report."""
    given = dict(locals())
    with answered("no report was written", (ProbeError, ContractError), interrupted="interrupted"):
        settings = settings_of(given)
        # before torch is imported: a mistake is answered at once; a pipe given as --treebank
        # is read here, and may be interrupted
        planned = plan(settings)
    threads.settle(context if corpus else None)  # before torch, and before the helper starts
    leader = Ranks.from_environment().leader  # under torchrun, rank 0 speaks and finishes
    if leader:  # while this process imports torch, a helper warms up for the run's end
        helper.start(warmups(planned.classes))
    _run(settings, quiet or not leader)


app.command()(_answers_signals(with_declared_options(analyze)))


def _run(settings: Settings, quiet: bool, work: Callable = analyze_run,
         left: str = "no report was written") -> None:  # fmt: skip
    """Run the analyses with progress bars (none with ``quiet``), answer a user's mistake, an
    interrupt or SIGTERM in one line, and say where the report is. ``work(settings, progress,
    status)`` runs it (``probe timeline``'s, ``left`` what an error leaves)."""
    console = make_console(quiet=quiet)
    progress = run_progress(console, quiet)
    gc.disable()  # until the model is loaded: see probe.app.execute._freeze
    why = (" (the job was cancelled, the terminal closed, or another process of the run failed: "
           "see its error)")  # fmt: skip
    try:
        with answered(left, interrupted="interrupted", why=why, ranked=True):
            bound_waits()  # before the hub client is imported: it reads them once
            _quiet_libraries()  # imports transformers: an interrupt here is answered as any other
            with progress:
                status_task = progress.add_task("starting", total=None)
                path = work(
                    settings,
                    progress=bars(progress),
                    status=lambda message: progress.update(status_task, description=message),
                )
    finally:
        gc.enable()
    if path is None:
        return
    for line in json.loads((path / "run.json").read_text(encoding="utf-8")).get("warnings", []):
        typer.echo(f"warning: {line}", err=True)  # quiet or not: a result to read with care
    if quiet or work is not analyze_run:
        typer.echo(f"{'report' if work is analyze_run else 'timeline'}: {path / 'index.html'}")
    else:
        summary(console, path)


def timeline(
    source: str = typer.Argument(
        ..., help="A folder of checkpoint-N/ (step-N/, stepN/) folders, or a hub model."
    ),
    revisions: str = typer.Option(
        None,
        "--revisions",
        help="A hub model's revisions: step1000,step2000 or step{0..3000..1000}.",
    ),
    resume: bool = typer.Option(
        False, "--resume", help="Go on with an interrupted run: skip the steps already done."
    ),
    **given,
) -> None:
    """Run the analyses on each checkpoint of a training run, one model at a time, and write
    when each head's roles formed: timeline.csv, roles_by_step.csv, onsets.csv and a page."""
    given.pop("given", None)
    left = "the steps done are kept under OUT/steps: run again with --resume"
    with answered(left, (ProbeError, ContractError), interrupted="interrupted"):
        settings = settings_of(given | {"model": source, "revision": None, "overwrite": False})
        planned = plan_timeline(settings, revisions, resume)[1]  # before torch is imported
    threads.settle(settings.context if settings.corpus else None)
    helper.start(warmups(planned.classes))
    work = functools.partial(run_timeline, revisions=revisions, resume=resume)
    _run(settings, given.get("quiet", False), work, left)


# probe timeline takes analyze's options, less those of one model and one folder
_hints = typing.get_type_hints(analyze) | typing.get_type_hints(timeline)
timeline.__signature__ = inspect.signature(timeline).replace(parameters=[
    p.replace(annotation=_hints.get(p.name, p.annotation))
    for p in [*list(inspect.signature(timeline).parameters.values())[:3],
              *(p for name, p in inspect.signature(analyze).parameters.items()
                if name not in ("model", "revision", "overwrite", "options"))]
])  # fmt: skip
app.command()(_answers_signals(with_declared_options(timeline)))


@app.command()
@_answers_signals
def report(
    folder: Path = typer.Argument(..., help="A folder written by `probe analyze`."),
) -> None:
    """Re-render index.html from the tables of an earlier run (no model needed)."""
    from probe.app.report import render

    with answered("index.html is as it was"):
        path = render(folder)
    typer.echo(f"report: {path}")


experiment = typer.Typer(help="Experiments that answer questions about attention by training.")
app.add_typer(experiment, name="experiment")


@experiment.command("heads")
@_answers_signals
def experiment_heads(
    steps: int = typer.Option(600, "--steps", min=1, help="Training steps per model."),
    seed: int = typer.Option(
        0, "--seed", min=0, max=2**32 - 1, help="The first seed; the others follow it."
    ),
    seeds: int = typer.Option(3, "--seeds", min=1, help="Models per task and variant."),
    out: Path = typer.Option(
        Path("reports/experiment-heads"), "--out", "-o", help="Output folder."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an earlier report."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Narrow vs wide heads, factored W_Q, W_K vs one W_i, separate vs shared W_Q = W_K: small
    transformers built from probe's attention, trained on synthetic tasks (a few minutes)."""
    from probe.app.output import check_free

    with answered("no report was written"):
        check_free(out, overwrite, kind="experiment")  # before any training
        from probe.app.experiment import run
        from probe.app.training import TASKS, VARIANTS

        total = len(TASKS) * len(VARIANTS) * seeds
        console = make_console(quiet=quiet)
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
        with Progress(*columns, TimeElapsedColumn(), console=console, transient=True) as progress:
            bar = progress.add_task("training", total=total)

            def advance(done) -> None:
                progress.update(bar, advance=1, description=f"{done.task} · {done.variant}")

            path = run(out, steps, list(range(seed, seed + seeds)), overwrite, advance)
    if not quiet:
        make_console(stderr=False).print(link("report: ", path / "index.html"))


@app.command("compare")
@_answers_signals
def compare_command(
    a: Path = typer.Argument(..., help="A report folder (e.g. the base model's)."),
    b: Path = typer.Argument(..., help="Another report folder (e.g. the fine-tuned model's)."),
    out: Path = typer.Option(None, "--out", "-o", help="Output folder [default: reports/A-vs-B]."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an earlier comparison."),
) -> None:
    """Compare two reports: per head if they have the same shape, else per layer matched by
    relative depth; syntax, roles and weight circuits; self-contained HTML and CSV tables."""
    from probe.app.compare import compare

    out = out or Path("reports") / f"{a.name}-vs-{b.name}"
    with answered("no comparison was written"):
        path = compare(a, b, out, overwrite)
    typer.echo(f"comparison: {path / 'index.html'}")


@app.command("figures")
@_answers_signals
def figures_command(
    folder: Path = typer.Argument(..., help="A report folder (probe analyze) or a comparison's."),
    format: str = typer.Option("pdf", "--format", "-f", help="pdf, svg or png."),
    out: Path = typer.Option(None, "--out", "-o", help="Output folder [default: REPORT/figures]."),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Replace the figures folder (without it, another format is added beside).",
    ),
) -> None:
    """Draw publication figures (seaborn) from a report's tables: every analysis's figures,
    sized for a paper's column or page, one file each."""
    from probe.app.figures import write

    with answered("no figures were written"):  # a signal unwinds: no staging folder or lock left
        path, names = write(folder, out, format.lower(), overwrite)
    typer.echo(f"figures: {path} ({len(names)} files)")


def main() -> None:
    """The ``probe`` command. Its output refused (a full disk, a closed pipe: ``probe --help >
    /dev/full``) ends it in one line on stderr, with status 1, whatever it had done by then."""
    try:
        app()
    except OSError as e:
        if not writing_stdout(e):
            raise
        refused(e)
    finally:
        # The interpreter's last collections would walk every object torch and transformers made
        # (about a second); the process is ending, so nothing is left for them to free.
        gc.freeze()


def command() -> None:
    """The installed ``probe`` command: ``main``, in a process that ends as soon as its exit
    handlers have run.

    The interpreter's teardown would then free, one by one, every module and object torch and
    transformers made: 0.25 s of a MiniLM run, with nothing left to write (every output is
    renamed into place and the helper process ended by then). ``main`` keeps the teardown, for
    callers in a process that goes on.
    """
    status = 1  # an exception main does not answer: Python prints it, and exits with 1
    atexit.register(lambda: _end(status))  # registered first, so it runs last

    try:
        main()
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        raise


def _end(status: int) -> None:
    """End the process with ``status``, what it printed flushed, skipping the teardown."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):  # closed, or a broken pipe
            stream.flush()
    os._exit(status)


if __name__ == "__main__":  # pragma: no cover
    main()
