"""Retrieval heads (probe.patterns.retrieval): hits on attention made by hand, the trials' layout,
and a
trained model whose induction head retrieves from a needle while its other heads do not."""

import numpy as np
import pandas as pd
import pytest
import torch
import transformers as tf
from induction import INDUCTION, MODEL, PREVIOUS_TOKEN
from treebanks import EWT, needs_ewt

import probe
from probe.capture.rows import RowBlock
from probe.inputs.treebank import iter_treebank
from probe.patterns.retrieval import DEPTHS, QUESTION, Trial, haystack, hits, needle_trials, scores

IDS = torch.tensor([0, 7, 8, 5, 6, 9, 9, 8, 4, 6, 9, 2])
# needle at 3..5 (5 6 9), the answer at 9..11 (6 9 2): queries 8, 9 and 10 predict them
TRIAL = Trial(tuple(IDS.tolist()), range(3, 6), range(9, 12), 8, 0.3, True)


def hand_made() -> torch.Tensor:
    """``[1, 5, 12, 12]``: head 0 retrieves 6 and 9 from the needle (2 is not in it); head 1
    attends to the previous token; head 2 to the answer's own 6, and to the 9 at 6, outside the
    needle but in the haystack; head 3 to the needle's wrong tokens; head 4 to the needle's 6
    from every query (right once)."""
    p = torch.zeros(1, 5, 12, 12)
    for q in range(12):
        p[0, 1, q, max(q - 1, 0)] = 1
        p[0, :, q, 0] += 1e-3  # ties are broken by the largest weight, not by position
    p[0, 0, 8, 4], p[0, 0, 9, 5], p[0, 0, 10, 3] = 1, 1, 1  # 6 and 9 right, 5 for 2 wrong
    p[0, 2, 8, 9], p[0, 2, 9, 6] = 1, 1
    p[0, 3, 8, 3], p[0, 3, 9, 3], p[0, 3, 10, 4] = 1, 1, 1
    p[0, 4, :, 4] = 1
    return p


def test_hits_on_attention_made_by_hand():
    p = hand_made()
    whole = hits(RowBlock.whole(p), IDS, TRIAL)
    assert whole.tolist() == [2, 0, 0, 0, 1]
    # in blocks of rows, and with keys that start later: the same counts
    blocks = [RowBlock(slice(a, b), slice(2, 12), p[:, :, a:b, 2:]) for a, b in ((0, 9), (9, 12))]
    assert sum(hits(b, IDS, TRIAL) for b in blocks).tolist() == [2, 0, 0, 0, 1]
    # the same attention with the needle left out: source the whole haystack 1..8
    null = Trial(TRIAL.ids, range(1, 9), TRIAL.answer, 8, 0.3, False)
    assert hits(RowBlock.whole(p), IDS, null).tolist() == [2, 0, 1, 0, 1]


def test_trials_lay_out_needle_question_and_answer():
    from tokenizers_util import wordpiece

    tokenizer = wordpiece()
    texts = ["the cat sat on the mat", "a dog ran in the park"] * 40
    hay = haystack(tokenizer, iter(texts), 50)
    assert len(hay) == 50
    trials = needle_trials(tokenizer, hay, [20, 50], seed=3)
    assert len(trials) == 2 * len(DEPTHS) * 2
    for t in trials:
        ids = list(t.ids)
        answer = ids[t.answer.start : t.answer.stop]
        assert t.answer.stop == len(ids) and len(answer) >= 2
        assert ids[0] == tokenizer.cls_token_id
        question = tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
        assert ids[t.answer.start - len(question) : t.answer.start] == question
        body = ids[1 : t.answer.start - len(question)]
        if t.needle:  # the needle ends with the answer's tokens, inside the haystack
            assert ids[t.source.stop - len(answer) : t.source.stop] == answer
            del body[t.source.start - 1 : t.source.stop - 1]
        else:
            assert t.source == range(1, 1 + t.length)
        assert body == hay[: t.length]
    first = [t for t in trials if t.needle and t.length == 50]
    assert first[0].source.start == 1 and first[-1].source.start == 51  # depths 0 and 1
    assert needle_trials(tokenizer, hay, [20], seed=3) == trials[: 2 * len(DEPTHS)]


