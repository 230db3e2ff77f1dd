"""`probe experiment heads`: its synthetic tasks by hand, and a short run end to end."""

import json

import pandas as pd
import pytest
import torch
from test_cli import check_html
from typer.testing import CliRunner

from probe import experiment as E
from probe.app.cli import app


@pytest.mark.parametrize("task", list(E.TASKS))
def test_each_target_is_the_value_of_the_related_key(task):
    """The target of every position is the value at ``where``, whose key is related to the
    position's key as the task says; positions without one are not scored."""
    mapping = E.relation(task, 0)
    batch = E.sample(task, mapping, 50, E._generator(5))
    inverse = torch.argsort(mapping)
    for r, offset in enumerate(E.TASKS[task]):
        where, target = batch.where[r], batch.targets[r]
        present = where >= 0
        assert torch.equal(present, target >= 0)
        assert present.float().mean() > 0.6
        related = batch.keys.gather(1, where.clamp(min=0))[present]
        keys = batch.keys[present]
        expected = {None: mapping[keys], 1: mapping[keys], -1: inverse[keys],
                    2: mapping[mapping[keys]], -2: inverse[inverse[keys]]}[offset]  # fmt: skip
        assert torch.equal(related, expected)
        assert torch.equal(batch.values.gather(1, where.clamp(min=0))[present], target[present])
    for keys in batch.keys:  # every key of a sequence is distinct
        assert len(set(keys.tolist())) == E.LENGTH


def test_relations_are_a_cycle_and_an_involution():
    cycle, pairs = E.relation("successor", 3), E.relation("partner", 3)
    x, seen = 0, set()
    while x not in seen:
        seen.add(x)
        x = int(cycle[x])
    assert len(seen) == E.KEYS  # a single cycle through every key
    assert (
        torch.equal(pairs[pairs], torch.arange(E.KEYS))
        and not (pairs == torch.arange(E.KEYS)).any()
    )


def test_a_short_run_end_to_end_is_deterministic(tmp_path):
    runner = CliRunner()
    folders = [tmp_path / "a", tmp_path / "b"]
    for out in folders:
        result = runner.invoke(app, ["experiment", "heads", "--steps", "15", "--seeds", "1",
                                     "--seed", "4", "--out", str(out), "-q"])  # fmt: skip
        assert result.exit_code == 0, result.output
    first, second = (pd.read_csv(f / "experiment.csv") for f in folders)
    pd.testing.assert_frame_equal(first, second)
    assert len(first) == len(E.TASKS) * len(E.VARIANTS) * E.N_HEADS
    assert set(first.variant) == set(E.VARIANTS) and (first.seed == 4).all()
    assert first.accuracy.between(0, 1).all() and (first.qk_effective_rank > 0).all()
    assert (first.qk_effective_rank <= first.qk_rank_possible + 1e-9).all()
    params = first.groupby("variant").qk_parameters.first()
    assert params.to_dict() == {"narrow": 2048, "wide": 8192, "bilinear": 4096, "shared": 1024}
    curves = pd.read_csv(folders[0] / "curves.csv")
    assert set(curves.step) == {10, 15}
    run = json.loads((folders[0] / "run.json").read_text())
    assert run["steps"] == 15 and run["seeds"] == [4]
    html = (folders[0] / "index.html").read_text()
    assert not check_html(folders[0] / "index.html").scripts  # balanced, offline, no script
    for answer in E.answers(first).values():
        assert answer.split(".")[0] in html  # the plain-words answers, drawn from the numbers
    again = runner.invoke(app, ["experiment", "heads", "--steps", "1", "--out", str(folders[0])])
    assert again.exit_code == 1 and "exists" in again.output
