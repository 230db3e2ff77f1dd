"""The docs' and the README's pictures, rendered by headless Chromium from a run of the code as it
is now, so that they show what a user gets.

    python docs/screenshots.py [--out docs] [--card 4-7]

- ``report.png``: the top of the report of ``probe analyze --model minilm`` (UD English EWT dev,
  bundled; the default analyses), 1100 × 1300 pixels;
- ``card.png``: one head's card in that report, opened, on a page of its own, cropped to it: by
  default head 4-7, which the pages show as a case head (the script refuses to draw it as one
  where its best relation is another);
- ``viewer.png``: ``probe.show``'s model view of MiniLM on "The cat sat on the mat.", 900 × 700.

Needs MiniLM (the ``demo`` extra) and Debian's ``chromium`` (``apt-get install chromium``); runs
offline, in about a minute on 2 idle cores.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPORT_SIZE = (1100, 1300)
VIEWER_SIZE = (900, 700)
CARD_WIDTH = 1158
# The head shown on card.png, and what the pages say of it (report.md: "a case head").
CARD_RELATION = "case"

# Opens a head's card, moves it onto an otherwise empty page and writes its size on the body.
CARD_SCRIPT = """<script>
addEventListener("load", () => {
  const card = document.getElementById("head-%s");
  card.querySelector("details").open = true;
  document.body.replaceChildren(card);
  document.body.style.margin = "0";
  document.body.style.padding = "4px";
  card.style.width = "%dpx";
  card.style.boxSizing = "border-box";
  card.style.margin = "0";
  const box = card.getBoundingClientRect();
  document.body.dataset.size = Math.ceil(box.right + 4) + "x" + Math.ceil(box.bottom + 4);
});
</script>"""
# Switches a probe.show page to its model view.
MODEL_VIEW_SCRIPT = """<script>
addEventListener("load", () => {
  const view = document.querySelector("[data-role=view]");
  view.value = "model";
  view.dispatchEvent(new Event("change"));
});
</script>"""


def chromium_binary() -> str:
    """The Chromium to run, or the script ends in one line: checked before anything else, so
    that a machine without it learns so at once, not after the analysis."""
    binary = next(filter(None, map(shutil.which, ("chromium", "chromium-browser"))), None)
    if binary is None:
        sys.exit("headless Chromium is needed: apt-get install chromium")
    return binary


def chromium(url: str, profile: Path, size: tuple[int, int], *args: str) -> str:
    """Headless Chromium on ``url`` with a window of ``size``, its network chatter off; returns
    what it printed (the DOM, for ``--dump-dom``)."""
    binary = chromium_binary()
    flags = [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--hide-scrollbars", f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}",
        "--virtual-time-budget=5000",
    ]  # fmt: skip
    done = subprocess.run(
        [binary, *flags, *args, url], capture_output=True, text=True, timeout=300, check=True
    )
    return done.stdout


def with_script(page: Path, script: str, name: str) -> Path:
    """A copy of ``page`` beside it, ``script`` run after it loads."""
    copy = page.with_name(name)
    html = page.read_text(encoding="utf-8")
    copy.write_text(html.replace("</body>", script + "</body>"), encoding="utf-8")
    return copy


def analyze(folder: Path) -> Path:
    """The report of ``probe analyze --model minilm``, run by this Python, in ``folder``."""
    report = folder / "minilm"
    subprocess.run(
        [sys.executable, "-m", "probe.app.cli", "analyze", "--model", "minilm", "--out",
         str(report), "--quiet"],
        check=True, env=os.environ | {"HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    return report


def card(report: Path, head: str, out: Path, profile: Path) -> None:
    import pandas as pd

    layer, number = map(int, head.split("-"))
    heads = pd.read_csv(report / "heads.csv").set_index(["layer", "head"])
    relation = heads.loc[(layer, number), "best_relation"]
    if relation != CARD_RELATION:
        sys.exit(f"head {head}'s best relation is {relation}, not {CARD_RELATION}: the pages say "
                 f"otherwise; pick another head with --card and change what they say")  # fmt: skip
    page = with_script(report / "index.html", CARD_SCRIPT % (head, CARD_WIDTH - 8), "card.html")
    size = (CARD_WIDTH, 2000)
    dom = chromium(page.as_uri(), profile, size, "--dump-dom")
    found = re.search(r'data-size="(\d+)x(\d+)"', dom)
    if found is None:
        sys.exit(f"the report has no card for head {head}")
    size = (CARD_WIDTH, int(found.group(2)))
    chromium(page.as_uri(), profile, size, f"--screenshot={out / 'card.png'}")


def viewer(folder: Path, out: Path, profile: Path) -> None:
    import probe

    model, tokenizer = probe.load("minilm")
    page = folder / "viewer.html"
    probe.show(model, tokenizer, "The cat sat on the mat.").save(page)
    page = with_script(page, MODEL_VIEW_SCRIPT, "model-view.html")
    chromium(page.as_uri(), profile, VIEWER_SIZE, f"--screenshot={out / 'viewer.png'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="where the pictures go")
    parser.add_argument("--card", default="4-7", help="the head whose card card.png shows, L-H")
    args = parser.parse_args()
    chromium_binary()  # before the analysis's half-minute
    with tempfile.TemporaryDirectory(prefix="probe-screenshots-") as tmp:
        folder = Path(tmp)
        profile = folder / "profile"
        report = analyze(folder)
        url = (report / "index.html").as_uri()
        chromium(url, profile, REPORT_SIZE, f"--screenshot={args.out / 'report.png'}")
        card(report, args.card, args.out, profile)
        viewer(folder, args.out, profile)
    for name in ("report.png", "card.png", "viewer.png"):
        print(args.out / name)


if __name__ == "__main__":
    main()
