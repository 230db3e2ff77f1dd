"""How far to trust a circuit, on the induction model (tests/support/induction.py): every ablation
of ``patch_edges`` keeps its ends against the untouched model, the previous-token head's edges
into the induction heads' keys are stable, a task of random answers is not, the trust of a GQA
model is its ungrouped twin's, and bad input is one line."""

import numpy as np
import pytest
import torch
from induction import MODEL, MODEL_GQA, PREVIOUS_TOKEN
from test_patching import pairs, repeats_metric
from twins import ungrouped_twin

import probe
from probe.errors import ProbeError
from probe.interventions.edge_patching import _clean_means, patch_edges
from probe.interventions.faithfulness import ABLATIONS, resample_partners
from probe.interventions.graph import graph, sender_points

N = 20  # the copy length the induction model's constants were measured at


@pytest.fixture(scope="module")
def model():
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(MODEL, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def task():
    clean, corrupted = pairs(16, n=N, seed=1)
    return clean, corrupted, repeats_metric(clean["input_ids"], N)


def last_token_difference(answer, wrong):
    """Per pair: the logit difference answer − wrong where the last token is predicted."""

    def metric(logits, pairs=slice(None)):
        at = logits[:, -2].float()
        return (at.gather(-1, answer[pairs][:, None]) - at.gather(-1, wrong[pairs][:, None]))[:, 0]

    return metric


@pytest.fixture(scope="module")
def found(model, task):
    return probe.circuit(model, *task, 0.8)


@pytest.mark.parametrize("ablation", ABLATIONS)
def test_every_ablation_keeps_its_ends(model, task, ablation):
    """Every edge kept: the clean run, whatever the ablation. None kept: corrupted patching is
    the corrupted run, and resample ablation each pair's partner's clean run read with the
    pair's own metric, both from the untouched model."""
    clean, corrupted, metric = task
    n = len(graph(model).edges)
    ends = patch_edges(model, clean, corrupted, metric, [[True] * n, [False] * n],
                       ablation=ablation, seed=3)  # fmt: skip
    with torch.no_grad():
        torch.testing.assert_close(ends[0], metric(model(**clean).logits), atol=1e-4, rtol=0)
        if ablation == "corrupted":
            expected = metric(model(**corrupted).logits)
        elif ablation == "resample":
            partners = torch.from_numpy(resample_partners(3, 16))
            expected = metric(model(input_ids=clean["input_ids"][partners]).logits)
        else:
            return
    torch.testing.assert_close(ends[1], expected, atol=1e-4, rtol=0)


def test_mean_ablation_takes_the_mean_over_the_clean_runs(model, task):
    clean, _, _ = task
    g = graph(model)
    points, _ = sender_points(g)
    means = _clean_means(model, clean, 16, [slice(0, 5), slice(5, 16)], g)
    with torch.no_grad(), probe.trace(model, points) as cache:
        model(**clean)
    for p in points:
        torch.testing.assert_close(means[p][0], cache[p].double().mean(0).float(), atol=1e-5,
                                   rtol=1e-5)  # fmt: skip


def test_each_ablations_faithfulness_ends_at_1_and_0(found):
    _, curve = found
    trust = curve.attrs["trust"]
    total = curve.total_edges.iloc[0]
    ends = trust.ablations[trust.ablations.edges.isin([0, total])]
    assert set(ends.ablation) == set(ABLATIONS)
    for row in ends.itertuples():
        assert row.faithfulness == pytest.approx(1.0 if row.edges == total else 0.0, abs=1e-9)
    # Its own run with none kept is corrupted patching's 0 on the searched curve too.
    assert curve.faithfulness.iloc[0] == pytest.approx(0, abs=1e-6)
    assert trust.ablation == curve.attrs["ablation"] == "corrupted"


def test_the_previous_token_heads_edges_into_the_induction_keys_are_stable(found):
    _, curve = found
    trust = curve.attrs["trust"]
    s = trust.stability
    previous = "{}-{}".format(*PREVIOUS_TOKEN)
    into_keys = s[(s.sender == previous) & (s.input == "k") & s.receiver.str.startswith("1-")]
    print(into_keys.to_string(), "\njaccard", trust.jaccard, trust.jaccard_low, trust.jaccard_high)
    assert len(into_keys) == 4 and (into_keys.inclusion >= 0.9).all() and into_keys.stable.all()
    assert trust.resamples == 100 and 0 <= trust.jaccard_low <= trust.jaccard <= trust.jaccard_high
    # CPR and CMD of each ablation's curve, from its points at MIB's sizes.
    from probe.interventions.faithfulness import MIB_SIZES, mib_counts, mib_scores

    for row in trust.scores.itertuples():
        curve_ = trust.ablations[trust.ablations.ablation == row.ablation].set_index("edges")
        f = [curve_.faithfulness[k] for k in mib_counts(int(curve.total_edges.iloc[0]))]
        assert (row.cpr, row.cmd) == pytest.approx(mib_scores(f, MIB_SIZES), abs=1e-12)
    assert trust.pairs is not None and len(trust.pairs) == 16
    assert trust.pairs.faithfulness.mean() == pytest.approx(
        np.mean((trust.pairs.circuit - trust.pairs.ablated)
                / (trust.pairs.clean - trust.pairs.ablated)))  # fmt: skip


@pytest.mark.slow
def test_a_task_of_random_answers_is_not_stable(model, task):
    """The same prompts, scored by the logit difference of the true next token against a random
    one, then of a random answer against it: the noise's circuit is less stable, beyond the real
    task's interval, and its interval reaches below the page's 0.5."""
    clean, corrupted, _ = task
    ids = clean["input_ids"]
    g = torch.Generator().manual_seed(5)
    wrong = torch.randint(1, 64, (16,), generator=g)
    noise = torch.randint(1, 64, (16,), generator=g)
    found = {}
    for name, answer in (("real", ids[:, -1]), ("noise", noise)):
        _, curve = probe.circuit(model, clean, corrupted, last_token_difference(answer, wrong),
                                 0.8, ablations=["corrupted"])  # fmt: skip
        found[name] = curve.attrs["trust"]
        t = found[name]
        print(name, curve.attrs["chosen"], t.jaccard, t.jaccard_low, t.jaccard_high)
    assert found["noise"].jaccard < found["real"].jaccard_low
    assert found["noise"].jaccard_low < 0.5 <= found["real"].jaccard_low


@pytest.mark.slow
def test_a_gqa_models_trust_is_its_ungrouped_twins():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(MODEL_GQA, dtype=torch.float64).eval()
    twin = ungrouped_twin(model)
    clean, corrupted = pairs(8, n=12, seed=2)
    metric = repeats_metric(clean["input_ids"], 12)
    found = [probe.circuit(m, clean, corrupted, metric, 0.8, steps=2, resamples=20)
             for m in (model, twin)]  # fmt: skip
    (chosen, curve), (twin_chosen, twin_curve) = found
    trust, twins = curve.attrs["trust"], twin_curve.attrs["trust"]
    assert list(chosen.index) == list(twin_chosen.index)
    assert trust.ablations[["ablation", "edges"]].equals(twins.ablations[["ablation", "edges"]])
    for name in ("ablations", "scores", "pairs"):
        a, b = getattr(trust, name), getattr(twins, name)
        numbers = a.select_dtypes("number").columns
        np.testing.assert_allclose(a[numbers], b[numbers], atol=1e-9, rtol=0, err_msg=name)
    np.testing.assert_allclose(trust.stability.inclusion, twins.stability.inclusion, atol=0)
    assert (trust.jaccard, trust.jaccard_low) == (twins.jaccard, twins.jaccard_low)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"resamples": 1}, "at least 2"),
        ({"resamples": 2.5}, "integer of at least 2"),
        ({"resamples": True}, "integer of at least 2"),
        ({"ablation": "half"}, "ablation must be one of"),
        ({"ablations": ["corrupted", "noise"]}, "ablation must be one of"),
    ],
)
def test_bad_input_is_one_line(model, task, change, message):
    clean, corrupted, metric = task
    with pytest.raises(ProbeError, match=message) as e:
        probe.circuit(model, clean, corrupted, metric, 0.8, **change)
    assert "\n" not in str(e.value)


def test_resample_with_one_pair_and_no_difference_are_one_line(model, task):
    clean, corrupted, metric = task
    one = {"input_ids": clean["input_ids"][:1]}
    with pytest.raises(ProbeError, match="at least 2 pairs") as e:
        probe.circuit(model, one, {"input_ids": corrupted["input_ids"][:1]}, metric, 0.8,
                      ablation="resample")  # fmt: skip
    assert "\n" not in str(e.value)
    with pytest.raises(ProbeError, match="score alike") as e:
        probe.circuit(model, clean, clean, metric, 0.8, ablations=["corrupted"])
    assert "\n" not in str(e.value)
