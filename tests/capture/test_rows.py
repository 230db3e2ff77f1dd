"""Attention in blocks of query rows (probe.capture.rows): every block equals the rows of the whole
pattern that probe's mirror computes, whatever the block size, mask or head grouping; the model's
output under the capture is its own sdpa output."""

import pytest
import torch
from models import padded_batch, small_model

import probe
from probe.capture.rows import RowBlock, block_rows, scored
from probe.errors import ProbeError
from probe.options import parse_size

KINDS = ["llama", "mistral", "qwen2", "bert", "gpt2", "albert", "gpt_neox", "qwen3"]


@pytest.fixture(params=["fused", "torch"])
def path(request, monkeypatch):
    """Blocks summarised by the fused kernel (where it is built here), or by torch."""
    from probe.capture import fused, rows

    if request.param == "torch":
        monkeypatch.setattr(rows, "softmax_stats", lambda *args: None)
    elif not fused.available(torch.device("cpu")):
        pytest.skip(f"the kernel is not built here: {fused.described()}")
    return request.param


def captured(model, inputs):
    """Each layer's ``Scored``, and the model's output, under the rows capture."""
    got = {}
    with torch.inference_mode(), scored(model, lambda layer, s: got.__setitem__(layer, s)):
        out = model(**inputs).last_hidden_state
    return got, out


def whole(model, inputs):
    with torch.inference_mode(), probe.trace(model, ["hook_pattern"]) as cache:
        model(**inputs)
    return cache.stack("hook_pattern").float()  # [layer, batch, head, q, k]


@pytest.mark.parametrize("kind", KINDS)
def test_row_blocks_equal_the_mirrors_pattern(kind, path):
    """Padded batches (left-padded decoders, right-padded encoders), GQA (llama, mistral, qwen2,
    qwen3), a sliding window of 4 (mistral), a layer shared by three (albert)."""
    model, inputs = small_model(kind), padded_batch(kind)
    got, _ = captured(model, inputs)
    reference = whole(model, inputs)
    real = inputs["attention_mask"].bool()[:, None, :, None]  # padding queries are not compared
    assert sorted(got) == list(range(len(reference)))
    T = inputs["input_ids"].shape[1]
    for layer, s in got.items():
        for size in (1, 2, 3, T):
            for start in range(0, T, size):
                block = s.block(slice(start, min(start + size, T)))
                assert (block.fused is not None) == (path == "fused")
                rows = block.full(T)
                want = reference[layer][:, :, block.rows]
                assert block.pattern.shape[-1] == block.keys.stop - block.keys.start
                kept = real[:, :, block.rows]
                torch.testing.assert_close(rows * kept, want * kept, atol=2e-7, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_unpadded_long_input_skips_the_keys_it_cannot_see(kind):
    """No padding: llama's mask is sdpa's is_causal (no mask tensor at all); mistral's window of 4
    makes its keys start 4 before the block."""
    model = small_model(kind)
    ids = torch.randint(3, 99, (1, 40), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    got, _ = captured(model, inputs)
    reference = whole(model, inputs)
    if kind == "llama":
        assert got[0].mask is None and got[0].causal
    for layer, s in got.items():
        sizes = []  # each block is read before the next, which reuses its memory
        for block in s.blocks(4 * 4 * 4 * 40 * 7):  # 4 heads, 40 keys: 7 rows a block
            sizes.append(block.rows.stop - block.rows.start)
            assert block.keys.stop == block.rows.stop
            if kind == "mistral":
                assert block.keys.start == max(0, block.rows.start - 4)
            torch.testing.assert_close(block.full(40), reference[layer][:, :, block.rows],
                                       atol=2e-7, rtol=0)  # fmt: skip
        assert sizes == [7] * 5 + [5]


@pytest.mark.parametrize("kind", ["llama", "bert", "mistral"])
def test_the_output_is_the_models_own_sdpa_output(kind):
    model, inputs = small_model(kind), padded_batch(kind)
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        plain = model(**inputs).last_hidden_state
    _, out = captured(model, inputs)
    assert torch.equal(out, plain)
    assert model.config._attn_implementation == "sdpa"  # restored


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", [1, 3, None])
def test_the_output_mixed_from_the_blocks_is_sdpas(kind, size):
    """p · V from the blocks, handed back in place of sdpa's output, gives every real position's
    output as sdpa does, to float32 rounding: padded batches, grouped-query attention, a sliding
    window, a shared layer; in blocks of 1 and 3 rows, and whole."""
    model, inputs = small_model(kind), padded_batch(kind)
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        plain = model(**inputs).last_hidden_state
    T = inputs["input_ids"].shape[1]
    step = size or T

    def mix(layer, s):
        out = s.output()
        for start in range(0, T, step):
            s.add_output(s.block(slice(start, min(start + step, T))), out)
        return out

    with torch.inference_mode(), scored(model, mix):
        mixed = model(**inputs).last_hidden_state
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(mixed[real], plain[real], atol=2e-5, rtol=1e-5)


def test_whole_block_and_full():
    p = torch.rand(2, 3, 5, 5)
    block = RowBlock.whole(p)
    assert (
        block.rows == slice(0, 5) and block.keys == slice(0, 5) and block.full(5) is block.pattern
    )
    part = RowBlock(slice(2, 4), slice(1, 3), torch.ones(1, 1, 2, 2))
    assert part.full(5)[0, 0].tolist() == [[0, 1, 1, 0, 0]] * 2


@pytest.mark.parametrize(
    ("text", "size"),
    [("512MiB", 512 * 2**20), ("4GiB", 4 * 2**30), ("1.5GB", 1_500_000_000), ("65536", 65536),
     (" 2 kib ", 2048)],
)  # fmt: skip
def test_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "4 parsecs", "0", "1e9", "0.1B"])
def test_a_bad_size_is_one_line(text):
    with pytest.raises(ProbeError, match=r"^--attention-budget takes a size such as") as e:
        parse_size(text)
    assert "\n" not in str(e.value)


