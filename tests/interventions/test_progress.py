"""Long library calls show a tqdm bar on stderr where asked (by default where stderr is a
terminal), and never where not; work that cannot finish in a day warns in one line first."""

import pytest
import torch
from induction import MODEL, fresh, repeated

import probe
from probe.interventions.progress import long_work, shows

N = 6
PAIRS = 4


@pytest.fixture(scope="module")
def model():
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(MODEL, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokens():
    clean = repeated(PAIRS, N, seed=3)
    return clean, fresh(PAIRS, N, seed=9)[:, : clean.shape[1]]


def metric(logits):
    return logits.log_softmax(-1)[:, -1, 0]


CALLS = {
    "patch": lambda m, c, x, **kw: probe.patch(m, c, x, metric, heads=[(0, 0), (1, 1)], **kw),
    "attribute": lambda m, c, x, **kw: probe.attribute(m, c, x, metric, **kw),
    "edges": lambda m, c, x, **kw: probe.edges(m, c, x, metric, method="eap-ig", steps=2, **kw),
    "circuit": lambda m, c, x, **kw: probe.circuit(m, c, x, metric, steps=2, points=3, **kw),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_a_bar_is_drawn_when_asked_and_never_when_not(model, tokens, call, capsys):
    clean, corrupted = tokens
    CALLS[call](model, clean, corrupted, progress=True)
    drawn = capsys.readouterr().err
    mine = drawn[drawn.index(call) :]  # circuit's own bar follows its edges'
    assert "|" in mine and "%" in mine, drawn  # the bar: its name, its frame, its share
    CALLS[call](model, clean, corrupted, progress=False)
    CALLS[call](model, clean, corrupted)  # stderr is no terminal here: no bar by default
    assert capsys.readouterr().err == ""


def test_a_bar_counts_the_work_to_its_end(model, tokens, monkeypatch):
    """The patch bar's total is the patched pairs, and the work reaches it."""
    from tqdm import tqdm

    seen = {}  # a bar's first close (tqdm closes again when it is collected)
    close = tqdm.close

    def closing(bar):
        seen.setdefault(id(bar), (bar.n, bar.total))
        close(bar)

    monkeypatch.setattr(tqdm, "close", closing)
    clean, corrupted = tokens
    CALLS["patch"](model, clean, corrupted, progress=True)
    CALLS["edges"](model, clean, corrupted, progress=True)
    assert list(seen.values()) == [(2 * PAIRS, 2 * PAIRS)] * 2  # 2 heads; 2 steps


def test_the_default_follows_the_terminal(monkeypatch):
    import sys

    class Terminal:
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    assert shows(None) and not shows(False)
    monkeypatch.setattr(sys, "stderr", None)
    assert not shows(None) and shows(True)


def test_work_beyond_a_day_warns_in_one_line(model, tokens, monkeypatch):
    """``steps=10**6`` of EAP-IG on 256 pairs, on a machine of 10⁹ operations a second (the
    tiny model is fast enough on a real one: the bound itself is tests/foundation's): the
    warning comes before any run (here the metric fails on the first)."""
    import probe.interventions.progress as progress

    monkeypatch.setattr(progress, "peak_rate", lambda device=None: 1e9)
    clean, corrupted = (t.repeat(64, 1) for t in tokens)

    def failing(logits):
        raise RuntimeError("stop here")

    with (
        pytest.warns(UserWarning, match=r"^probe\.edges\(\): 256 pairs and steps=1,000,000 "
                     r"needs at least .* floating-point operations, over .* days") as said,
        pytest.raises(probe.ProbeError),  # the metric, or the budget: before any run
    ):  # fmt: skip
        probe.edges(model, clean, corrupted, failing, method="eap-ig", steps=10**6)
    assert len(said) == 1 and "\n" not in str(said[0].message)


def test_work_within_a_day_does_not_warn(model, recwarn):
    long_work("probe.edges", "4 pairs", model, 4 * 20 * 17)
    assert not [w for w in recwarn if "floating-point" in str(w.message)]
