"""Memory bounded by max_bytes, not by the number of pairs: the runs of patching, attribution,
edges, edge patching and circuits take the pairs a chunk at a time where they do not fit the
budget at once, and give what every pair at once gives (means, intervals, curves), to float32
rounding; a metric that cannot be split is refused in one line."""

import re

import numpy as np
import pytest
import torch
from induction import MODEL
from test_patching import pairs

import probe
from probe.interventions.edge_patching import patch_edges
from probe.interventions.graph import graph
from probe.interventions.guard import HOOK_DICTS

N = 6  # the copy length: 13 positions
PAIRS = 7  # chunks of two at the smallest budget: 2, 2, 2, 1
WHOLE = 4 << 30


@pytest.fixture(scope="module")
def model():
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(MODEL, dtype=torch.float32).eval()


class Metric:
    """Per pair: the clean second copy's predictable tokens' mean log-probability, of the pairs
    it is given; ``given`` records which."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids, self.given = ids, []

    def __call__(self, logits, pairs):
        self.given.append((pairs.start, pairs.stop))
        logp = torch.log_softmax(logits.float(), dim=-1)
        rows = self.ids[pairs]
        picked = logp[:, N + 1 : 2 * N].gather(-1, rows[:, N + 2 : 2 * N + 1, None])[..., 0]
        return picked.mean(-1)


@pytest.fixture(scope="module")
def task():
    clean, corrupted = pairs(PAIRS, n=N, seed=3)
    return clean, corrupted


def smallest(call) -> int:
    """The smallest budget that the one-line error for ``max_bytes=1`` names."""
    with pytest.raises(probe.ProbeError, match=r"too small for two pairs") as e:
        call(1)
    assert "\n" not in str(e.value)
    return int(re.search(r"at least max_bytes=([\d,]+)", str(e.value)).group(1).replace(",", ""))


def both(call, ids):
    """``call(metric, max_bytes)`` at the smallest budget and with every pair at once, and
    the chunks of pairs the metric was given at the smallest."""
    low = smallest(lambda b: call(Metric(ids), b))
    metric = Metric(ids)
    chunked = call(metric, low)
    given = set(metric.given)
    whole_metric = Metric(ids)
    whole = call(whole_metric, WHOLE)
    assert set(whole_metric.given) == {(0, PAIRS)}
    assert len(given) > 1 and (0, PAIRS) not in given, given  # it did run in chunks
    return chunked, whole


def close(a, b, scale=1.0):
    """Equal to float32 rounding (runs of fewer pairs round differently)."""
    torch.testing.assert_close(
        _float64(a),
        _float64(b),
        rtol=1e-5,
        atol=1e-6 * scale,
        equal_nan=True,
    )


def _float64(x) -> torch.Tensor:
    return x.double() if isinstance(x, torch.Tensor) else torch.tensor(np.array(x, np.float64))


def same_table(chunked, whole, columns):
    for column in columns:
        close(chunked[column].values, whole[column].values, float(whole[columns[0]].abs().max()))
    for key in ("clean", "corrupted"):
        if key in whole.attrs:
            close(chunked.attrs[key], whole.attrs[key])
    assert chunked.attrs.get("metric") == whole.attrs.get("metric") == "per pair"


@pytest.mark.slow
@pytest.mark.parametrize(("method", "hook", "per_position"),
                         [("atp", "hook_z", False), ("ig", "hook_result", True),
                          ("atp*", "hook_q", False)])  # fmt: skip
def test_attribute_in_chunks(model, task, method, hook, per_position):
    clean, corrupted = task

    def call(metric, max_bytes):
        return probe.attribute(model, clean, corrupted, metric, method, hook=hook,
                               per_position=per_position, steps=2, max_bytes=max_bytes)  # fmt: skip

    chunked, whole = both(call, clean["input_ids"])
    assert whole.attribution_low.notna().all()
    same_table(chunked, whole, ["attribution", "attribution_low", "attribution_high"])


@pytest.mark.slow
@pytest.mark.parametrize("per_position", [False, True])
def test_patch_in_chunks(model, task, per_position):
    clean, corrupted = task

    def call(metric, max_bytes):
        return probe.patch(model, clean, corrupted, metric, per_position=per_position,
                           max_bytes=max_bytes)  # fmt: skip

    chunked, whole = both(call, clean["input_ids"])
    assert whole.effect_low.notna().all()
    same_table(chunked, whole, ["effect", "effect_low", "effect_high", "metric", "recovered"])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eap", "eap-ig"])
def test_edges_in_chunks(model, task, method):
    clean, corrupted = task

    def call(metric, max_bytes):
        return probe.edges(model, clean, corrupted, metric, method, 2, max_bytes=max_bytes)

    chunked, whole = both(call, clean["input_ids"])
    assert chunked.attrs["chunks"] > whole.attrs["chunks"] == 1
    same_table(chunked, whole, ["score", "score_low", "score_high"])


@pytest.mark.slow
def test_patch_edges_and_circuit_in_chunks(model, task):
    clean, corrupted = task
    n = len(graph(model).edges)
    kept = torch.rand(4, n, generator=torch.Generator().manual_seed(5)) < 0.5

    def patched(metric, max_bytes):
        return patch_edges(model, clean, corrupted, metric, kept, max_bytes=max_bytes)

    chunked, whole = both(patched, clean["input_ids"])
    assert chunked.shape == whole.shape == (4, PAIRS)
    close(chunked, whole, float(whole.abs().max()))

    scores = probe.edges(model, clean, corrupted, Metric(clean["input_ids"]), "eap", 1)

    def circuit(metric, max_bytes):
        return probe.circuit(model, clean, corrupted, metric, 0.8, scores=scores,
                             max_bytes=max_bytes)  # fmt: skip

    (edges_a, curve_a), (edges_b, curve_b) = both(circuit, clean["input_ids"])
    assert list(curve_a.edges) == list(curve_b.edges)
    close(curve_a.faithfulness.values, curve_b.faithfulness.values)
    assert curve_a.attrs.pop("max_bytes") < curve_b.attrs.pop("max_bytes") == WHOLE
    trust_a, trust_b = curve_a.attrs.pop("trust"), curve_b.attrs.pop("trust")
    close(trust_a.ablations.faithfulness.values, trust_b.ablations.faithfulness.values)
    assert curve_a.attrs == curve_b.attrs and list(edges_a.index) == list(edges_b.index)


def _hooks(model) -> int:
    return sum(len(getattr(m, name, {})) for m in model.modules() for name in HOOK_DICTS)


@pytest.mark.parametrize("call", ["attribute", "patch", "edges", "patch_edges"])
def test_a_metric_that_cannot_be_split_is_one_line(model, task, call):
    """Where the pairs do not fit at once: a scalar metric (the batch's one value) and a metric
    of the logits alone (it would be given another chunk's logits than its per-pair data are
    for) are refused in one line that says what to do, and the model is left as it was."""
    clean, corrupted = task
    ids = clean["input_ids"]
    per_pair = Metric(ids)

    def scalar(logits, pairs):
        return per_pair(logits, pairs).mean()

    def logits_alone(logits):
        return per_pair(logits, slice(0, len(logits)))

    def run(metric, max_bytes):
        if call == "patch_edges":
            kept = torch.ones(1, len(graph(model).edges), dtype=torch.bool)
            return patch_edges(model, clean, corrupted, metric, kept, max_bytes=max_bytes)
        return getattr(probe, call)(model, clean, corrupted, metric, max_bytes=max_bytes)

    low = smallest(lambda b: run(per_pair, b))
    with torch.no_grad():
        before = model(**clean).logits
    hooks = _hooks(model)
    with pytest.raises(probe.ProbeError, match=r"one value per pair.*max_bytes") as e:
        run(scalar, low)
    assert "\n" not in str(e.value) and "scalar" in str(e.value)
    with pytest.raises(probe.ProbeError, match=r"parameter pairs.*raise max_bytes") as e:
        run(logits_alone, low)
    assert "\n" not in str(e.value)
    assert _hooks(model) == hooks and all(p.grad is None for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(model(**clean).logits, before)
    run(scalar, WHOLE)  # every pair at once: the batch's value, as TransformerLens's
    run(logits_alone, WHOLE)


def test_moments_equal_every_pair_at_once():
    """Chan's update over chunks of 1, 2 and 5 pairs against the mean and t-interval of all."""
    from probe.interventions.pairs import Moments, mean_intervals

    values = torch.randn(3, 4, 11, generator=torch.Generator().manual_seed(0)) * 5 + 2
    moments = Moments()
    for rows in (slice(0, 1), slice(1, 3), slice(3, 8), slice(8, 11)):
        moments.add(values[..., rows])
    for found, expected in zip(moments.intervals(), mean_intervals(values), strict=True):
        torch.testing.assert_close(found, expected, rtol=1e-12, atol=1e-12)


def test_the_analysis_budget_is_probes():
    from analyses.circuit import BUDGET
    from probe.interventions.gradients import MAX_BYTES

    assert BUDGET.default == MAX_BYTES


@pytest.mark.parametrize("call", ["attribute", "patch", "edges"])
def test_the_default_budget_is_a_share_of_the_devices_free_memory(model, task, call, monkeypatch):
    """Without max_bytes a call holds half the memory free on the model's device: a
    TransformerLens metric of the logits alone runs unchanged where its pairs fit the machine,
    and is refused in one line where they do not; the result records the budget it used."""
    from probe.interventions import gradients

    clean, corrupted = task
    per_pair = Metric(clean["input_ids"])

    def logits_alone(logits):
        return per_pair(logits, slice(0, len(logits)))

    def run(metric):
        return getattr(probe, call)(model, clean, corrupted, metric)

    monkeypatch.setattr(gradients, "free_bytes", lambda device: 2 * WHOLE)
    assert run(logits_alone).attrs["max_bytes"] == WHOLE
    low = smallest(lambda b: getattr(probe, call)(model, clean, corrupted, per_pair, max_bytes=b))
    monkeypatch.setattr(gradients, "free_bytes", lambda device: 2 * low)
    with pytest.raises(probe.ProbeError, match=r"parameter pairs.*raise max_bytes") as e:
        run(logits_alone)
    assert "\n" not in str(e.value)
    table = run(per_pair)  # a metric that takes pairs runs in chunks within the same budget
    assert table.attrs["max_bytes"] == low and table.attrs["chunks"] > 1
    monkeypatch.setattr(gradients, "free_bytes", lambda device: None)  # not readable
    assert run(per_pair).attrs["max_bytes"] == gradients.MAX_BYTES


def test_a_cpus_free_memory_is_read_from_the_kernel():
    from pathlib import Path

    from probe.interventions.gradients import free_bytes

    meminfo = Path("/proc/meminfo")
    if not meminfo.exists():
        pytest.skip("no /proc/meminfo on this system: the budget is MAX_BYTES there")
    total = int(
        next(x for x in meminfo.read_text().splitlines() if x.startswith("MemTotal:")).split()[1]
    )
    assert 0 < free_bytes(torch.device("cpu")) <= total * 1024
