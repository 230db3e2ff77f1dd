"""The public functions check their arguments at the door (``probe.capture.arguments``): a wrong one
is a ``ValueError``/``TypeError`` naming it (or a ``ProbeError``), never an error from inside torch
or transformers, a table of NaN, or numbers read from the wrong tokens. Hypothesis drives them with
arbitrary shapes, dtypes and values, and accepts only those errors or the right answer
(the whole patterns of ``probe.trace``)."""

import re

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from models import small_model
from references import expected_statistics, whole

import probe
from probe.patterns.headtypes import offset_scores

VOCABULARY = 99  # small_model's
ACCEPTED = (probe.ProbeError, ValueError, TypeError)
DTYPES = [torch.long, torch.int32, torch.int16, torch.uint8, torch.float32, torch.bool]
FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])  # fmt: skip


@pytest.fixture(scope="module")
def model():
    return small_model("gpt2")


def tensors(values: st.SearchStrategy[int], max_dims: int = 3) -> st.SearchStrategy:
    """Tensors of any of ``DTYPES``, 0 to ``max_dims`` dimensions of 0 to 5 each."""

    @st.composite
    def build(draw):
        shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=max_dims))
        dtype = draw(st.sampled_from(DTYPES))
        count = 1
        for size in shape:
            count *= size
        data = draw(st.lists(values, min_size=count, max_size=count))
        t = torch.tensor(data, dtype=torch.long).reshape(shape)
        return t.clamp(0, 255).to(dtype) if dtype == torch.uint8 else t.to(dtype)

    return build()


# Right ids half the time (a batch of 1 to 3 texts of 1 to 5 tokens), anything the rest.
IDS = st.one_of(
    st.builds(lambda b, t, seed: torch.randint(VOCABULARY, (b, t), generator=torch.Generator(
        ).manual_seed(seed)), st.integers(1, 3), st.integers(1, 5), st.integers(0, 99)),
    tensors(st.integers(-2, VOCABULARY + 2)),
)  # fmt: skip


@st.composite
def ids_and_masks(draw):
    """Ids, and a mask: none, one of their shape (padding anywhere), or anything."""
    ids = draw(IDS)
    shaped = st.builds(
        lambda bits: torch.tensor(bits).reshape(ids.shape),
        st.lists(st.integers(0, 1), min_size=ids.numel(), max_size=ids.numel()),
    )
    mask = draw(st.none() | shaped | tensors(st.integers(0, 2)) | st.just([1, 1, 1]))
    return ids, mask


def named(error: Exception, *names: str, fuzzed: bool = True) -> None:
    """The error is one of those accepted and its message names one of the arguments."""
    assert isinstance(error, ACCEPTED), repr(error)
    if fuzzed:  # counted in hypothesis's statistics
        event(f"refused: {type(error).__name__}")
    message = str(error)
    assert "\n" not in message and any(re.search(rf"\b{n}\b", message) for n in names), message


