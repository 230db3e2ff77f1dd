"""A circuit's trust (#63) against independent computations: the streamed bootstrap against the
same resamples computed from a full [pairs, edges] matrix, whatever the chunks; the stability
against Python sets; the faithfulness's resamples and per-pair values against their
definitions; MIB's CPR and CMD against integrals known in closed form; and bad input refused in
one line."""

import numpy as np
import pytest
import torch

from probe.errors import ProbeError
from probe.inference import t975
from probe.interventions import faithfulness as F
from probe.interventions import stability as S


def _scores(pairs=37, edges=23, seed=0):
    return np.random.default_rng(seed).normal(size=(pairs, edges))


def _by_chunks(scores, size, order=None, resamples=50, seed=3):
    boot = S.BootstrapSums(scores.shape[1], resamples, seed)
    starts = list(range(0, len(scores), size))
    for start in order(starts) if order else starts:
        rows = slice(start, min(start + size, len(scores)))
        boot.add(scores[rows], rows)
    return boot


def _top(means, k):
    """The top k edges by |score|, ties to the later edge, as circuit's reversed stable sort."""
    return set(sorted(range(len(means)), key=lambda e: (-abs(means[e]), -e))[:k])


def test_bootstrap_means_are_the_full_matrix_s_whatever_the_chunks():
    scores = _scores()
    w = S.bootstrap_weights(3, 50, np.arange(len(scores)))  # [resamples, pairs]
    expected = (w @ scores) / w.sum(1, keepdims=True)
    results = [
        _by_chunks(scores, size, order)
        for size in (1, 5, 16, 37)
        for order in (None, lambda s: s[::-1], lambda s: s[1::2] + s[::2])
    ]
    for boot in results:
        np.testing.assert_allclose(boot.means(), expected, rtol=1e-12, atol=1e-14)
        assert boot.pairs == len(scores)
    circuit = [3, 7, 11, 0]
    first = results[0].stability(circuit)
    for boot in results[1:]:
        other = boot.stability(circuit)
        np.testing.assert_array_equal(other.inclusion, first.inclusion)
        assert other.jaccard_mean == first.jaccard_mean
    # a torch chunk (as edges holds them, on any device) and index arrays give the same sums
    boot = S.BootstrapSums(scores.shape[1], 50, 3)
    boot.add(torch.from_numpy(scores[:20]), np.arange(20))
    boot.add(torch.from_numpy(scores[20:]), np.arange(20, 37))
    np.testing.assert_allclose(boot.means(), expected, rtol=1e-12, atol=1e-14)


def test_merged_halves_are_the_whole():
    scores = _scores()
    whole = _by_chunks(scores, 37)
    a, b = S.BootstrapSums(23, 50, 3), S.BootstrapSums(23, 50, 3)
    a.add(scores[:10], slice(0, 10))
    b.add(scores[10:], slice(10, 37))
    a.merge(b)
    np.testing.assert_allclose(a.means(), whole.means(), rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="seed"):
        a.merge(S.BootstrapSums(23, 50, 4))


def test_stability_is_its_definition_on_python_sets():
    scores = _scores(pairs=12, edges=15, seed=1)
    boot = _by_chunks(scores, 5, resamples=40)
    circuit = [2, 5, 9]
    found = boot.stability(circuit)
    w = S.bootstrap_weights(3, 40, np.arange(12))
    full, jaccards, held = set(circuit), [], np.zeros(15)
    for row in w:
        if row.sum() == 0:
            continue
        mine = _top((row @ scores) / row.sum(), len(circuit))
        jaccards.append(len(mine & full) / len(mine | full))
        held[list(mine)] += 1
    assert found.size == 3 and found.resamples == 40
    assert found.empty == int((w.sum(1) == 0).sum())
    np.testing.assert_allclose(found.jaccard, jaccards, rtol=0, atol=1e-15)
    np.testing.assert_allclose(found.inclusion, held / len(jaccards), rtol=0, atol=1e-15)
    np.testing.assert_array_equal(found.stable, held / len(jaccards) >= 0.9)
    assert found.jaccard_mean == pytest.approx(np.mean(jaccards), abs=1e-15)
    low, high = np.percentile(jaccards, [2.5, 97.5])
    assert (found.jaccard_low, found.jaccard_high) == pytest.approx((low, high), abs=1e-15)
    flags = np.zeros(15, dtype=bool)
    flags[circuit] = True
    assert boot.stability(flags).jaccard_mean == found.jaccard_mean  # flags or positions