def test_block_rows_follow_the_budget():
    # 4 float32 tensors of [batch 2, head 8, rows, 1000 keys]: 256,000 bytes a row
    assert block_rows(256_000 * 10, 2, 8, 1000) == 10
    assert block_rows(256_000 * 11 - 1, 2, 8, 1000) == 10
    assert block_rows(1, 2, 8, 1000) == 1  # never none


def test_the_command_line_refuses_a_bad_budget_before_loading(tmp_path):
    from typer.testing import CliRunner

    from probe.app.cli import app

    out = tmp_path / "report"
    args = ["analyze", "-m", "minilm", "-t", "sample", "-q", "--out", str(out),
            "--attention-budget", "lots"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code != 0 and not out.exists()
    assert "--attention-budget takes a size such as 512MiB, 4GiB or 2GB, not 'lots'" in (
        result.output
    )


@pytest.mark.parametrize("kind", ["llama", "mistral", "bert", "gpt2"])
@pytest.mark.slow
def test_each_querys_summary_is_its_rows(kind, path):
    """Entropy and largest weight, from the scores beside the pattern, equal -Σ p log p and
    ``max`` of the block's rows; and which of the offsets -2…2 holds the first largest weight
    is where ``max`` puts it; what the real queries give each key is their rows' sum. Of a
    whole pattern, which has no scores, too."""
    model, inputs = small_model(kind), padded_batch(kind)
    got, _ = captured(model, inputs)
    real = inputs["attention_mask"].float()
    for s in got.values():
        for size in (1, 3, 4, 15):
            for block in s.blocks(4 * 4 * 4 * 15 * size, real):  # blocks of `size` rows (15 keys)
                p = block.pattern.clone()
                given = (real[:, None, None, block.rows] @ p).squeeze(-2)
                torch.testing.assert_close(block.received, given, atol=1e-6, rtol=1e-6)
                assert torch.equal(RowBlock(block.rows, block.keys, p).received, p.sum(-2))
                want = -torch.where(p > 0, p * p.log(), torch.zeros(())).sum(-1)
                top, index = p.max(-1)
                query = torch.arange(block.rows.start, block.rows.stop)
                offset = index + block.keys.start - query + 2
                offset[(offset < 0) | (offset > 4)] = 5
                # with the scores or without, where the maximum lies asked after or before
                again = s.block(block.rows)
                for made in (block, RowBlock(block.rows, block.keys, p), again):
                    where = made.max_at((-2, -1, 0, 1, 2)) if made is again else None
                    entropies, largest = made.summary
                    torch.testing.assert_close(entropies, want, atol=2e-6, rtol=1e-5)
                    assert torch.equal(largest, top) and torch.equal(made.top, top)
                    if where is None:
                        where = made.max_at((-2, -1, 0, 1, 2))
                    assert torch.equal(where, offset)


def test_the_first_of_tied_maxima_is_found():
    """Ties, as ``max`` breaks them: the first key; a maximum before the offsets hides those
    in them."""
    p = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [1, 0, 0, 1]]) / 2
    block = RowBlock.whole(p[None, None].float())
    assert block.max_at((-1, 0)).tolist() == [[[1, 0, 0, 2]]]  # query 3's first is key 0
    assert block.max_at((0, 1)).tolist() == [[[0, 2, 2, 2]]]
