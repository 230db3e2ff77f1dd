"""A stand-in Hugging Face hub (and plain HTTP server) on 127.0.0.1 that tests start and stop:
it serves small models' folders by repo id, and a repo's revisions as folders of their own
(``{repo: {revision: folder}}``, each revision its own commit), with the failure modes the
download tests need; and ``probe_cli``, the command run against it in a child process."""

import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

COMMIT = "0" * 40


def commit_of(revision: str | None) -> str:
    """The commit a revision of a repo served by revision names (``COMMIT`` for a plain one)."""
    return COMMIT if revision is None else hashlib.sha1(revision.encode()).hexdigest()


class Handler(http.server.BaseHTTPRequestHandler):
    """Answers from ``self.server.routes``: path -> bytes, or a failure mode by name; and, for a
    stand-in hub, ``self.server.repos``: repo id -> folder."""

    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self.answer(body=False)

    def do_GET(self):
        self.answer(body=True)

    def answer(self, body: bool):
        path = self.path.split("?")[0]
        route = self.server.routes.get(path)
        if route == "never":
            time.sleep(5)
            return
        if route == "cut":
            self.send(200, b"# sent_id = 1\n1\tHal", length=10_000, body=body)
            return
        if route == "html":
            self.send(200, b"<html><body>Service unavailable</body></html>", body=body)
            return
        if isinstance(route, bytes):
            self.send(200, route, body=body)
            return
        self.hub(path, body)

    def hub(self, path: str, body: bool):
        parts = path.strip("/").split("/")
        if parts[:1] == ["api"] and "/tree/" in path:
            self.send(200, b"[]", body=body)
            return
        if parts[:2] == ["api", "models"]:
            repo = "/".join(parts[2:4])
            revision = parts[5] if len(parts) > 5 and parts[4] == "revision" else "main"
            folder, commit = self.folder(repo, revision)
            if folder is not None:
                info = {"id": repo, "sha": commit,
                        "siblings": [{"rfilename": p.name} for p in folder.iterdir()]}  # fmt: skip
                self.send(200, json.dumps(info).encode(), body=body)
                return
        folder, commit = self.folder("/".join(parts[:2]), parts[3] if len(parts) > 3 else "main")
        if len(parts) >= 5 and parts[2] == "resolve" and folder is not None:
            file = folder / "/".join(parts[4:])
            if file.is_file():
                data = file.read_bytes()
                headers = {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Repo-Commit": commit}
                if body and file.name in self.server.trickle:
                    self.trickle(data, headers)
                    return
                if body and file.name in self.server.silent:
                    self.send(200, b"", length=len(data), body=False, headers=headers)
                    self.wfile.write(data[:10])  # and then nothing
                    self.wfile.flush()
                    time.sleep(30)
                    return
                self.send(200, data, body=body, headers=headers)
                return
            self.send(404, b"", body=body, headers={"X-Error-Code": "EntryNotFound"})
            return
        if "/".join(parts[:2]) in self.server.repos or "/".join(parts[2:4]) in self.server.repos:
            self.send(404, b"", body=body, headers={"X-Error-Code": "RevisionNotFound"})
            return
        self.send(404, b"not found", body=body, headers={"X-Error-Code": "RepoNotFound"})

    def folder(self, repo: str, revision: str) -> tuple[Path | None, str]:
        """The folder and commit of ``repo`` at ``revision`` (a name or a commit): a repo served
        by revision has each as a folder of its own; a plain one is the same at every revision."""
        served = self.server.repos.get(repo)
        if isinstance(served, dict):  # by revision, or by the commit it names (as clients ask)
            revision = {commit_of(r): r for r in served}.get(revision, revision)
            return served.get(revision), commit_of(revision)
        return served, COMMIT

    def trickle(self, data, headers):
        """The whole file promised, then sent a byte a second (until the client hangs up)."""
        self.send(200, b"", length=len(data), body=False, headers=headers)
        try:
            for byte in data:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(1)
        except OSError:
            pass

    def send(self, status, data, *, body, length=None, headers=None):
        self.send_response(status)
        self.send_header("Content-Length", str(len(data) if length is None else length))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if body:
            self.wfile.write(data)


@contextmanager
def serving(routes=None, repos=None, trickle=(), silent=()):
    """A server on 127.0.0.1 for the block; yields its base URL. The hub's files named in
    ``trickle`` come a byte a second; of those named in ``silent``, ten bytes come."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.routes, server.repos = routes or {}, repos or {}
    server.trickle, server.silent = set(trickle), set(silent)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def free_port() -> int:
    """A port nothing listens on."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What probe.inputs.hub.bound_waits sets in a process's environment: earlier tests that ran the
# command line in this process left them here, and a child given them would not derive its own.
BOUND = ("HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT", "HF_HUB_DISABLE_XET")


def probe_cli(env: dict, *args: str, cwd=None) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    inherited = {k: v for k, v in os.environ.items() if k not in BOUND}
    done = subprocess.run([sys.executable, "-m", "probe.app.cli", *args], capture_output=True,
                          text=True, env=inherited | env, cwd=cwd, timeout=300)  # fmt: skip
    return done, time.monotonic() - start
