"""One question to the Hugging Face hub before a model is loaded from it: does it have this model?

Asked with probe's own deadline (``PROBE_HTTP_TIMEOUT``), so that the answer is one line in
seconds: "not found" (404: a mistyped id), "no permission" (401, 403: private or gated), "server
error" (5xx: try later), or "does not answer" (a hub that accepts and never replies). Left to
itself the hub client retries for a minute and reports each of these as "offline". The
downloads that follow wait at most as long on each read (``HF_HUB_DOWNLOAD_TIMEOUT``,
``HF_HUB_ETAG_TIMEOUT``, set by ``bound_waits`` before the hub client is imported), and the whole
download of a model, every file and every call to the hub, keeps the pace a treebank download
keeps (``paced``; ``probe.inputs.download.Pace``). Files the hub keeps in its chunked storage come
as plain HTTP downloads through that client, paced too: ``bound_waits`` sets
``HF_HUB_DISABLE_XET=1`` unless the user set it, since ``hf_xet``'s own transfers bypass the client
and its deadlines (``HF_HUB_DISABLE_XET=0`` for its speed, without the pace).
"""

from __future__ import annotations

import functools
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

from probe.errors import ProbeError
from probe.inputs.download import Pace, timeout

LOCAL_HINT = "or give a local model folder"


def bound_waits() -> None:
    """Let the hub client wait on each read no longer than probe does, and fetch every file
    through its own HTTP client, where the pace sees it (unless set already); ``probe.load``
    calls it, and the command line before the client is imported.

    Raises
    ------
    ProbeError
        For a ``PROBE_HTTP_TIMEOUT`` that is not a number of seconds.
    """
    seconds = max(1, round(timeout()))
    settings = {"HF_HUB_ETAG_TIMEOUT": seconds, "HF_HUB_DOWNLOAD_TIMEOUT": seconds,
                "HF_HUB_DISABLE_XET": True}  # fmt: skip
    for name, value in settings.items():
        if name not in os.environ:
            os.environ[name] = str(int(value))
            constants = sys.modules.get("huggingface_hub.constants")
            if constants is not None:  # imported already: it read the environment once
                setattr(constants, name, value)


_pace: Pace | None = None  # the model download under way, if any


@contextmanager
def paced(name: str) -> Iterator[Pace]:
    """Hold every request the hub client makes in the block, and every byte it receives, to one
    ``Pace``: a hub or mirror that trickles is cut, and the block raises one line naming the model
    and the time. The file being fetched was the hub client's own temporary file, which it
    removes: its cache never holds a part of a file, and a later run fetches it anew.

    Raises
    ------
    ProbeError
        When the download fell below its pace, or the hub stopped answering or cut the
        connection while a file came, and the hub client's retries did not help (whatever the
        hub client or transformers made of the interruption: they call it an unknown model).
    """
    global _pace
    from huggingface_hub import constants, get_session

    hooks = get_session().event_hooks  # the client every hub call goes through (xet aside)
    if _count_request not in hooks["request"]:
        hooks["request"].append(_count_request)
        hooks["response"].append(_count_body)
    wait = max(timeout(), constants.HF_HUB_DOWNLOAD_TIMEOUT, constants.HF_HUB_ETAG_TIMEOUT)
    pace = Pace(f"model {name!r}", f"try again later, {LOCAL_HINT}", wait)
    _pace = pace
    try:
        yield pace
    except BaseException as e:
        if pace.late is not None:
            raise ProbeError(pace.late) from None
        broken = _broken(e, wait)
        if broken is None:
            raise
        raise ProbeError(f"cannot download model {name!r}: {broken}; try again later, "
                         f"{LOCAL_HINT}") from None  # fmt: skip
    finally:
        if _pace is pace:  # not another thread's, begun since
            _pace = None


def _broken(error: BaseException, wait: float) -> str | None:
    """What went wrong on the network, if that is what ``error`` (or an error it came from) was:
    a wait that timed out, or a connection cut short."""
    from httpx2 import NetworkError, RemoteProtocolError, TimeoutException

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, TimeoutException | TimeoutError):
            return (f"the hub stopped answering while it was downloaded (no answer within "
                    f"{wait:g} s, PROBE_HTTP_TIMEOUT, and again when retried)")  # fmt: skip
        if isinstance(error, NetworkError | RemoteProtocolError):
            return f"the connection to the hub broke while it was downloaded ({error})"
        error = error.__cause__ or error.__context__
    return None


def _count_request(request) -> None:
    if _pace is not None:
        _pace.add(0)


def _count_body(response) -> None:
    if _pace is not None:
        response.stream = _counted()(response.stream, _pace)


@functools.cache
def _counted() -> type:
    """The class of a response body whose pieces ``pace`` counts as they arrive (made when first
    needed: the hub client's HTTP library is not imported before)."""
    from httpx2 import SyncByteStream

    class Counted(SyncByteStream):
        def __init__(self, stream, pace: Pace) -> None:
            self.stream, self.pace = stream, pace

        def __iter__(self) -> Iterator[bytes]:
            for piece in self.stream:
                self.pace.add(len(piece))
                yield piece

        def close(self) -> None:
            self.stream.close()

    return Counted


def ask(name: str, repo: str, revision: str | None = None) -> str | None:
    """Ask the hub for ``repo`` (at ``revision``). None when it has it; the reason when it
    could not answer (the caller then tries the local cache).

    Raises
    ------
    ProbeError
        When the hub answers that the model is not there, not for this user, or that it failed.
    """
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    path = f"/api/models/{urllib.parse.quote(repo)}"
    if revision:
        path += f"/revision/{urllib.parse.quote(revision, safe='')}"
    request = urllib.request.Request(endpoint + path, headers=_headers())
    wait = timeout()
    try:
        with urllib.request.urlopen(request, timeout=wait):
            return None
    except urllib.error.HTTPError as e:
        error = e.headers.get("X-Error-Code")
        raise ProbeError(_answer(name, repo, revision, e.code, error)) from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", None) or e
        if isinstance(reason, TimeoutError) or "timed out" in str(reason):
            return f"the hub did not answer within {wait:g} s (PROBE_HTTP_TIMEOUT)"
        return f"the hub cannot be reached ({reason})"


def _answer(name: str, repo: str, revision: str | None, code: int, error: str | None) -> str:
    if error == "RevisionNotFound" or (revision and code == 404 and error != "RepoNotFound"):
        return f"{repo!r} has no revision {revision!r} on the hub (404); check --revision"
    if code == 404:
        return (f"unknown model {name!r}: the hub has no model {repo!r} (404 not found); check "
                f"the id for a typo, {LOCAL_HINT}")  # fmt: skip
    if code in (401, 403):
        return (f"no permission to download {repo!r} (the hub answered {code}: private or "
                f"gated); log in with `hf auth login`, ask for access, {LOCAL_HINT}")  # fmt: skip
    if code >= 500:
        return (f"the Hugging Face hub failed on {repo!r} ({code}, a server error); try again "
                f"later, {LOCAL_HINT}")  # fmt: skip
    return f"the Hugging Face hub refused {repo!r} ({code}); {LOCAL_HINT}"


def _headers() -> dict[str, str]:
    headers = {"User-Agent": "probe"}
    try:
        from huggingface_hub import get_token

        token = get_token()
    except ImportError:
        token = None
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers
