"""What probe still owns around the estimators it takes from scikit-learn: the attention probe's
pair features and the fit it asks for (the minimum, deterministically), and the head map's
distances, stress and orientation."""

import itertools

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.manifold import MDS
from streams import context, feed
from threadpoolctl import threadpool_limits
from tokenizers_util import wordpiece

from analyses.head_map import embed, head_distances, stress
from analyses.probing import TOLERANCE, WARM_MIN_PAIRS, AttentionProbe, C, fit_logistic
from probe.inputs.corpus import Corpus
from probe.inputs.treebank import Sentence
from probe.keys import keys
from probe.numerics import pairwise_js

WORDS = ["the", "old", "dogs", "were", "barking", "at", "strangers", "in", "dark", "streets"]


def objective(X, y, w, b, c=C):
    z = X.astype(np.float64) @ w + b
    return c * (np.logaddexp(0, z) - y * z).sum() + w @ w / 2


def gradient(X, y, w, b, c=C):
    X = X.astype(np.float64)
    residual = 1 / (1 + np.exp(-(X @ w + b))) - y
    return np.append(c * X.T @ residual + w, c * residual.sum())


@pytest.fixture(scope="module")
def correlated():
    """Features that are nearly collinear, as heads often are: three factors behind forty."""
    g = np.random.default_rng(1)
    base = g.normal(size=(4000, 3))
    X = (base @ g.normal(size=(3, 40)) + 0.05 * g.normal(size=(4000, 40))).astype(np.float32)
    return X, X[:, :3].sum(1) + g.logistic(size=4000) > 0


def test_the_probe_fit_reaches_the_minimum(correlated):
    """The solver and tolerance probe chooses reach the one minimum of the penalised objective
    (its gradient vanishes), below where scikit-learn's default L-BFGS stops."""
    X, y = correlated
    fitted = fit_logistic(X, y)
    w, b = fitted.coef_[0], fitted.intercept_[0]
    assert np.abs(gradient(X, y, w, b)).max() < 1e-6
    default = LogisticRegression(C=C, max_iter=1000).fit(X, y)
    assert objective(X, y, w, b) <= objective(X, y, default.coef_[0], default.intercept_[0])


def test_a_large_sample_s_fit_starts_from_a_subsample_and_reaches_the_same_minimum():
    """From WARM_MIN_PAIRS pairs on, Newton's method starts from every WARM_STEP-th pair's
    minimum: it stops, as a cold start does, where the mean loss's gradient is within the
    tolerance, at the minimum a much tighter cold fit finds."""
    g = np.random.default_rng(2)
    n = WARM_MIN_PAIRS + 4000
    base = g.normal(size=(n, 3))
    X = (base @ g.normal(size=(3, 40)) + 0.05 * g.normal(size=(n, 40))).astype(np.float32)
    y = X[:, :3].sum(1) + g.logistic(size=n) > 0
    fitted = fit_logistic(X, y)
    assert fitted.get_params()["warm_start"]  # it did start from the subsample's minimum
    w, b = fitted.coef_[0], fitted.intercept_[0]
    assert np.abs(gradient(X, y, w, b)).max() / (C * n) <= TOLERANCE
    exact = LogisticRegression(C=C, solver="newton-cholesky", tol=1e-15, max_iter=100)
    exact.fit(X.astype(np.float64), y)
    np.testing.assert_allclose(w, exact.coef_[0], atol=1e-6)
    assert b == pytest.approx(exact.intercept_[0], abs=1e-6)
    assert not fit_logistic(X[:4000], y[:4000]).get_params()["warm_start"]  # small: cold


def test_the_probe_fit_is_deterministic(correlated):
    """The same sample gives the same classifier, with one BLAS thread or several."""
    X, y = correlated
    first, again = fit_logistic(X, y), fit_logistic(X, y)
    np.testing.assert_array_equal(first.coef_, again.coef_)
    with threadpool_limits(1):
        one_thread = fit_logistic(X, y)
    np.testing.assert_allclose(one_thread.coef_, first.coef_, rtol=1e-9, atol=1e-12)


def chain(n: int) -> Sentence:
    """A sentence of ``n`` words, each the dependent of the next (the last is the root)."""
    words = list(itertools.islice(itertools.cycle(WORDS), n))
    return Sentence(words, [*range(1, n), -1], ["dep"] * (n - 1) + ["root"], ["X"] * n)


def word_attention(pattern: np.ndarray, word_of_token: np.ndarray, n: int) -> np.ndarray:
    """Attention between words by the definition, one cell at a time: to a word, the sum over
    its tokens; from a word, the mean over its tokens."""
    out = np.zeros((n, n))
    for i in range(n):
        for j in range(n):
            rows, cols = np.flatnonzero(word_of_token == i), np.flatnonzero(word_of_token == j)
            out[i, j] = pattern[np.ix_(rows, cols)].sum(1).mean()
    return out