@pytest.mark.slow
def test_a_trained_induction_head_retrieves_from_the_needle():
    """The tiny GPT-2 of tests/support/induction.py (trained on inputs of up to 61 tokens) on
    random-token trials: a needle of 8 tokens in a haystack of 30, then its first 3 tokens again as
    the question and the other 5 as the answer. Its induction heads copy the answer from the needle
    (random haystack tokens sometimes repeat the cue, so not always); its previous-token head does
    not; with the needle left out, nothing is retrieved."""
    model = tf.GPT2Model.from_pretrained(MODEL).eval()
    rng = np.random.default_rng(0)
    trials = []
    for _ in range(3):
        for depth in DEPTHS:
            hay, needle = rng.integers(1, 64, 30).tolist(), rng.integers(1, 64, 8).tolist()
            at = 1 + round(depth * 30)
            ids = [0, *hay[: at - 1], *needle, *hay[at - 1 :], *needle]
            answer = range(len(ids) - 5, len(ids))
            trials.append(Trial(tuple(ids), range(at, at + 8), answer, 30, depth, True))
            null = (0, *hay, *needle)
            trials.append(Trial(null, range(1, 31), range(34, 39), 30, depth, False))
    found = np.stack(list(scores(model, trials)))  # [trial, layer, head]
    real, null = found[0::2].mean(0), found[1::2].mean(0)
    # all four layer-1 heads do induction (support/induction.py): 0.55 to 0.65; layer 0 at most 0.06
    assert real[INDUCTION] > 0.5 and real[1].min() > 0.4, real
    assert real[PREVIOUS_TOKEN] < 0.1 and real[0].max() < 0.1, real
    assert null.max() < 0.1, null


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory, minilm):
    """A small random Llama that reads MiniLM's tokens, saved as a user's model folder."""
    _, tokenizer = minilm
    torch.manual_seed(0)
    config = tf.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                            num_hidden_layers=2, intermediate_size=64,
                            vocab_size=len(tokenizer), max_position_embeddings=256)  # fmt: skip
    folder = tmp_path_factory.mktemp("llama")
    tf.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@needs_ewt()
@pytest.mark.slow
def test_the_analysis_writes_scores_roles_and_a_map(llama_folder, tmp_path):
    from typer.testing import CliRunner

    from probe.app.cli import app

    out = tmp_path / "report"
    dev = str(EWT / "en_ewt-ud-dev.conllu")
    args = ["analyze", "-m", str(llama_folder), "-a", "retrieval", "-q", "--out", str(out),
            "-t", dev, "--retrieval-lengths", "64,128,4096"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    table = pd.read_csv(out / "retrieval.csv")
    # 4096 is capped by the context (256 - 64 kept free): lengths 64, 128 and 192
    assert sorted(table.length.unique()) == [64, 128, 192]
    assert len(table) == 2 * 4 * 3 * len(DEPTHS) * 2  # heads × lengths × depths × (needle, null)
    heads = pd.read_csv(out / "heads.csv", dtype={"roles": str})  # empty: not a float column
    mean = table[table.needle].groupby(["layer", "head"]).score.mean().to_numpy()
    np.testing.assert_allclose(
        heads.retrieval_score, mean, rtol=1e-12
    )  # float64 means of the table
    assert (heads.retrieval_low <= heads.retrieval_score).all()
    held = heads.roles.fillna("").map(lambda roles: "retrieval" in roles.split(";"))
    assert held.tolist() == (heads.retrieval_score > 0.1).tolist()
    assert "Retrieval score by length and depth" in (out / "index.html").read_text()
    # the scores are probe.patterns.retrieval's on the same trials
    model = tf.AutoModel.from_pretrained(llama_folder).eval()
    tokenizer = tf.AutoTokenizer.from_pretrained(llama_folder)
    texts = [" ".join(s.words) for s in iter_treebank([dev])]
    hay = haystack(tokenizer, texts, 192)
    trials = needle_trials(tokenizer, hay, [64], seed=0)
    found = np.stack(list(scores(model, trials)))
    got = table[table.length == 64].score.to_numpy().reshape(len(trials), 8)
    # float32 attention sums, another run's: rounding scales with the largest score
    np.testing.assert_allclose(
        got, found.reshape(len(trials), 8), rtol=1e-5, atol=1e-6 * np.abs(found).max()
    )


def test_bad_lengths_are_one_line():
    from analyses.retrieval import parse_lengths

    assert parse_lengths("2048, 1024,1024") == [1024, 2048]
    for text in ("", "a,b", "0,8", "-4"):
        with pytest.raises(probe.ProbeError, match=r"^--retrieval-lengths takes positive"):
            parse_lengths(text)
