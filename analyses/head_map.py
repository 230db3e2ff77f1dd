"""The heads' similarity map: a 2-D metric MDS of the √Jensen-Shannon distances between heads
(Clark et al. 2019), made in the helper process while the run finishes the other analyses, and
drawn as inline SVG.

The roles analysis (``analyses.roles``) starts the map when it makes its tables (``start_map``)
and takes it in ``heads`` (``embed``); ``warm_up`` imports scikit-learn's MDS in the helper
while torch imports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from analyses.vocabulary import Role
from probe.lazy import lazy
from probe.pipeline import helper

if TYPE_CHECKING:
    import pandas as pd

np = lazy("numpy")

# The head map's SMACOF (scikit-learn's MDS) stops when an iteration lowers the stress by less
# than this share of the distances' sum of squares (the stress is then within 1e-4 of its
# minimum, far below what a figure shows), or after this many iterations.
MDS_TOLERANCE = 1e-8
MDS_MAX_ITER = 1000


def embed(similarity: pd.DataFrame, n: int) -> np.ndarray:
    """A 2-D metric MDS embedding of the heads from √JS (a metric), as in Clark et al. (2019).

    scikit-learn's SMACOF from the classical (Torgerson) solution: deterministic, no seed
    needed. Each axis is signed so that its largest coordinate is positive (neither the
    classical solution nor the stress fixes a sign).

    Returns
    -------
    ``[n, 2]`` the heads' coordinates, in the order of ``layer * n_heads + head``
    """
    distance = head_distances(similarity, n)
    if n < 3 or not distance.any():  # nothing to lay out (a corpus too small to sample)
        return np.zeros((n, 2))
    key = distance.tobytes()
    if key not in _STARTED:
        _STARTED.clear()
        _STARTED[key] = helper.submit(mds_points, distance)  # where sklearn is imported
    return _STARTED[key].result()


# The map of the similarity the last ``Roles._tables`` made, started in the helper process then
# (``start_map``), by its distances: the run finishes the other analyses meanwhile, and
# ``heads``, given the same similarity, takes it from here, as often as it is asked (the
# report's join of the heads and its list of the roles tested each ask); one map at a time.
_STARTED: dict[bytes, helper.Pending[np.ndarray]] = {}


def start_map(similarity: pd.DataFrame, n: int) -> None:
    """Start ``embed``'s map of ``similarity`` in the helper process (without one, it is
    computed when ``embed`` asks for it)."""
    distance = head_distances(similarity, n)
    _STARTED.clear()
    if n >= 3 and distance.any():
        _STARTED[distance.tobytes()] = helper.submit(mds_points, distance)


def mds_points(distance: np.ndarray) -> np.ndarray:
    """``embed``'s map of the ``[n, n]`` distances, ``[n, 2]``."""
    from sklearn.manifold import MDS  # here: it costs an import 0.8 s

    mds = MDS(n_components=2, metric_mds=True, metric="precomputed", init="classical_mds",
              n_init=1, eps=MDS_TOLERANCE, max_iter=MDS_MAX_ITER)  # fmt: skip
    points = mds.fit_transform(distance)
    largest = points[np.abs(points).argmax(0), np.arange(2)]
    return points * np.where(largest < 0, -1, 1)


def warm_up() -> None:
    """A small map, which the helper process runs while torch imports
    (``probe.pipeline.helper``)."""
    points = np.random.default_rng(0).standard_normal((12, 2))
    mds_points(np.sqrt(((points[:, None] - points[None]) ** 2).sum(-1)))


def head_distances(similarity: pd.DataFrame, n: int) -> np.ndarray:
    """√JS between every two heads, symmetrised, ``[n, n]`` (zero on the diagonal)."""
    js = similarity.js_divergence.to_numpy().reshape(n, n)
    distance = np.sqrt(np.maximum((js + js.T) / 2, 0))
    np.fill_diagonal(distance, 0)
    return distance


def stress(points: np.ndarray, distance: np.ndarray) -> float:
    """The raw stress of a map: Σ_{i<j} (|x_i - x_j| - distance_ij)², what SMACOF lowers.

    Parameters
    ----------
    points : ``[n, dims]``
    distance : ``[n, n]`` symmetric
    """
    fitted = np.sqrt(((points[:, None] - points[None]) ** 2).sum(-1))
    return float(((fitted - distance) ** 2).sum() / 2)


def similarity_map(heads: pd.DataFrame, width: int = 640, height: int = 420) -> str:
    """The heads on their MDS map as inline SVG, coloured by their first role (the overview's
    colours), each point titled with its head and roles so that hovering names it."""
    from html import escape

    from probe.heads import HeadId

    x, y = heads.mds_x.to_numpy(float), heads.mds_y.to_numpy(float)
    pad, legend = 16, 150
    span = lambda v: (v.min(), max(v.max() - v.min(), 1e-12))  # noqa: E731
    (x0, dx), (y0, dy) = span(x), span(y)
    px = pad + (x - x0) / dx * (width - legend - 2 * pad)
    py = height - pad - (y - y0) / dy * (height - 2 * pad)
    roles = heads.roles.fillna("")
    parts = [
        f'<svg class="similarity" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" role="img" aria-label="heads by similarity of attention">'
    ]
    for i, row in enumerate(heads.itertuples()):
        held = [r for r in roles.iloc[i].split(";") if r]
        colour = Role(held[0]).colour if held else "#b0b4bb"
        label = f"{HeadId(row.layer, row.head)}: {', '.join(held) or 'no role'}"
        parts.append(
            f'<circle cx="{px[i]:.1f}" cy="{py[i]:.1f}" r="5" fill="{colour}" stroke="#333" '
            f'stroke-width="0.5"><title>{escape(label)}</title></circle>'
        )
    for k, role in enumerate([*Role, None]):
        colour, name = (role.colour, str(role)) if role else ("#b0b4bb", "no role")
        y_legend = pad + 18 * k
        parts.append(f'<circle cx="{width - legend + 10}" cy="{y_legend}" r="5" fill="{colour}"/>'
                     f'<text x="{width - legend + 20}" y="{y_legend + 4}" font-size="12" '
                     f'fill="currentColor">{escape(name)}</text>')  # fmt: skip
    parts.append("</svg>")
    return "".join(parts)
