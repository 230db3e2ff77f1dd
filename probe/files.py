"""Every file probe writes (tables, pages, figures, caches, comparisons) is written by
``write_file``: into a temporary file in the same folder, then renamed over the old one, so a
full disk, a signal or a crash leaves the old file or the new one, never a cut one; and a
symbolic link where the file goes is replaced, never followed out of its folder.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from probe.errors import ProbeError


class WriteError(ProbeError):
    """A file of probe's could not be written (a full disk, no permission): nothing replaced."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"cannot write {path} ({reason}); nothing was replaced")
        self.path, self.reason = path, reason


def write_file(path: Path, content: str | bytes | Callable[[Path], object]) -> Path:
    """Write ``path`` whole or not at all: into a temporary file beside it, then renamed over it.

    Parameters
    ----------
    path : Path
        The file; a symbolic link there is replaced by the file, never followed.
    content : str, bytes or callable
        Text (UTF-8), bytes, or ``content(temporary_path)`` that writes the file itself (e.g.
        ``table.to_csv``); the temporary path ends like ``path`` (``.npz``, ``.csv``).

    Raises
    ------
    WriteError
        When the folder or the disk refuses it; the old file, if any, is untouched.
    """
    path = Path(path)
    tmp = None
    try:
        fd, name = tempfile.mkstemp(prefix=".probe-tmp-", suffix=path.suffix, dir=path.parent)
        tmp = Path(name)
        os.fchmod(fd, 0o666 & ~_umask())  # as any file the user makes, not mkstemp's 0600
        with os.fdopen(fd, "wb") as f:
            if isinstance(content, str | bytes):
                f.write(content.encode("utf-8") if isinstance(content, str) else content)
        if callable(content):
            content(tmp)
        os.replace(tmp, path)  # replaces a link itself: its target is never written
        tmp = None
    except OSError as e:
        raise WriteError(path, e.strerror or type(e).__name__) from None
    finally:
        if tmp is not None:
            with suppress(OSError):
                tmp.unlink()
    return path


def cache_dir() -> Path:
    """Where probe keeps what it downloads or builds once (``$PROBE_CACHE``, else
    ``$XDG_CACHE_HOME/probe``, else ``~/.cache/probe``)."""
    base = os.environ.get("PROBE_CACHE")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "probe"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
