"""Grouped-query attention in TransformerLens's ungrouped view: on Llama, Qwen3 and Gemma (2 and 3,
with sliding windows; Gemma 2 with soft-capping), edges, circuits and AtP* give what they give on
the model's ungrouped twin (tests/support/twins.py), each query head a receiver with its own query,
key and value inputs; a model whose keys cannot be split per query head is refused in one line."""

import pytest
import torch
from twins import causal_lm, ungrouped_twin

import probe
from probe.capture.modes import ungrouped
from probe.interventions.edge_patching import patch_edges
from probe.interventions.graph import graph

KINDS = ["llama", "qwen3", "gemma2", "gemma3_text"]  # 4 query heads, 2 key/value heads


def task(seed: int = 1):
    """Three pairs of 9 tokens (longer than the sliding windows, 4), three tokens corrupted, and
    the log-probability of the last token at the position before it."""
    g = torch.Generator().manual_seed(seed)
    clean = {"input_ids": torch.randint(3, 99, (3, 9), generator=g)}
    corrupted = {"input_ids": clean["input_ids"].clone()}
    corrupted["input_ids"][:, 2:5] = torch.randint(3, 99, (3, 3), generator=g)
    answer = clean["input_ids"][:, -1]

    def metric(logits):
        logp = torch.log_softmax(logits[:, -2].float(), dim=-1)
        return logp[torch.arange(len(logp)), answer[: len(logp)]]

    return clean, corrupted, metric


@pytest.fixture(scope="module", params=KINDS)
def pair(request):
    model = causal_lm(request.param)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    return request.param, model, ungrouped_twin(model)


POINTS = ["hook_k_input", "hook_v_input", "hook_k", "hook_v", "hook_rot_k", "hook_pattern"]


def test_the_ungrouped_view_is_the_twins(pair):
    """Every key and value point has a head per query head, as the twin's, and the same values;
    an edit of one query head's key input reaches that head alone (not the other head of its
    group), as on the twin."""
    _, model, twin = pair
    ids = task()[0]["input_ids"]
    with torch.no_grad():
        with ungrouped(), probe.trace(model, POINTS) as seen:
            out = model(input_ids=ids).logits
        with probe.trace(twin, POINTS) as expected:
            twin_out = twin(input_ids=ids).logits
    torch.testing.assert_close(out, twin_out, atol=1e-6, rtol=0)
    for name in expected:
        assert seen[name].shape == expected[name].shape, name
        torch.testing.assert_close(seen[name], expected[name], atol=1e-6, rtol=0)

    def edit(x, hook):  # query head 0's keys in layer 1 from another input
        x = x.clone()
        x[:, :, 0] = x[:, :, 0].flip(1)
        return x

    patterns = []
    for m, view in ((model, ungrouped), (twin, torch.no_grad)):
        fns = {"blocks.1.hook_k_input": edit}
        with torch.no_grad(), view(), probe.hooks(m, fns), probe.trace(m, "hook_pattern") as cache:
            m(input_ids=ids)
        patterns.append(cache["blocks.1.attn.hook_pattern"])
    torch.testing.assert_close(patterns[0], patterns[1], atol=1e-6, rtol=0)
    unedited = expected["blocks.1.attn.hook_pattern"]
    assert not torch.allclose(patterns[0][:, 0], unedited[:, 0], atol=1e-3)
    torch.testing.assert_close(patterns[0][:, 1:], unedited[:, 1:], atol=1e-6, rtol=0)


