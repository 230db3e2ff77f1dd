"""The order a run finishes its analyses in (``probe.app.publish``): those that add to the heads
first, then those that read them (the claims), then those that do neither; these hand their
work to the helper only once the first have finished, so that the helper's work the claims wait
on (the head map) comes first and the probe's fit runs during the ablations."""

import pytest

import analyses
from analyses.claims import Claims
from analyses.probing import AttentionProbe
from analyses.roles import Roles
from probe.app.publish import _finishing


def test_each_default_analysis_finishes_by_what_it_does_with_the_heads():
    """Those with columns in heads.csv add to the heads; the probe and cross-attention add
    none, and nothing waits on them."""
    ranks = {name: _finishing(analyses.get(name)) for name in analyses.defaults()}
    assert ranks == {"syntax": 0, "roles": 0, "spectra": 0, "coref": 0, "claims": 1,
                     "probe": 2, "cross": 2}  # fmt: skip
    for name, rank in ranks.items():
        assert (rank == 2) == (not analyses.get(name).head_columns)


@pytest.mark.slow
def test_the_probe_hands_its_fit_off_after_the_heads_and_finishes_after_the_claims(
    minilm, tmp_path, monkeypatch
):
    from probe.app.analyze import analyze
    from probe.app.plan import Settings

    events = []

    def logged(cls, name):
        method = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            events.append((cls.name, name))
            return method(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, wrapper)

    for cls in (AttentionProbe, Roles, Claims):
        logged(cls, "hand_off")
        logged(cls, "finish")
    analyze(Settings(model="minilm", treebank=["sample"], out=tmp_path / "run",
                     analyses=["roles", "probe", "claims"]))  # fmt: skip
    at = {event: k for k, event in enumerate(events)}
    assert at[("roles", "finish")] < at[("probe", "hand_off")] < at[("claims", "finish")]
    assert at[("claims", "finish")] < at[("probe", "finish")]
    assert at[("roles", "hand_off")] < at[("roles", "finish")]
