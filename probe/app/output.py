"""The output folder of a run: checked before any compute, written whole or not at all."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from probe.errors import ProbeError


def slug(name: str) -> str:
    """A folder name for a model id or path (``google-bert/bert-base-uncased`` -> its last part)."""
    last = Path(name.rstrip("/")).name or name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", last).strip("-.") or "model"


def default_out(model: str) -> Path:
    return Path("reports") / slug(model)


def check_free(out: Path, overwrite: bool) -> None:
    """Fail now, before any compute, if the report could not be written to ``out``."""
    if out.exists() and not overwrite:
        raise ProbeError(f"output folder {out} already exists; use --overwrite or another --out")


@contextmanager
def staged(out: Path, overwrite: bool) -> Iterator[Path]:
    """A temporary folder beside ``out`` that becomes ``out`` only if the body completes."""
    check_free(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield temporary
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            temporary.rename(out)
            shutil.rmtree(old)
        else:
            temporary.rename(out)
    finally:
        if temporary.exists():
            shutil.rmtree(temporary)