def test_top_edges_break_ties_as_circuit_does():
    rng = np.random.default_rng(6)
    scores = np.array([[0.5, -2.0, 2.0, 0.5, 1.0, -0.5], [0.0] * 6, [3.0, 1, 2, -1, 1, 0]])
    scores = np.r_[scores, rng.integers(-2, 3, size=(30, 6)).astype(float)]  # many ties
    for k in range(8):
        kept = S.top_edges(scores, k)
        for row, flags in zip(scores, kept, strict=True):
            order = np.abs(row).argsort(kind="stable")[::-1][:k]  # circuit's rule
            assert set(np.flatnonzero(flags)) == set(order) == _top(row, k)
    wide = rng.integers(-3, 4, size=(20, 200)).astype(float)
    for k in (1, 37, 150, 199):
        order = np.abs(wide).argsort(axis=-1, kind="stable")[:, ::-1][:, :k]
        expected = np.zeros(wide.shape, dtype=bool)
        np.put_along_axis(expected, order, True, axis=-1)
        np.testing.assert_array_equal(S.top_edges(wide, k), expected)


def test_a_planted_circuit_is_stable_and_noise_is_not():
    rng = np.random.default_rng(2)
    noise = rng.normal(scale=0.3, size=(40, 30))
    real = noise + np.r_[np.ones(5), np.zeros(25)]
    planted = S.BootstrapSums(30, seed=5)
    planted.add(real, slice(0, 40))
    kept = planted.stability(range(5))
    assert kept.stable[:5].all() and not kept.stable[5:].any()
    assert kept.jaccard_mean == kept.jaccard_low == 1.0
    only_noise = S.BootstrapSums(30, seed=5)
    only_noise.add(noise, slice(0, 40))
    full = S.top_edges(noise.mean(0), 5)
    shaky = only_noise.stability(full)
    assert shaky.jaccard_mean < 0.6 and shaky.jaccard_high < kept.jaccard_low
    assert shaky.stable.sum() < 5


def test_a_resample_that_draws_no_pair_is_left_out_and_counted():
    boot = S.BootstrapSums(4, resamples=60, seed=0)
    boot.add(np.array([[1.0, 2.0, 3.0, 4.0]]), [0])
    empty = int((boot.weights == 0).sum())
    assert 0 < empty < 60  # one pair: each resample draws none with probability 1/e
    assert np.isnan(boot.means()[boot.weights == 0]).all()
    found = boot.stability([3])
    assert found.empty == empty and len(found.jaccard) == 60 - empty
    assert (found.jaccard == 1).all() and found.inclusion[3] == 1


def test_faithfulness_resamples_are_their_definition():
    rng = np.random.default_rng(4)
    clean = rng.normal(3, 1, size=25)
    corrupted = rng.normal(0, 1, size=25)
    circuit = corrupted + 0.8 * (clean - corrupted) + rng.normal(0, 0.2, size=25)
    found = F.faithfulness_resamples(clean, corrupted, circuit, seed=9)
    spread = clean.mean() - corrupted.mean()
    assert found.value == pytest.approx((circuit.mean() - corrupted.mean()) / spread, abs=1e-12)
    w = S.bootstrap_weights(9, 10, np.arange(25))  # the stability's resamples 0 … 9
    means = [(r @ v) / r.sum() for r in w for v in (circuit, corrupted, clean)]
    by_hand = [
        (c - k) / (d - k) for c, k, d in zip(means[::3], means[1::3], means[2::3], strict=True)
    ]
    np.testing.assert_allclose(found.values, by_hand, rtol=1e-12)
    half = t975(9) * np.std(by_hand, ddof=1)
    assert (found.low, found.high) == pytest.approx((found.value - half, found.value + half))
    assert found.low < 0.8 < found.high


