"""The README's Python API example runs as written."""

from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.slow
def test_readme_api_example_runs(minilm, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # it saves a page
    text = README.read_text()
    start = text.index("```python") + len("```python")
    code = text[start : text.index("```", start)]
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    assert namespace["cache"]["blocks.0.attn.hook_pattern"].shape[:2] == (1, 12)
    assert not namespace["ablated"].equal(namespace["edited"])
    effects = namespace["effects"]  # one row per head of MiniLM's 6 x 12
    assert len(effects) == 72 and effects.effect.abs().max() > 0
    assert set(namespace["spectra"].circuit) == {"QK", "OV"}
    assert "probe-view" in (tmp_path / "attention.html").read_text()