def test_the_probe_features_are_each_pairs_attention_both_ways():
    """Every training pair (i, j) of the sample holds the word attention i -> j of every head
    (layer by layer), then j -> i; its label says whether j is i's head."""
    L, H = 2, 3
    probe = AttentionProbe(context(L, H), held_out=0.0)  # all sentences train, all pairs fit
    corpus = Corpus([chain(3 + i % 5) for i in range(12)], wordpiece(), max_length=64)
    g = torch.Generator().manual_seed(0)
    expected = {}
    for batch in corpus.batches(batch_size=4):
        T = batch.input_ids.shape[1]
        patterns = torch.softmax(torch.randn(len(batch), L, H, T, T, generator=g), -1)
        feed(probe, batch, patterns)
        for s in range(len(batch)):
            n, index = int(batch.n_words[s]), int(batch.index[s])
            tokens = batch.word_of_token[s].numpy()
            words = np.array([[word_attention(patterns[s, la, h].numpy(), tokens, n)
                               for h in range(H)] for la in range(L)])  # fmt: skip
            for i, j in itertools.permutations(range(n), 2):
                if batch.heads[s, i] < 0:
                    continue  # the root is not scored
                key = int(keys(0, "pair", np.array([index]), np.array([i]), np.array([j]))[0])
                features = np.concatenate([words[:, :, i, j].ravel(), words[:, :, j, i].ravel()])
                expected[key] = features, j == int(batch.heads[s, i])
    assert probe.filled == len(expected) == probe.seen
    for row in range(probe.filled):
        features, label = expected[int(probe.keys[row])]
        np.testing.assert_allclose(probe.X[row], features, rtol=1e-5, atol=1e-6)
        assert probe.y[row] == label


def test_stress_is_the_sum_over_pairs():
    g = np.random.default_rng(0)
    points, distance = g.normal(size=(7, 2)), g.uniform(size=(7, 7))
    distance = (distance + distance.T) / 2
    np.fill_diagonal(distance, 0)
    by_pairs = sum(
        (np.hypot(*(points[i] - points[j])) - distance[i, j]) ** 2
        for i, j in itertools.combinations(range(7), 2)
    )
    assert stress(points, distance) == pytest.approx(by_pairs, rel=1e-12)
    assert stress(points, distance) > 0


def table_of(distance: np.ndarray) -> pd.DataFrame:
    """A head_similarity table whose √JS are ``distance``."""
    return pd.DataFrame({"js_divergence": (distance**2).ravel()})


def test_the_head_map_recovers_a_planar_configuration():
    """Distances between points of a plane are embedded without stress: every distance comes
    back, whatever the rotation."""
    points = np.random.default_rng(2).normal(size=(30, 2))
    distance = np.sqrt(((points[:, None] - points[None]) ** 2).sum(-1))
    got = embed(table_of(distance), 30)
    assert stress(got, distance) < 1e-8 * (distance**2).sum()
    np.testing.assert_allclose(head_distances(table_of(distance), 30), distance, atol=1e-12)


def test_the_head_map_reaches_the_stress_of_a_tight_fit():
    """On JS distances between heads' distributions, the map's stress is that of SMACOF run to
    convergence, and no worse than scikit-learn's defaults give."""
    g = np.random.default_rng(4)
    features = g.dirichlet(np.ones(8), size=24)  # 24 "heads", JS between their distributions
    js = pairwise_js(torch.from_numpy(features)[:, None]).numpy()  # one query each
    table = pd.DataFrame({"js_divergence": js.ravel()})
    ours, distance = embed(table, 24), head_distances(table, 24)
    options = {"n_components": 2, "metric": "precomputed", "init": "classical_mds"}
    tight = MDS(**options, eps=1e-14, max_iter=100_000).fit(distance).embedding_
    default = MDS(**options).fit(distance).embedding_
    assert stress(ours, distance) == pytest.approx(stress(tight, distance), rel=1e-4)
    assert stress(ours, distance) <= stress(default, distance) * (1 + 1e-9)


def test_the_head_map_is_signed_deterministically():
    """Each axis has its largest coordinate positive, so runs draw the same map."""
    distance = np.abs(np.subtract.outer(np.arange(6.0), np.arange(6.0)))
    distance += 0.3 * (distance > 0) * np.add.outer(np.arange(6.0), np.arange(6.0)) % 1.3
    distance = (distance + distance.T) / 2
    points = embed(table_of(distance), 6)
    assert (points[np.abs(points).argmax(0), [0, 1]] > 0).all()
    np.testing.assert_array_equal(points, embed(table_of(distance), 6))


def test_the_map_started_by_the_tables_is_the_map_the_heads_get(monkeypatch):
    """``Roles._tables`` starts the head map (in the helper process, while the run finishes the
    other analyses); ``heads`` on the same similarity takes that map, as often as it is asked
    (the report asks three times), and on another similarity makes its own, which then takes its
    place: the same points either way."""
    from analyses import head_map

    g = np.random.default_rng(5)
    js = pairwise_js(torch.from_numpy(g.dirichlet(np.ones(8), size=12))[:, None]).numpy()
    table, other = pd.DataFrame({"js_divergence": js.ravel()}), table_of(np.ones((12, 12)))
    made = []
    real = head_map.mds_points
    monkeypatch.setattr(head_map, "mds_points", lambda d: made.append(d) or real(d))
    head_map.start_map(table, 12)
    started = embed(table, 12)
    assert len(made) == 1
    np.testing.assert_array_equal(embed(table, 12), started)
    assert len(made) == 1  # asked again: the same map, not made again
    np.testing.assert_array_equal(embed(other, 12), real(head_distances(other, 12)))
    assert len(made) == 2 and len(head_map._STARTED) == 1  # another similarity: its own map
    np.testing.assert_array_equal(started, embed(table, 12))
    assert len(made) == 3
    head_map._STARTED.clear()


def test_an_empty_head_map_is_all_zeros():
    assert not embed(table_of(np.zeros((5, 5))), 5).any()
    assert not embed(table_of(np.ones((2, 2)) - np.eye(2)), 2).any()