@pytest.mark.parametrize("method", ["eap", "eap-ig"])
def test_edges_are_the_twins(pair, method):
    """Score for score, with the same names: every query head receives q, k and v."""
    _, model, twin = pair
    clean, corrupted, metric = task()
    scores = probe.edges(model, clean, corrupted, metric, method=method, steps=3)
    expected = probe.edges(twin, clean, corrupted, metric, method=method, steps=3)
    assert len(graph(model).edges) == len(graph(twin).edges) == len(scores)
    names = ["sender", "receiver", "input"]
    assert scores[names].equals(expected[names])
    heads = {f"{layer}-{head}" for layer in (0, 1) for head in range(4)}
    assert set(scores[scores.input == "k"].receiver) == heads
    gap = (scores.score - expected.score).abs().max()
    print(method, "max |score − twin's|", gap, "largest score", expected.score.abs().max())
    torch.testing.assert_close(
        torch.tensor(scores.score.values), torch.tensor(expected.score.values), atol=1e-6, rtol=1e-5
    )
    for column in ("score_low", "score_high"):
        assert (scores[column] - expected[column]).abs().max() < 1e-5
    for side in ("clean", "corrupted"):
        assert scores.attrs[side] == pytest.approx(expected.attrs[side], abs=1e-6)


@pytest.mark.slow
def test_circuit_is_the_twins(pair):
    """The exact edge patching of random sets of edges (float32), and in float64, where the
    faithfulness of a random model's small clean − corrupted gap is exact to rounding, the
    curve and the edges kept."""
    _, model, twin = pair
    clean, corrupted, metric = task()
    n = len(graph(model).edges)
    kept = torch.rand(6, n, generator=torch.Generator().manual_seed(2)) < 0.5
    kept[0], kept[1] = True, False
    found = patch_edges(model, clean, corrupted, metric, kept)
    expected = patch_edges(twin, clean, corrupted, metric, kept)
    print("max |patched metric − twin's|", (found - expected).abs().max())
    with torch.no_grad():  # every edge kept: the clean run; none: the corrupted one
        torch.testing.assert_close(found[0], metric(model(**clean).logits), atol=1e-5, rtol=0)
        torch.testing.assert_close(found[1], metric(model(**corrupted).logits), atol=1e-5, rtol=0)
    torch.testing.assert_close(found, expected, atol=1e-5, rtol=0)
    model64, twin64 = model.double(), twin.double()
    try:
        chosen, curve = probe.circuit(model64, clean, corrupted, metric, 0.8, steps=3)
        twin_chosen, twin_curve = probe.circuit(twin64, clean, corrupted, metric, 0.8, steps=3)
    finally:
        model.float(), twin.float()
    print(curve.to_string())
    curve.attrs.pop("max_bytes"), twin_curve.attrs.pop("max_bytes")  # the memory free at each call
    # the trust's tables are compared in test_circuit_trust.py
    curve.attrs.pop("trust"), twin_curve.attrs.pop("trust")
    assert curve.attrs == twin_curve.attrs
    assert list(chosen.index) == list(twin_chosen.index)
    assert curve.edges.equals(twin_curve.edges)
    assert (curve.faithfulness - twin_curve.faithfulness).abs().max() < 1e-9


@pytest.mark.parametrize("hook", ["hook_rot_q", "hook_rot_k"])
@pytest.mark.parametrize("per_position", [False, True])
def test_atp_star_is_the_twins(pair, hook, per_position):
    """AtP* at the rotated queries and keys: a row per query head (a key patched for one query
    head), as on the twin; Gemma 2's soft cap refuses on both alike."""
    kind, model, twin = pair
    clean, corrupted, metric = task()

    def run(m):
        return probe.attribute(m, clean, corrupted, metric, "atp*", hook=hook,
                               per_position=per_position)  # fmt: skip

    if kind == "gemma2":
        for m in (model, twin):
            with pytest.raises(probe.ProbeError, match="soft cap"):
                run(m)
        return
    found, expected = run(model), run(twin)
    assert found[["layer", "head"]].equals(expected[["layer", "head"]])
    assert len(found) == 2 * 4 * (9 if per_position else 1)
    print(hook, "max |atp* − twin's|", (found.attribution - expected.attribution).abs().max())
    torch.testing.assert_close(
        torch.tensor(found.attribution.values),
        torch.tensor(expected.attribution.values),
        atol=1e-6,
        rtol=1e-5,
    )
    assert ("query head" in found.attrs.get("note", "")) == (hook == "hook_rot_k")


