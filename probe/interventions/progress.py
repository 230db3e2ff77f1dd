"""The progress of a long library call (``patch``, ``attribute``, ``edges``, ``circuit``): a tqdm
bar on stderr, as transformers and datasets show theirs, where stderr is a terminal (or where
asked, ``progress=True``); none where it is not (a log, a pipe, a test) or with
``progress=False``. The work's loops say how far they are (``advance``) without knowing whether
a bar is shown, or whose.

A call whose work cannot finish in a day (``long_work``: the lower bound of
``probe.options.check_time``, from the model's arithmetic at the machine's peak) warns in one
line before it starts, with the estimate, and runs: the command line refuses such sizes at plan
time; from Python the caller may mean it, and can stop it (Ctrl-C leaves the model as it was).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import warnings
from collections.abc import Iterator
from typing import Any

from probe.options import LIMIT_S, forward_flops, peak_rate

_bar: contextvars.ContextVar[Any] = contextvars.ContextVar("probe_progress", default=None)


def shows(progress: bool | None) -> bool:
    """Whether a bar is drawn: ``progress`` where given, else whether stderr is a terminal."""
    if progress is not None:
        return bool(progress)
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # closed, or replaced by an object without a terminal
        return False


@contextlib.contextmanager
def shown(description: str, total: int | None, progress: bool | None, unit: str) -> Iterator[Any]:
    """A bar of ``total`` ``unit`` for the block (none where ``shows`` says not), the one the
    block's ``advance`` calls move; the caller's bar, if any, is theirs again after it."""
    if not shows(progress):
        token = _bar.set(None)
        try:
            yield None
        finally:
            _bar.reset(token)
        return
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=description, unit=unit, file=sys.stderr, leave=False,
               dynamic_ncols=True)  # fmt: skip
    token = _bar.set(bar)
    try:
        yield bar
    finally:
        _bar.reset(token)
        bar.close()


def advance(n: int = 1) -> None:
    """``n`` more units done, on the bar shown for this call (nothing where none is)."""
    bar = _bar.get()
    if bar is not None:
        bar.update(n)


def finish(bar: Any) -> None:
    """``bar`` full at what it counted: for work whose total was not known before it ended."""
    if bar is not None:
        bar.total = bar.n
        bar.refresh()


def long_work(call: str, option: str, model: Any, token_forwards: float) -> None:
    """Warn, in one line, where ``token_forwards`` (tokens times forward passes, a backward
    counting two) of ``model`` take more than a day even at the machine's peak."""
    config = getattr(model, "config", None)
    if config is None:
        return
    flops = token_forwards * forward_flops(config)
    device = next((p.device for p in model.parameters()), None)
    seconds = flops / peak_rate(device)
    if seconds > LIMIT_S:
        warnings.warn(
            f"{call}: {option} needs at least {flops:.1e} floating-point operations, over "
            f"{seconds / 86_400:,.0f} days on this machine at its peak; it runs (Ctrl-C stops "
            "it, the model left as it was)",
            stacklevel=3,
        )