def valid_inputs(ids, mask) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(ids, mask)`` as ``[batch, pos]`` when the arguments are right, else None."""
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (
        torch.long,
        torch.int32,
        torch.int16,
        torch.uint8,
    ):
        return None
    if ids.dim() not in (1, 2) or ids.numel() == 0:
        return None
    ids = ids.reshape(1, -1) if ids.dim() == 1 else ids
    if int(ids.min()) < 0 or int(ids.max()) >= VOCABULARY:
        return None
    if mask is None:
        return ids.long(), torch.ones_like(ids, dtype=torch.long)
    if not isinstance(mask, torch.Tensor):
        return None
    mask = mask[None] if mask.dim() == 1 and ids.shape[0] == 1 else mask
    if mask.shape != ids.shape or not bool(((mask == 0) | (mask == 1)).all()):
        return None
    if bool((mask == 0).all(-1).any()):
        return None
    return ids.long(), mask.long()


@FUZZ
@given(case=ids_and_masks())
@pytest.mark.slow
def test_head_statistics_answers_right_or_names_the_argument(model, case):
    ids, mask = case
    try:
        table = probe.head_statistics(model, ids, mask)
    except Exception as e:
        assert valid_inputs(ids, mask) is None, repr(e)
        named(e, "input_ids", "attention_mask")
        return
    inputs = valid_inputs(ids, mask)
    assert inputs is not None, (ids, mask)
    ids, mask = inputs
    patterns = whole(model, {"input_ids": ids, "attention_mask": mask})
    if ids.shape[0] > 1 or not bool(mask.all()):  # padding queries: read only the real ones
        patterns = patterns.nan_to_num(0.0)
    reference = expected_statistics(patterns, mask.bool())
    got = torch.tensor(table[list(probe.patterns.long_context.STATISTICS)].to_numpy())
    assert got.isfinite().all()
    event("answered" + (" with padding" if not bool(mask.all()) else ""))
    torch.testing.assert_close(got.float(), reference.flatten(0, 1), atol=2e-6, rtol=1e-5)
    assert (table.queries == int(mask.sum())).all()


ROWS = st.one_of(
    st.builds(slice, st.integers(0, 2), st.integers(3, 6)),
    st.integers(-3, 8), st.none(), st.floats(0, 3), st.text(max_size=2),
    st.builds(slice, st.integers(-8, 8) | st.none(), st.integers(-8, 8) | st.none(),
              st.integers(-2, 3).filter(bool) | st.none()),
    st.builds(slice, st.floats(0, 2), st.integers(0, 4)),
)  # fmt: skip


@FUZZ
@given(ids=IDS, layer=st.integers(0, 1) | st.integers(-2, 3) | st.floats(0, 1) | st.booleans(),
       rows=ROWS)  # fmt: skip
def test_attention_rows_answers_right_or_names_the_argument(model, ids, layer, rows):
    try:
        got = probe.attention_rows(model, ids, layer, rows)
    except Exception as e:
        named(e, "input_ids", "attention_mask", "layer", "rows", "attention_rows")
        return
    event("answered")
    ids, mask = valid_inputs(ids, None)
    patterns = whole(model, {"input_ids": ids, "attention_mask": mask})
    torch.testing.assert_close(got, patterns[layer][:, :, rows], atol=2e-7, rtol=0)


@st.composite
def repeats(draw):
    """Sequences built for some n (a BOS, n tokens, the same n), the n asked for (that one or
    another), and nulls of some shape, in any dtype."""
    built = draw(st.integers(1, 4))
    batch = draw(st.integers(1, 3))
    seeded = torch.Generator().manual_seed(draw(st.integers(0, 99)))
    first = torch.randint(1, VOCABULARY, (batch, built), generator=seeded)
    sequences = torch.cat([torch.zeros(batch, 1, dtype=torch.long), first, first], 1)
    if draw(st.booleans()):
        sequences = sequences.to(draw(st.sampled_from(DTYPES)))
    n = draw(st.integers(-1, 6) | st.just(built) | st.floats(1, 2))
    nulls = draw(st.none() | st.just(torch.randint(1, VOCABULARY, tuple(sequences.shape)))
                 | tensors(st.integers(0, VOCABULARY + 1), max_dims=2))  # fmt: skip
    return sequences, n, nulls, built


@FUZZ
@given(case=repeats())
def test_head_types_answers_right_or_names_the_argument(model, case):
    sequences, n, nulls, built = case
    try:
        table = probe.head_types(model, sequences, n, nulls)
    except Exception as e:
        named(e, "sequences", "n", "nulls")
        return
    assert n == built and not isinstance(n, bool)  # scores only for the n they were built with
    event("answered")
    ones = torch.ones_like(sequences, dtype=torch.long)
    patterns = whole(model, {"input_ids": sequences.long(), "attention_mask": ones})
    expected = torch.stack([offset_scores(p, n).mean(0) for p in patterns])  # [layer, 3, head]
    for k, score in enumerate(probe.patterns.headtypes.SCORES):
        got = torch.tensor(table[score].to_numpy()).float()
        torch.testing.assert_close(got, expected[:, k].flatten(), atol=2e-6, rtol=1e-5)


def test_the_cases_of_the_issue_name_their_argument(model):
    ids = torch.tensor([[5, 6, 7, 8]])
    x = torch.randint(1, VOCABULARY, (2, 20))
    built_for_20 = torch.cat([torch.zeros(2, 1, dtype=torch.long), x, x], 1)
    cases = [
        (lambda: probe.head_statistics(model, torch.zeros(0, dtype=torch.long)), "input_ids"),
        (lambda: probe.head_statistics(model, torch.tensor([5, 500])), "input_ids"),
        (lambda: probe.head_statistics(model, ids.float()), "input_ids"),
        (lambda: probe.head_statistics(model, ids, torch.zeros(1, 4)), "attention_mask"),
        (lambda: probe.head_statistics(model, ids, torch.ones(2, 2)), "attention_mask"),
        (lambda: probe.head_types(model, built_for_20, 0), "n"),
        (lambda: probe.head_types(model, built_for_20, 10), "sequences"),
        (lambda: probe.attention_rows(model, ids, 0, rows=5), "rows"),
        (lambda: probe.copying_scores(probe.MultiHeadAttention(16, 2)), "copying_scores"),
    ]
    for call, name in cases:
        with pytest.raises(ACCEPTED) as raised:
            call()
        named(raised.value, name, fuzzed=False)
