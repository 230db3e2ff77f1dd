"""The treebanks of ../shared (UD English EWT and GUM), and the marks that skip a test without
them."""

from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
EWT = SHARED / "data" / "ud-english-ewt"
GUM = SHARED / "data" / "ud-english-gum"


def needs_ewt():
    return pytest.mark.skipif(
        not EWT.exists(), reason=f"UD English EWT not found at {EWT} (../shared is absent)"
    )


def needs_gum():
    return pytest.mark.skipif(
        not GUM.exists(), reason=f"UD English GUM not found at {GUM} (../shared is absent)"
    )
