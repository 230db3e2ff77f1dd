"""Files fetched over HTTP(S) once, into a cache, verified before they are kept.

Proxies come from the environment (``HTTPS_PROXY``, ``NO_PROXY``…), as for any urllib client.
Each connection and read waits at most ``PROBE_HTTP_TIMEOUT`` seconds (default 30), so a server
that accepts and never answers fails in seconds, not minutes.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import socket
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from probe.errors import ProbeError

TIMEOUT_S = 30.0
OFFLINE_HINT = "pass a local .conllu file with --treebank, or leave it out for the bundled EWT dev"


def timeout() -> float:
    return float(os.environ.get("PROBE_HTTP_TIMEOUT", TIMEOUT_S))


def fetch(
    url: str,
    target: Path,
    *,
    sha256: str | None = None,
    validate: Callable[[Path], object] | None = None,
    what: str | None = None,
) -> Path:
    """``target``, downloaded from ``url`` unless the cache has it already.

    The download is checked against ``sha256`` when given, and by ``validate`` (which raises
    ``ProbeError`` for a file that is not what was asked for, e.g. an HTML error page served
    with status 200); it reaches ``target`` whole or not at all. ``what`` names it in errors
    (``ud:en_ewt``; default the URL).

    Raises
    ------
    ProbeError
        For a failed or refused download, one that fails its checks, or a cache that cannot be
        written.
    """
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ProbeError(
            f"cannot create the treebank cache {target.parent} ({e.strerror}); set PROBE_CACHE "
            "to a writable folder"
        ) from None
    name = f"{what} from {url}" if what else url
    request = urllib.request.Request(url, headers={"User-Agent": "probe"})
    try:
        with urllib.request.urlopen(request, timeout=timeout()) as response:
            data = response.read()
    except urllib.error.HTTPError as e:
        answer = f"{e.code} {e.reason}"
        raise ProbeError(f"cannot download {name}: the server answered {answer}") from None
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:  # cut short too
        reason = getattr(e, "reason", None) or e or type(e).__name__
        raise ProbeError(f"cannot download {name} ({reason}); offline? {OFFLINE_HINT}") from None
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256.lower():
        raise ProbeError(
            f"{name} does not match its pinned SHA-256 (a changed or truncated download); "
            f"nothing was cached. Try again, or {OFFLINE_HINT}"
        )
    tmp = None
    try:
        with tempfile.NamedTemporaryFile(dir=target.parent, delete=False, suffix=".part") as f:
            tmp = Path(f.name)
            f.write(data)
        if validate is not None:
            validate(tmp)
        os.replace(tmp, target)  # atomic: no half-written file in the cache
    except OSError as e:
        raise ProbeError(
            f"cannot write {target} ({e.strerror}); set PROBE_CACHE to a writable folder"
        ) from None
    finally:
        if tmp is not None and tmp.exists():
            with suppress(OSError):
                tmp.unlink()
    return target


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