def test_every_edge_gives_1_and_none_gives_0():
    rng = np.random.default_rng(5)
    clean, corrupted = rng.normal(2, 1, size=16), rng.normal(0, 1, size=16)
    every = F.faithfulness_resamples(clean, corrupted, clean.copy())
    assert every.value == pytest.approx(1, abs=1e-12)
    np.testing.assert_allclose(every.values, 1, atol=1e-12)
    assert every.high - every.low < 1e-10
    none = F.faithfulness_resamples(clean, corrupted, corrupted.copy())
    assert none.value == 0 and (none.values == 0).all() and none.low == none.high == 0
    pairs = F.pair_faithfulness(clean, corrupted, clean.copy())
    np.testing.assert_allclose(pairs.values, 1, atol=1e-12)


def test_pair_faithfulness_sets_aside_what_it_cannot_divide_by():
    clean = np.array([1.0, 2.0, 1.0, 1.0, 5.0, 3.0, 1.0, 0.0005, 1.0])
    corrupted = np.array([0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 2.0])
    f = np.array([0.9, 0.2, 0.0, 1.1, 0.25, -0.3, 0.25, 0.0, 0.7])
    circuit = corrupted + f * (clean - corrupted)
    circuit[2], circuit[7] = 7.0, 3.0  # set aside: their ratio would be infinite or noise
    ids = np.array([f"p{i}" for i in range(9)])
    found = F.pair_faithfulness(clean, corrupted, circuit, ids=ids)
    difference = np.abs(clean - corrupted)
    assert found.threshold == pytest.approx(0.01 * difference.mean())
    assert list(np.flatnonzero(found.set_aside)) == [2, 7]
    kept = np.delete(f, [2, 7])
    np.testing.assert_allclose(np.delete(found.values, [2, 7]), kept, atol=1e-12)
    assert np.isnan(found.values[[2, 7]]).all()
    assert found.quantiles == pytest.approx(
        dict(zip(F.QUANTILES, np.quantile(kept, F.QUANTILES), strict=True))
    )
    assert found.below_half == pytest.approx(4 / 7)
    assert list(found.worst) == ["p5", "p1", "p4", "p6", "p8"]  # 0.25 twice: the first first
    assert list(F.pair_faithfulness(clean, corrupted, circuit).worst) == [5, 1, 4, 6, 8]


MIB = np.array(F.MIB_SIZES)


def test_cpr_and_cmd_of_a_line_and_a_parabola_are_their_integrals():
    a, b = MIB[:-1], MIB[1:]
    cpr, cmd = F.mib_scores(MIB)  # f(x) = x: the trapezoids are exact
    assert cpr == pytest.approx((1 - 0.001**2) / 2, abs=1e-12)
    assert cmd == pytest.approx((1 - 0.001) - (1 - 0.001**2) / 2, abs=1e-12)
    # f(x) = x²: each trapezoid is ∫ x² over its segment plus (b − a)³/6, the chord's excess
    cpr, cmd = F.mib_scores(MIB**2)
    assert cpr == pytest.approx((1 - 0.001**3) / 3 + ((b - a) ** 3).sum() / 6, abs=1e-12)
    assert cmd == pytest.approx((1 - 0.001) - cpr, abs=1e-12)  # 1 − f ≥ 0 throughout
    assert F.mib_scores(np.ones(10)) == pytest.approx((0.999, 0.0), abs=1e-12)


