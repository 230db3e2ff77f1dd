"""The lower bound on a run's work (``probe.options.check_time``), checked against the model
it bounds."""

from pathlib import Path

import pytest

from probe.errors import ProbeError
from probe.options import LIMIT_S, check_memory, check_time, forward_flops, peak_rate

INDUCTION = Path(__file__).parents[1] / "data" / "induction-gpt2"


def test_a_forward_s_operations_are_bounded_by_the_model_s_weights():
    """Two operations per weight a token passes (matrix weights of the blocks): the bound
    counts the query and output projections and the MLP, so it lies between half of that and
    all of it."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(INDUCTION)
    matrices = sum(p.numel() for name, p in model.transformer.h.named_parameters()
                   if p.dim() == 2)  # fmt: skip
    assert 0.5 * 2 * matrices <= forward_flops(model.config) <= 2 * matrices


def test_a_day_s_work_is_the_limit():
    rate = peak_rate()
    check_time("--n", 1, LIMIT_S * rate, LIMIT_S * rate)  # exactly a day: allowed
    with pytest.raises(ProbeError, match=r"^--n 2 needs at least .* use at most 1$"):
        check_time("--n", 2, 2 * LIMIT_S * rate, LIMIT_S * rate)


def test_memory_beyond_the_machine_s_is_refused():
    with pytest.raises(ProbeError, match=r"--n 1,000 holds at least .* GiB of inputs"):
        check_memory("--n", 1000, 2.0**60)
    check_memory("--n", 1000, 1000.0)
