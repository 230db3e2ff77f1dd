"""``probe figures`` for a timeline's folder: per role, each head's score over the steps drawn
with seaborn (the holders' points filled, each head's onset marked), and the loss on the
second copy of the run's repeated sequences where the run measured it (``steps.csv``). The
page draws the same in its own SVG (``probe.app.timeline_page``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from analyses.figures import Plot
from probe.app.changes import roles_of
from probe.app.timeline_tables import role_score
from probe.errors import ProbeError

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes

TABLES = ("timeline", "onsets", "roles_by_step", "steps")
MAX_HEADS = 8  # as on the page: those that held the role longest


def read_tables(folder: Path) -> dict[str, pd.DataFrame]:
    """A timeline folder's tables, by name."""
    import pandas as pd

    tables = {}
    for name in TABLES:
        path = Path(folder) / f"{name}.csv"
        try:
            tables[name] = pd.read_csv(path, keep_default_na=False, na_values=[""])
        except (OSError, ValueError) as e:
            raise ProbeError(f"{path} cannot be read ({str(e).splitlines()[0]})") from None
    tables["timeline"]["roles"] = tables["timeline"]["roles"].fillna("").astype(str)
    return tables


def plots(tables: dict[str, pd.DataFrame]) -> list[Plot]:
    """One figure per role the run scores and some head held, in the order of ``onsets.csv``;
    and the loss, where measured."""
    found = []
    for role in dict.fromkeys(tables["onsets"].role):
        score = role_score(role, tables["timeline"].columns)
        if score is not None:
            found.append(Plot(role, f"{role}: each head's {score} over the steps",
                              "probe.app.timeline_paper:role_scores", needs=("timeline", "onsets"),
                              panels=({"role": role},)))  # fmt: skip
    if tables["steps"].loss_second_copy.notna().any():  # measured with --lm-head
        title = "The loss on the second copy of repeated tokens over the steps"
        found.append(Plot("loss", title, "probe.app.timeline_paper:loss", needs=("steps",)))
    return found


def role_scores(tables: dict[str, pd.DataFrame], ax: Axes | None = None, role: str = "") -> Axes:
    """Each head that held ``role``: its score over the steps (a line), filled where it holds
    the role, a square at its onset."""
    import seaborn as sns

    from analyses.paper import _axes

    timeline, onsets = tables["timeline"], tables["onsets"]
    score = role_score(role, timeline.columns)
    own = onsets[onsets.role == role]
    own = own.iloc[(own.last_held - own.first_held).to_numpy().argsort(kind="stable")[::-1]]
    ax = _axes(ax)
    palette = sns.color_palette("viridis", max(2, len(own[:MAX_HEADS])))
    for colour, row in zip(palette, own[:MAX_HEADS].itertuples(), strict=False):
        mine = timeline[(timeline.layer == row.layer) & (timeline["head"] == row.head)]
        sns.lineplot(
            x=mine.step, y=mine[score], ax=ax, color=colour, label=f"{row.layer}-{row.head}"
        )
        holds = mine[mine.roles.map(lambda r: role in roles_of(r))]
        ax.scatter(holds.step, holds[score], color=colour, marker="D", s=12, zorder=3)
        if row.onset == row.onset and row.onset is not None:
            at = mine[mine.step == row.onset]
            ax.scatter(at.step, at[score], color=colour, marker="s", s=30, facecolor="none",
                       zorder=4)  # fmt: skip
    ax.set(xlabel="step", ylabel=score, title=role)
    ax.legend(fontsize="x-small", frameon=False)
    return ax


def loss(tables: dict[str, pd.DataFrame], ax: Axes | None = None) -> Axes:
    """The model's mean loss on the second copy (and on the first) over the steps."""
    import seaborn as sns

    from analyses.paper import _axes

    steps = tables["steps"]
    ax = _axes(ax)
    sns.lineplot(x=steps.step, y=steps.loss_second_copy, ax=ax, marker="o", label="second copy")
    sns.lineplot(x=steps.step, y=steps.loss_first_copy, ax=ax, marker="o", label="first copy")
    ax.set(xlabel="step", ylabel="loss (nats)", title="Loss on repeated tokens")
    ax.legend(fontsize="x-small", frameon=False)
    return ax
