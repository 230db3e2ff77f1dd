"""The analyses on the real pretrained MiniLM over 200 sentences of UD English EWT dev."""

import pytest
import torch
from treebanks import EWT, needs_ewt

from analyses import Context
from analyses.probing import AttentionProbe
from analyses.roles import Roles
from analyses.syntax import Syntax
from analyses.vocabulary import Thresholds
from probe.app.publish import join_heads
from probe.inputs.corpus import Corpus, max_tokens
from probe.inputs.treebank import read_conllu
from probe.pipeline.runner import stream

pytestmark = [pytest.mark.slow, needs_ewt()]


@pytest.fixture(scope="module")
def results(minilm):
    model, tokenizer = minilm
    sentences = read_conllu(EWT / "en_ewt-ud-dev.conllu")[:200]
    corpus = Corpus(sentences, tokenizer, max_tokens(model.config, tokenizer))
    context = Context(6, 12, seed=0)
    analyses = [Syntax(context), Roles(context), AttentionProbe(context)]
    stream(model, corpus.batches(32), analyses)
    return {a.name: a.finish() for a in analyses}


def test_det_best_head_beats_its_best_offset(results):
    best = results["syntax"]["syntax_best"].set_index("relation")
    det = best.loc["det"]
    assert det.accuracy > det.baseline_accuracy and det.beats_baseline
    assert det.ci_low <= det.accuracy <= det.ci_high
    assert det.total > 300


def test_every_head_has_its_interval(results):
    """syntax.csv's intervals, one per head and relation, widen as the relation's words get
    fewer (tests/inputs/test_alignment.py recomputes them by hand)."""
    syntax = results["syntax"]["syntax"]
    few = syntax.sentences < 10  # too few sentences for an interval: none is drawn
    assert syntax[few].ci_low.isna().all() and syntax[few].ci_high.isna().all()
    syntax = syntax[~few]
    assert (syntax.ci_low <= syntax.ci_high).all() and syntax.ci_low.ge(0).all()
    width = (syntax.ci_high - syntax.ci_low).groupby(syntax.relation).mean()
    totals = syntax.groupby("relation").total.first()
    assert width[totals.idxmax()] < width[totals[totals >= 20].idxmin()]


def test_probe_beats_right_branching(results):
    uas = results["probe"]["probe"].set_index("parser").uas
    assert uas["attention_probe"] > uas["right_branching"] + 0.1
    assert 0 < uas["best_single_head"] < 1


def test_previous_token_head_and_sinks(results):
    tables = results["syntax"] | results["roles"]
    heads = join_heads([Syntax, Roles], tables, Thresholds(), 6, 12).set_index(["layer", "head"])
    assert heads.loc[(0, 2), "previous"] > 0.9
    assert "previous-token" in heads.loc[(0, 2), "roles"]
    assert heads.roles.str.contains("sink").any()
    assert heads.roles.str.contains("syntactic").any()


def test_syntax_state_does_not_grow(minilm):
    model, tokenizer = minilm
    sentences = read_conllu(EWT / "en_ewt-ud-dev.conllu")[:64]
    analysis = Syntax(Context(6, 12))

    def shapes():
        return {k: v.shape for k, v in vars(analysis).items() if k[0] != "_" and torch.is_tensor(v)}

    before = shapes()
    stream(model, Corpus(sentences, tokenizer, 512).batches(32), [analysis])
    assert shapes() == before and analysis.sentences == 64
