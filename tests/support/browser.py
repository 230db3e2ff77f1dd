"""A report page checked as a browser reads it: its HTML balanced and self-contained (no
reference outside the file), and headless Chromium driving it, its console messages read."""

import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest


class Checker(HTMLParser):
    """Collects tags, external references and unbalanced elements."""

    VOID = frozenset(
        {"meta", "img", "br", "hr", "input", "link", "line", "path", "use", "rect", "circle"}
    )

    def __init__(self):
        super().__init__()
        self.stack, self.errors, self.references, self.scripts = [], [], [], 0

    def handle_starttag(self, tag, attrs):
        self.scripts += tag == "script" and dict(attrs).get("type") != "application/json"
        for key, value in attrs:
            if key in ("src", "href", "xlink:href", "action", "data") and value:
                self.references.append(value)
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in self.VOID:
            self.stack.pop()

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"unexpected </{tag}> (open: {self.stack[-3:]})")
        else:
            self.stack.pop()


def check_html(path: Path) -> Checker:
    html = path.read_text(encoding="utf-8")
    checker = Checker()
    checker.feed(html)
    checker.close()
    assert not checker.errors, checker.errors[:5]
    assert checker.stack == [], checker.stack
    for ref in checker.references:
        assert ref.startswith(("#", "data:")), f"external reference {ref[:80]}"
    assert not re.search(r"url\(\s*['\"]?(?!#|data:)", html), "CSS url() pointing outside"
    assert "@import" not in html
    return checker


CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)


needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium not installed (apt-get install chromium)"
)


def chromium(url: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """Headless Chromium with its network chatter off, logging console messages to stderr."""
    flags = [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
        "--window-size=1280,2000", "--virtual-time-budget=3000",
    ]  # fmt: skip
    return subprocess.run(
        [CHROMIUM, *flags, *args, url], capture_output=True, text=True, timeout=120
    )


def console_messages(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]
