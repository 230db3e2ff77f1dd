"""Files fetched over HTTP(S) once, into a cache, verified before they are kept.

Proxies come from the environment (``HTTPS_PROXY``, ``NO_PROXY``…), as for any urllib client.
Each connection and read waits at most ``PROBE_HTTP_TIMEOUT`` seconds (default 30), so a server
that accepts and never answers fails in seconds, not minutes; and the whole transfer ends by
``PROBE_HTTP_DEADLINE`` seconds (default 1800), so a server that trickles a byte a second ends
too. The body is streamed to a temporary file beside the cache entry, hashed on the way, checked
(``validate`` reads it as it would any local file), then renamed into place (``write_file``):
memory stays flat whatever the file's size, and the cache never holds a part of a file.
"""

from __future__ import annotations

import hashlib
import http.client
import math
import os
import socket
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
CHUNK = 1 << 16
OFFLINE_HINT = "pass a local .conllu file with --treebank, or leave it out for the bundled EWT dev"


def seconds(variable: str, default: float) -> float:
    """A duration from the environment, checked.

    Raises
    ------
    ProbeError
        For a value that is not a finite number of seconds above 0.
    """
    text = os.environ.get(variable, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ProbeError(f"{variable}={text!r} is not a number of seconds above 0; give one "
                         f"(e.g. {variable}={default:g}) or unset it")  # fmt: skip
    return value


def timeout() -> float:
    """How long one network wait may last (``PROBE_HTTP_TIMEOUT``)."""
    return seconds("PROBE_HTTP_TIMEOUT", TIMEOUT_S)


def deadline() -> float:
    """How long one whole download may last (``PROBE_HTTP_DEADLINE``)."""
    return seconds("PROBE_HTTP_DEADLINE", DEADLINE_S)


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
    wait, limit = timeout(), deadline()
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
            digest = _download(url, file, name, wait, limit)
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


def _download(url: str, file, name: str, wait: float, limit: float) -> str:
    """Stream ``url``'s body into ``file``; its SHA-256. Every wait lasts at most ``wait``
    seconds, the whole transfer at most ``limit`` (and one more wait)."""
    request = urllib.request.Request(url, headers={"User-Agent": "probe"})
    digest, end = hashlib.sha256(), time.monotonic() + limit
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
                if time.monotonic() > end:
                    raise ProbeError(
                        f"cannot download {name}: not done after {limit:g} s (the server is too "
                        f"slow; PROBE_HTTP_DEADLINE sets the limit); {OFFLINE_HINT}"
                    )
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
