"""probe.inference against independent computations: Wilson's interval against SciPy's, the
Benjamini–Hochberg procedure against its definition checked rank by rank, the bootstrap p-value
against the normal curve, intervals withheld below the minimum of clusters, and the t-interval and
one-sided t-test against SciPy's t distribution on hand-worked examples."""

import numpy as np
import pytest
from scipy import stats

from probe import inference as I


@pytest.mark.parametrize("k, n", [(0, 1), (0, 2), (2, 2), (1, 3), (7, 20), (248, 1000), (5, 5)])
def test_wilson_is_scipys(k, n):
    expected = stats.binomtest(k, n).proportion_ci(0.95, method="wilson")
    low, high = I.wilson(k, n)
    assert (float(low), float(high)) == pytest.approx((expected.low, expected.high), abs=1e-9)


def test_wilson_does_not_collapse_at_the_ends_and_skips_empty_counts():
    low, high = I.wilson(np.array([0, 2, 0]), np.array([2, 2, 0]))
    assert low[0] == 0 and high[0] > 0.5  # 0 of 2: up to two in three, not 0–0
    assert low[1] < 0.5 and high[1] == 1  # 2 of 2: from about a third, not 100–100
    assert np.isnan(low[2]) and np.isnan(high[2])


def test_honest_widens_to_wilson_and_withholds_below_the_minimum_of_clusters():
    low, high = I.honest(
        np.array([1.0, 1.0, 0.4]), np.array([1.0, 1.0, 0.6]), np.array([2, 2, 50]),
        np.array([2, 2, 100]), np.array([I.MIN_CLUSTERS, I.MIN_CLUSTERS - 1, 40]),
    )  # fmt: skip
    w_low, _ = I.wilson(2, 2)
    assert low[0] == pytest.approx(w_low) and high[0] == 1  # a degenerate bootstrap, widened
    assert np.isnan(low[1]) and np.isnan(high[1])  # too few sentences: no interval
    assert (low[2], high[2]) == pytest.approx((0.4, 0.6))  # wider than Wilson's: kept


def _bh_by_definition(p, q):
    """The largest k with p_(k) ≤ q k / m, then every test with p ≤ p_(k)."""
    tested = sorted(x for x in p if x == x)
    m = len(tested)
    k = max((i for i in range(1, m + 1) if tested[i - 1] <= q * i / m), default=0)
    cut = tested[k - 1] if k else -1
    return np.array([x == x and x <= cut for x in p])


def test_benjamini_hochberg_by_definition():
    rng = np.random.default_rng(3)
    for _ in range(200):
        p = rng.uniform(0, 1, size=rng.integers(1, 40)) ** rng.uniform(1, 6)
        p[rng.uniform(size=len(p)) < 0.1] = np.nan  # not tests
        np.testing.assert_array_equal(I.benjamini_hochberg(p, 0.05), _bh_by_definition(p, 0.05))
    # the step-up: 0.04 alone would fail 0.05 / 2 · 1, but it is called with a smaller one beside
    assert I.benjamini_hochberg([0.001, 0.04]).tolist() == [True, True]
    assert I.benjamini_hochberg([0.03, 0.04, 0.9]).tolist() == [False, False, False]


def test_bootstrap_p_value_reads_the_normal_curve():
    rng = np.random.default_rng(0)
    replicates = rng.normal(0.05, 0.02, size=(4000, 3)) * np.array([1, 0, -1])
    p = I.p_above(replicates)
    mean, sd = replicates.mean(0), replicates.std(0, ddof=1)
    assert p[0] == pytest.approx(stats.norm.sf(mean[0] / sd[0]), rel=1e-9)
    assert p[1] == 1.0  # replicates that do not vary, at 0: nothing to tell from chance
    assert p[2] > 0.99
    assert I.p_above(np.full((10, 1), 0.3))[0] == 0  # above 0 in every replicate


def test_t_interval_by_hand_and_against_scipy():
    """2, 4, 4, 4, 5, 5, 7, 9: mean 5, squared deviations summing to 32, so sd = √(32/7) =
    2.1381 and the standard error 2.1381 / √8 = 0.75593; t(7) at 97.5% is 2.3646, so the
    half-width is 1.7875 and the interval 3.2125 to 6.7875."""
    values = np.array([2, 4, 4, 4, 5, 5, 7, 9], float)
    low, high = I.t_interval(values.mean(), values.std(ddof=1), len(values))
    assert (low, high) == pytest.approx((3.2125, 6.7875), abs=1e-4)
    expected = stats.t.interval(0.95, 7, loc=5, scale=stats.sem(values))
    assert (low, high) == pytest.approx(expected, rel=1e-12)
    # Another quantile (the experiment's table), and n below two refused.
    assert I.t_interval(5.0, 2.0, 4, quantile=lambda df: 3.0) == (2.0, 8.0)
    with pytest.raises(ValueError, match="at least two"):
        I.t_interval(5.0, 0.0, 1)


def test_t_interval_of_tensors_is_the_formula_bit_for_bit():
    """Means and standard deviations of many rows at once, numpy or torch: each bit for bit the
    half-width t975(n − 1) · sd / √n that the callers computed before it was here."""
    import math

    import torch

    values = torch.from_numpy(np.random.default_rng(0).normal(size=(6, 13)))
    mean, sd = values.mean(-1), values.std(-1)
    low, high = I.t_interval(mean, sd, 13)
    half = I.t975(12) * sd / math.sqrt(13)
    assert torch.equal(low, mean - half) and torch.equal(high, mean + half)
    low, high = I.t_interval(mean.numpy(), sd.numpy(), 13)
    np.testing.assert_array_equal(high, (mean + half).numpy())
    for row in range(6):
        expected = stats.t.interval(0.95, 12, loc=float(mean[row]), scale=float(sd[row]) / 13**0.5)
        assert (low[row], high[row]) == pytest.approx(expected, rel=1e-12)


def test_one_sided_t_test_by_hand_and_against_scipy():
    """0.5, 1.5, −0.5, 2, 1: mean 0.9, squared deviations summing to 3.7, sd = √(3.7/4) =
    0.96177, standard error 0.43012, t = 2.0925 on 4 degrees of freedom: p = P(T ≥ t) = 0.0523."""
    difference = np.array([0.5, 1.5, -0.5, 2.0, 1.0])
    p = I.t_test_above(difference)
    assert p == pytest.approx(0.0523, abs=1e-4)
    assert p == pytest.approx(stats.ttest_1samp(difference, 0, alternative="greater").pvalue)
    assert I.t_test_above(-difference) == pytest.approx(1 - p, rel=1e-12)
    # Differences that do not vary: 0 where above 0, else 1.
    assert I.t_test_above(np.full(5, 0.2)) == 0.0
    assert I.t_test_above(np.zeros(5)) == 1.0
