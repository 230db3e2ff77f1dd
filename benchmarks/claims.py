"""What a report folder claims, and how long its page is (issue #30's measures).

    python benchmarks/claims.py reports/minilm [--chromium /usr/bin/chromium]

Prints how many heads name a best relation (``heads.csv``), how many head cards lead with a
sentence that also leads another card (``examples.json``), and the page's height in screens of
900 px, measured in headless Chromium with every card closed, as a reader first sees it.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import pandas as pd

HEIGHT = (
    '<pre id="claims-height"></pre><script>addEventListener("load", function () {'
    'document.getElementById("claims-height").textContent = '
    "document.documentElement.scrollHeight; });</script>"
)


def page_height(index: Path, chromium: str) -> int:
    """The page's height in pixels, at 1280 × 900."""
    with tempfile.TemporaryDirectory() as scratch:
        page = Path(scratch) / "page.html"
        page.write_text(index.read_text(encoding="utf-8").replace("</body>", HEIGHT + "</body>"))
        done = subprocess.run(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu",
             f"--user-data-dir={scratch}/profile", "--window-size=1280,900",
             "--virtual-time-budget=5000", "--dump-dom", page.as_uri()],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    return int(re.search(r'<pre id="claims-height">(\d+)</pre>', done.stdout).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = parser.parse_args()
    heads = pd.read_csv(args.folder / "heads.csv", keep_default_na=False)
    named = heads[heads.get("best_relation", pd.Series("", index=heads.index)) != ""]
    print(f"heads naming a best relation: {len(named)} of {len(heads)}")
    if len(named):
        print("  by relation:", named.best_relation.value_counts().to_dict())
    examples = json.loads((args.folder / "examples.json").read_text(encoding="utf-8"))
    leads = Counter(h["shown"][0]["sentence"] for h in examples["heads"].values() if h["shown"])
    shared = sum(n for n in leads.values() if n > 1)
    most = max(leads.values(), default=0)
    print(f"cards: {sum(leads.values())}; distinct leading sentences: {len(leads)}; cards whose "
          f"leading sentence leads another card: {shared}; most cards led by one sentence: "
          f"{most}")  # fmt: skip
    height = page_height(args.folder / "index.html", args.chromium)
    print(f"page height: {height} px, {height / 900:.1f} screens of 900 px")


if __name__ == "__main__":
    main()