def test_fused_keys_are_refused_in_one_line():
    """Phi-3 computes queries, keys and values in one projection: no key input per query head."""
    model = causal_lm("phi3")
    clean, corrupted, metric = task()
    said = "Phi3ForCausalLM computes its queries, keys and values in one fused projection"
    for call in (
        lambda: probe.edges(model, clean, corrupted, metric),
        lambda: graph(model),
    ):
        with pytest.raises(probe.ProbeError, match=said) as e:
            call()
        assert "\n" not in str(e.value)
    from analyses.circuit import Circuit

    assert said in Circuit.unsupported(model)
    refused = pytest.raises(probe.ProbeError, match="Phi3Attention hands its attention 2 key")
    with torch.no_grad(), ungrouped(), probe.trace(model, "hook_z"), refused:
        model(**clean)
    with torch.no_grad():  # and the model is as it was
        model(**clean)


def analyze(model: str, out):
    from typer.testing import CliRunner

    from probe.app.cli import app

    args = ["analyze", "-t", "sample", "-q", "--model", model, "-a", "circuit", "--task",
            "repeats", "--lm-head", "--out", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return out


def test_the_trained_model_is_small_and_grouped():
    from induction import MODEL_GQA
    from transformers import AutoConfig

    assert sum(f.stat().st_size for f in MODEL_GQA.iterdir()) < 1_000_000
    config = AutoConfig.from_pretrained(MODEL_GQA)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)


@pytest.mark.slow
def test_circuit_analysis_on_the_trained_grouped_model(tmp_path):
    """``probe analyze -a circuit --task repeats --lm-head`` on the Llama with grouped-query
    attention trained on repeats (tests/support/make_induction_llama.py): 80% faithfulness with at
    most a quarter of the edges; and its tables are its ungrouped twin's."""
    import pandas as pd
    from induction import MODEL_GQA
    from transformers import AutoTokenizer, LlamaForCausalLM

    report = analyze(str(MODEL_GQA), tmp_path / "grouped")
    run = pd.read_csv(report / "circuit_run.csv").iloc[0]
    curve = pd.read_csv(report / "circuit_faithfulness.csv").set_index("edges")
    print(curve.to_string())
    total, chosen = int(run.total_edges), int(run.chosen_edges)
    print(f"faithfulness {run.faithfulness:.3f} with {chosen} of {total} edges")
    assert total == 110  # as the induction GPT-2's: the graph of 2 layers of 4 query heads
    assert curve.faithfulness[chosen] >= 0.8 > curve.faithfulness[chosen - 1]
    assert chosen <= total / 4
    # The 9-back head feeds every layer-1 head's keys, the 8-back heads their values
    # (tests/support/induction.py), the keys of heads sharing a key/value head each scored apart.
    edges = pd.read_csv(report / "circuit_edges.csv", keep_default_na=False)
    into = edges[edges.sender.str.startswith("0-") & edges.receiver.str.startswith("1-")]
    for (receiver, part), scores in into[into.input != "q"].groupby(["receiver", "input"]):
        strongest = scores.loc[scores.score.idxmax()].sender
        assert strongest in ({"0-1"} if part == "k" else {"0-2", "0-3"}), (receiver, part)

    model = LlamaForCausalLM.from_pretrained(MODEL_GQA, dtype=torch.float32)
    ungrouped_twin(model).save_pretrained(tmp_path / "twin")
    AutoTokenizer.from_pretrained(MODEL_GQA).save_pretrained(tmp_path / "twin")
    twin = analyze(str(tmp_path / "twin"), tmp_path / "twin-report")
    for name in ("circuit_edges", "circuit_faithfulness"):
        found, expected = (
            pd.read_csv(r / f"{name}.csv", keep_default_na=False) for r in (report, twin)
        )
        numbers = [c for c in found.columns if found[c].dtype == float]
        others = [c for c in found.columns if c not in numbers]
        assert found[others].equals(expected[others]), name  # the edges, and those kept
        gap = (found[numbers] - expected[numbers]).abs().max().max()
        print(name, "max difference from the twin's", gap)
        assert gap < 1e-4, name