def test_cpr_and_cmd_of_a_piecewise_linear_curve():
    # 0 up to 1% of the edges, rising linearly to 1 at 10%, then 1: breaks at MIB's sizes
    f = np.interp(MIB, [0.001, 0.01, 0.1, 1.0], [0.0, 0.0, 1.0, 1.0])
    cpr, cmd = F.mib_scores(f)
    assert cpr == pytest.approx(0.045 + 0.9, abs=1e-9)  # the ramp's triangle and the plateau
    assert cmd == pytest.approx((0.01 - 0.001) + 0.045, abs=1e-9)
    # above 1 counts as far from 1 as below it; a crossing segment takes MIB's trapezoid
    over = np.r_[np.ones(8), 1.5, 0.5]
    assert F.mib_scores(over)[1] == pytest.approx(0.3 * 0.5 / 2 + 0.5 * 0.5, abs=1e-12)
    # another axis: the leaderboard's shares of the edges, say
    assert F.mib_scores([0.0, 1.0], [0.0, 1.0]) == pytest.approx((0.5, 0.5), abs=1e-12)


def test_mib_counts_are_mibs_top_n():
    expected = [32, 64, 162, 324, 649, 1624, 3249, 6498, 16245, 32491]  # GPT-2 small's edges
    assert F.mib_counts(32491) == expected
    assert F.mib_counts(10) == [0, 0, 0, 0, 0, 0, 1, 2, 5, 10]


def test_resample_partners_are_other_pairs_keyed_by_seed():
    partners = F.resample_partners(7, 50)
    assert ((partners >= 0) & (partners < 50)).all() and (partners != np.arange(50)).all()
    assert (F.resample_partners(7, 50) == partners).all()
    assert (F.resample_partners(8, 50) != partners).any()
    assert (F.resample_partners(1, 2) == [1, 0]).all()


@pytest.mark.parametrize("bad", [1, 0, -3, 2.5, True, "3", None])
def test_resamples_must_be_an_integer_of_at_least_2(bad):
    for call in (
        lambda: S.check_resamples(bad),
        lambda: S.BootstrapSums(5, resamples=bad),
        lambda: F.faithfulness_resamples([1.0, 2.0], [0.0, 0.0], [1.0, 1.0], resamples=bad),
    ):
        with pytest.raises(ProbeError, match=r"^resamples must be") as error:
            call()
        assert "\n" not in str(error.value)
    assert S.check_resamples(np.int64(2)) == 2


def test_bad_ablations_and_pairs_are_one_line():
    assert F.ABLATIONS == ("corrupted", "mean", "zero", "resample")
    for name in F.ABLATIONS:
        assert F.check_ablation(name, 2) == name
    cases = [
        (lambda: F.check_ablation("median", 10), "^ablation must be one of"),
        (lambda: F.check_ablation("resample", 1), "^ablation 'resample' .* at least 2 pairs"),
        (lambda: F.resample_partners(0, 1), "^ablation 'resample'"),
        (lambda: F.faithfulness_resamples([1.0, 2.0], [1.0, 2.0], [0.0, 0.0]), "every pair"),
        (lambda: F.pair_faithfulness(np.zeros(4), np.zeros(4), np.ones(4)), "every pair"),
        (lambda: F.faithfulness_resamples([1.0, 0.0], [0.0, 1.0], [1.0, 1.0]), "score alike"),
    ]
    for call, message in cases:
        with pytest.raises(ProbeError, match=message) as error:
            call()
        assert "\n" not in str(error.value)


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="scores must be"):
        S.BootstrapSums(5).add(np.zeros((3, 4)), [0, 1, 2])
    with pytest.raises(ValueError, match="circuit flags"):
        S.BootstrapSums(5).stability(np.ones(4, dtype=bool))
    with pytest.raises(ValueError, match="same pairs"):
        F.pair_faithfulness([1.0, 2.0], [0.0, 0.0], [1.0])
    with pytest.raises(ValueError, match="one value per size"):
        F.mib_scores([1.0, 1.0])
    with pytest.raises(ValueError, match="increase"):
        F.mib_scores([1.0, 1.0], [0.5, 0.2])
