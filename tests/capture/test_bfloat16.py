"""bfloat16 on the CPU, the dtype a GPU runs models in: ``probe.trace``, ``probe.patch``,
``probe.attribute`` and ``probe.edges`` on a bfloat16 model against the same weights in float32.

bfloat16 keeps 8 significant bits: each operation rounds by up to 2⁻⁸ of its value, and a capture
two layers deep, or a metric's change between two runs, differs from float32's by up to about 2%
of the largest value (measured: the induction model's tables 0.2-0.4%, its deepest captures
2.1%; a random Llama's tables 1.8-2.1%). The tolerance is 2⁻⁵ (3.1%) of the float32 tensor's or
table's largest magnitude; the rankings that the analyses report must not move.
"""

import pytest
import torch
import transformers as tf
from induction import INDUCTION, MODEL
from models import SMALL

import probe
from analyses.circuit.task import repeats_task

pytestmark = pytest.mark.slow  # float32 and bfloat16 runs of every intervention

TOLERANCE = 2**-5  # of the float32 value's largest magnitude
INDUCTION_HEADS = {(1, h) for h in range(4)}


def assert_close_to(bf16: torch.Tensor, f32: torch.Tensor, what: str) -> None:
    """``bf16`` within TOLERANCE of ``f32``'s scale."""
    scale = float(f32.abs().max())
    torch.testing.assert_close(bf16.double(), f32.double(), atol=TOLERANCE * scale, rtol=0,
                               msg=lambda m: f"{what}: {m}")  # fmt: skip


def twins(build):
    """``build()`` twice with the same weights: float32, and bfloat16."""
    torch.manual_seed(0)
    f32 = build().eval()
    bf16 = build().eval()
    bf16.load_state_dict(f32.state_dict())
    return f32, bf16.to(torch.bfloat16)


def induction_twins():
    return twins(lambda: tf.GPT2LMHeadModel.from_pretrained(MODEL))


def llama_twins():
    """A random Llama (RoPE, grouped-query attention, RMSNorm), its weights drawn ten times wider
    than the default so that patching changes the metric by tenths, not thousandths (below
    bfloat16's resolution of a log-probability near −5)."""
    config = tf.LlamaConfig(**SMALL, intermediate_size=64, num_key_value_heads=2,
                            initializer_range=0.2)  # fmt: skip
    return twins(lambda: tf.LlamaForCausalLM(config))


@pytest.fixture(scope="module")
def induction():
    tokenizer = tf.AutoTokenizer.from_pretrained(MODEL)
    clean, corrupted, metric = repeats_task(tokenizer, 0, 8, 10, 128)
    return (*induction_twins(), clean, corrupted, metric)


def random_pairs(pairs: int = 8, length: int = 12):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 99, (pairs, length), generator=g)
    other = ids.clone()
    other[:, 3:6] = torch.randint(3, 99, (pairs, 3), generator=g)
    answer = ids[:, -1]

    def metric(logits):
        logp = torch.log_softmax(logits[:, -2].float(), dim=-1)
        return logp.gather(-1, answer.to(logp.device)[:, None])[:, 0]

    mask = torch.ones_like(ids)
    return {"input_ids": ids, "attention_mask": mask}, {"input_ids": other,
                                                        "attention_mask": mask}, metric  # fmt: skip


@pytest.mark.parametrize("build", [induction_twins, llama_twins], ids=["gpt2", "llama"])
def test_a_trace_of_a_bfloat16_model_keeps_its_output_and_captures_float32s_values(build):
    """Every hook point: the output bit for bit the untouched bfloat16 model's (a padded batch
    too), each capture bfloat16 and within tolerance of the float32 twin's."""
    f32, bf16 = build()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 60, (3, 9), generator=g)
    padded = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    padded["attention_mask"][1, :3] = 0  # left padding, as decoders are padded
    whole = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        for batch in (whole, padded):
            untouched = bf16(**batch).logits
            with probe.trace(bf16):
                traced = bf16(**batch).logits
            assert torch.equal(traced, untouched)
        with probe.trace(bf16) as low:
            bf16(**whole)
        with probe.trace(f32) as high:
            f32(**whole)
    assert low.keys() == high.keys() and len(low) > 20
    for name in high:
        assert low[name].dtype == torch.bfloat16, name
        if name.endswith("hook_attn_scores"):  # masked scores hold each dtype's own minimum
            real = high[name] > torch.finfo(torch.float32).min / 2
            assert_close_to(low[name].float()[real], high[name][real], name)
        else:
            assert_close_to(low[name], high[name], name)


def test_patch_and_attribute_on_bfloat16_agree_with_float32(induction):
    f32, bf16, clean, corrupted, metric = induction
    for method in ("patch", "attribute"):
        run = getattr(probe, method)
        column = {"patch": "effect", "attribute": "attribution"}[method]
        high, low = (run(model, clean, corrupted, metric) for model in (f32, bf16))
        assert low.attrs["pairs"] == high.attrs["pairs"] == 8
        assert_close_to(torch.tensor(low[column].to_numpy()),
                        torch.tensor(high[column].to_numpy()), method)  # fmt: skip
        for table in (high, low):  # the four induction heads first in both
            top = table.nlargest(4, column)
            assert set(zip(top.layer, top["head"], strict=True)) == INDUCTION_HEADS, method


def test_edges_on_bfloat16_agree_with_float32(induction):
    """EAP-IG's every edge, and the previous-token head's edge into the induction head's key
    strongest of the keys it enters, in both."""
    f32, bf16, clean, corrupted, metric = induction
    high, low = (probe.edges(model, clean, corrupted, metric, steps=3) for model in (f32, bf16))
    assert list(low.sender) == list(high.sender) and list(low.receiver) == list(high.receiver)
    assert_close_to(torch.tensor(low.score.to_numpy()), torch.tensor(high.score.to_numpy()),
                    "edges")  # fmt: skip
    induction_head = "{}-{}".format(*INDUCTION)
    for table in (high, low):
        keys = table[(table.receiver == induction_head) & (table.input == "k")]
        assert keys.loc[keys.score.idxmax()].sender == "0-0"


def test_rotary_grouped_query_bfloat16_agrees_with_float32():
    """A random Llama: patching and attribution as in float32; its edges as in float32, or
    refused in one line (grouped-query attention) in both dtypes alike."""
    f32, bf16 = llama_twins()
    clean, corrupted, metric = random_pairs()
    for method, column in (("patch", "effect"), ("attribute", "attribution")):
        high, low = (getattr(probe, method)(m, clean, corrupted, metric) for m in (f32, bf16))
        assert_close_to(torch.tensor(low[column].to_numpy()),
                        torch.tensor(high[column].to_numpy()), method)  # fmt: skip
    scores = []
    for model in (f32, bf16):
        try:
            scores.append(probe.edges(model, clean, corrupted, metric, steps=2).score)
        except probe.ProbeError as e:
            assert len(str(e).splitlines()) == 1 and "grouped-query" in str(e)
            scores.append(None)
    high, low = scores
    assert (high is None) == (low is None)  # the dtype changes no answer
    if high is not None:
        assert_close_to(torch.tensor(low.to_numpy()), torch.tensor(high.to_numpy()), "edges")
