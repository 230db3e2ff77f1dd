"""Files fetched over HTTP(S) once, into a cache, verified before they are kept.

Proxies come from the environment (``HTTPS_PROXY``, ``NO_PROXY``…), as for any urllib client.
Each connection and read waits at most ``PROBE_HTTP_TIMEOUT`` seconds (default 30), so a server
that accepts and never answers fails in seconds, not minutes. The whole transfer keeps a pace
(``Pace``, for treebanks here and for models in ``probe.inputs.hub``): each stretch of
``PROBE_HTTP_DEADLINE`` seconds (default 1800) must bring ``PROBE_HTTP_MIN_RATE`` bytes a second
on average (default 100,000), so a server that trickles a byte a second is cut after half an
hour, while an honest slow link (100 kB/s brings 16 GB in two days) is never cut. The body is
streamed to a temporary file beside the cache entry, hashed on the way, checked (``validate``
reads it as it would any local file), then renamed into place (``write_file``): memory stays
flat whatever the file's size, and the cache never holds a part of a file.
"""

from __future__ import annotations

import hashlib
import http.client
import math
import os
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

from probe.errors import ProbeError
from probe.files import WriteError, write_file

TIMEOUT_S = 30.0
DEADLINE_S = 1800.0
# Below 100 kB/s (0.8 Mbit/s) a model of 500 MB takes over an hour and a half; a link that slow
# is told so, and told how to wait longer, rather than left to look hung.
MIN_RATE = 100_000.0
CHUNK = 1 << 16
OFFLINE_HINT = "pass a local .conllu file with --treebank, or leave it out for the bundled EWT dev"


