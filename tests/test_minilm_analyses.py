"""The analyses on the real pretrained MiniLM over 200 sentences of UD English EWT dev."""

import pytest
import torch
from conftest import EWT, needs_ewt

from analyses.probing import ProbeAnalysis
from analyses.roles import RolesAnalysis, best_relation_per_head, heads_table
from analyses.syntax import SyntaxAnalysis
from probe.corpus import encode, max_tokens
from probe.runner import run
from probe.treebank import read_conllu

pytestmark = needs_ewt()


@pytest.fixture(scope="module")
def results(minilm):
    model, tokenizer = minilm
    sentences = read_conllu(EWT / "en_ewt-ud-dev.conllu")[:200]
    corpus = encode(sentences, tokenizer, max_tokens(model.config, tokenizer))
    syntax, roles = SyntaxAnalysis(6, 12, seed=0), RolesAnalysis(6, 12)
    probe_analysis = ProbeAnalysis(len(sentences), seed=0)
    run(model, corpus, [syntax, roles, probe_analysis], batch_size=32)
    return syntax, roles, probe_analysis


def test_det_best_head_beats_its_best_offset(results):
    best = results[0].tables()["syntax_best"].set_index("relation")
    det = best.loc["det"]
    assert det.accuracy > det.baseline_accuracy and det.beats_baseline
    assert det.ci_low <= det.accuracy <= det.ci_high
    assert det.total > 300


def test_probe_beats_right_branching(results):
    figures = results[2].result()
    assert figures["uas"] > figures["right_branching_uas"] + 0.1
    assert 0 < figures["best_head_uas"] < 1


def test_previous_token_head_and_sinks(results):
    syntax_tables, role_tables = results[0].tables(), results[1].tables()
    best = best_relation_per_head(syntax_tables["syntax"], syntax_tables["syntax_baselines"])
    heads = heads_table(role_tables["head_stats"], role_tables["head_similarity"], best)
    heads = heads.set_index(["layer", "head"])
    assert heads.loc[(0, 2), "previous"] > 0.9
    assert "previous-token" in heads.loc[(0, 2), "roles"]
    assert heads.roles.str.contains("sink").any()
    assert heads.roles.str.contains("syntactic").any()


def test_syntax_state_does_not_grow(results):
    syntax = results[0]
    sizes = {k: v.shape for k, v in vars(syntax).items() if torch.is_tensor(v)}
    fresh = SyntaxAnalysis(6, 12)
    assert sizes == {k: v.shape for k, v in vars(fresh).items() if torch.is_tensor(v)}