def seconds(variable: str, default: float, unit: str = "seconds") -> float:
    """A duration (or another ``unit``) from the environment, checked.

    Raises
    ------
    ProbeError
        For a value that is not a finite number above 0.
    """
    text = os.environ.get(variable, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ProbeError(f"{variable}={text!r} is not a number of {unit} above 0; give one "
                         f"(e.g. {variable}={default:g}) or unset it")  # fmt: skip
    return value


def timeout() -> float:
    """How long one network wait may last (``PROBE_HTTP_TIMEOUT``)."""
    return seconds("PROBE_HTTP_TIMEOUT", TIMEOUT_S)


def deadline() -> float:
    """How long a download may go at any pace (``PROBE_HTTP_DEADLINE``): ``Pace``'s stretch."""
    return seconds("PROBE_HTTP_DEADLINE", DEADLINE_S)


def min_rate() -> float:
    """The slowest a download may be, in bytes a second over a stretch (``PROBE_HTTP_MIN_RATE``)."""
    return seconds("PROBE_HTTP_MIN_RATE", MIN_RATE, unit="bytes a second")


class TooSlowError(ProbeError):
    """A download fell below its pace: cut."""


class Pace:
    """The pace a whole download keeps, over all its requests: each stretch of ``deadline()``
    seconds brings at least ``min_rate()`` bytes a second on average, or the download is cut.

    A server that trickles, or stalls after a good start, is cut within one or two stretches;
    a link that keeps the rate is never cut, however large the download. Only time on the
    network counts: a silence between two requests or pieces longer than twice the longest wait
    cannot be a wait on the network (that wait would have timed out, and a retry begun), so it
    is the caller's own work (loading the weights between two files) and is left out. Safe to
    use from several threads (the hub client may download files in parallel).

    Parameters
    ----------
    what : str
        Names the download in the message (``model 'acme/bert'``, a URL).
    hint : str
        What to do instead, at the message's end.
    wait : float, optional
        The longest one network wait may last; default ``PROBE_HTTP_TIMEOUT``.
    """

    def __init__(self, what: str, hint: str, wait: float | None = None) -> None:
        self.what, self.hint = what, hint
        self.stretch, self.rate, self.idle = deadline(), min_rate(), 2 * (wait or timeout())
        self.start = self.since = self.last = time.monotonic()
        self.got = 0  # bytes since ``since``
        self.late: str | None = None  # the message, once cut
        self._lock = threading.Lock()

    def add(self, size: int) -> None:
        """Count ``size`` bytes received (0: a new request), and check the pace.

        Raises
        ------
        TooSlowError
            Once the pace is broken (and at every later call).
        """
        with self._lock:
            now = time.monotonic()
            if now - self.last > self.idle:  # not the network's time
                self.since += now - self.last
            self.last = now
            self.got += size
            if self.late is None and now - self.since >= self.stretch:
                if self.got < self.rate * (now - self.since):
                    self.late = self._message(now)
                self.since, self.got = now, 0
            if self.late is not None:
                raise TooSlowError(self.late)

    def _message(self, now: float) -> str:
        return (f"cannot download {self.what}: too slow, cut after {now - self.start:.1f} s "
                f"({self.got:,} bytes in the last {now - self.since:.1f} s: under "
                f"PROBE_HTTP_MIN_RATE={self.rate:g} bytes a second over a stretch of "
                f"PROBE_HTTP_DEADLINE={self.stretch:g} s; set PROBE_HTTP_MIN_RATE lower to wait "
                f"for a slow link); {self.hint}")  # fmt: skip


def fetch(
    url: str,
    target: Path,
    *,
    sha256: str | None = None,
    validate: Callable[[Path, str], object] | None = None,
    what: str | None = None,
) -> Path:
    """``target``, downloaded from ``url`` unless the cache has it already.

    The download is checked against ``sha256`` when given, and by ``validate(path, name)``
    (which raises ``ProbeError`` for a file that is not what was asked for, naming it
    ``name``); it reaches ``target`` whole or not at all. ``what`` names it in errors
    (``ud:en_ewt``; default the URL).

    Raises
    ------
    ProbeError
        For a failed, refused, too slow or HTML download, one that fails its checks, or a
        cache that cannot be written.
    """
    if target.exists():
        return target
    wait = timeout()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ProbeError(
            f"cannot create the treebank cache {target.parent} ({e.strerror}); set PROBE_CACHE "
            "to a writable folder"
        ) from None
    name = f"{what} from {url}" if what else url

    def fill(part: Path) -> None:
        with open(part, "wb") as file:
            digest = _download(url, file, name, wait, Pace(name, OFFLINE_HINT))
        if sha256 is not None and digest != sha256.lower():
            raise ProbeError(
                f"{name} does not match its pinned SHA-256 (a changed or truncated download); "
                f"nothing was cached. Try again, or {OFFLINE_HINT}"
            )
        if validate is not None:
            validate(part, name)

    try:
        return write_file(target, fill)  # the cache holds the whole file or none of it
    except WriteError as e:
        raise ProbeError(
            f"cannot write {target} ({e.reason}); set PROBE_CACHE to a writable folder"
        ) from None


def _download(url: str, file, name: str, wait: float, pace: Pace) -> str:
    """Stream ``url``'s body into ``file``; its SHA-256. Every wait lasts at most ``wait``
    seconds, and the whole transfer keeps ``pace``."""
    request = urllib.request.Request(url, headers={"User-Agent": "probe"})
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(request, timeout=wait) as response:
            first = True
            while chunk := response.read1(CHUNK):
                if first and (response.headers.get_content_type() == "text/html"
                              or chunk.lstrip()[:1] == b"<"):  # fmt: skip
                    raise ProbeError(
                        f"cannot download {name}: the server sent a web page (a login or error "
                        "page?), not a treebank; check the URL"
                    )
                first = False
                digest.update(chunk)
                _write(file, chunk, name)
                pace.add(len(chunk))
            if response.length:  # the connection closed before the promised length
                raise http.client.IncompleteRead(b"", response.length)
    except urllib.error.HTTPError as e:
        kind = "not found: check the URL" if e.code == 404 else (
            "a server error: try again later" if e.code >= 500 else "refused")  # fmt: skip
        raise ProbeError(
            f"cannot download {name}: the server answered {e.code} {e.reason} ({kind})"
        ) from None
    except (urllib.error.URLError, http.client.HTTPException, TimeoutError) as e:  # cut short too
        reason = getattr(e, "reason", None) or repr(e)
        raise ProbeError(f"cannot download {name} ({reason}); unreachable or offline? "
                         f"{OFFLINE_HINT}") from None  # fmt: skip
    except OSError as e:
        raise ProbeError(f"cannot download {name} ({e.strerror or e}); unreachable or offline? "
                         f"{OFFLINE_HINT}") from None  # fmt: skip
    return digest.hexdigest()


def _write(file, chunk: bytes, name: str) -> None:
    try:
        file.write(chunk)
    except OSError as e:  # the cache's disk, not the network
        raise ProbeError(f"cannot keep {name} ({e.strerror}); set PROBE_CACHE to a writable "
                         "folder with room") from None  # fmt: skip


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers (checked once, quickly, instead of letting every
    file request retry for a minute on a machine without network)."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return False
    try:
        socket.create_connection(hub_address(), timeout=timeout).close()
        return True
    except OSError:
        return False


def hub_address() -> tuple[str, int]:
    """Where a request to the hub first goes, as huggingface_hub's HTTP client would send it:
    ``HF_ENDPOINT`` with its scheme and port, or the proxy the environment names for that
    scheme (``HTTPS_PROXY``…), unless ``NO_PROXY`` exempts the host."""
    endpoint = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    default = {"https": 443, "http": 80}
    address = (endpoint.hostname or "", endpoint.port or default.get(endpoint.scheme, 443))
    proxy = urllib.request.getproxies().get(endpoint.scheme)
    if proxy and not urllib.request.proxy_bypass(address[0]):
        via = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        address = (via.hostname or "", via.port or default.get(via.scheme, 80))
    return address
