"""Head importance: each head's ablation effect against plain PyTorch forward hooks, gradient
importance against finite differences, the kept sentences, and the command line."""

import json

import numpy as np
import pandas as pd
import pytest
import torch
import transformers as tf
from models import SMALL
from tokenizers_util import byte_level_bpe, wordpiece
from typer.testing import CliRunner

from analyses import Context
from analyses.importance import Importance
from probe.app.cli import app
from probe.capture.architectures import architecture, blocks, head_dim
from probe.inputs.corpus import Corpus
from probe.inputs.treebank import SAMPLE, iter_conllu

N_SENTENCES = 6


def gpt2_lm(dtype=torch.float32):
    torch.manual_seed(0)
    config = tf.GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=300, n_positions=128,
                           bos_token_id=0, eos_token_id=0)  # fmt: skip
    return tf.GPT2LMHeadModel(config).eval().to(dtype)


def bert(lm: bool = False):
    torch.manual_seed(0)
    # Weights larger than BERT's 0.02 initialisation, or a random model's heads barely matter.
    config = tf.BertConfig(**SMALL | {"vocab_size": 130}, intermediate_size=64,
                           initializer_range=0.2)  # fmt: skip
    return (tf.BertForMaskedLM(config) if lm else tf.BertModel(config)).eval()


def importance(model, tokenizer, ablation: str, batch_size: int = 4) -> tuple[Importance, list]:
    """The analysis fed the sample treebank's batches; and the kept sentences' token ids."""
    context = Context(
        len(blocks(model)), model.config.num_attention_heads,
        causal=model.config.model_type == "gpt2", model=model,
        options={"importance_sentences": N_SENTENCES, "importance_ablation": ablation},
        mask_token_id=tokenizer.mask_token_id,
    )  # fmt: skip
    analysis = Importance(context)
    for batch in Corpus(iter_conllu(SAMPLE), tokenizer, 64).batches(batch_size):
        analysis.begin_batch(batch)
    return analysis, [analysis.kept[i][0] for i in sorted(analysis.kept)]


def replace_head(model, layer: int, head: int, value):
    """A plain PyTorch pre-hook on the output projection replacing one head's slice of its
    input (z) by ``value(slice)``: ablation without probe, on the model's own attention."""
    o = blocks(model)[layer].get_submodule(architecture(model).o)
    d = head_dim(model)

    def hook(_module, args):
        x = args[0].clone()
        x[..., head * d : (head + 1) * d] = value(x[..., head * d : (head + 1) * d])
        return (x, *args[1:])

    return o.register_forward_pre_hook(hook)


def each_sentence(model, sentences, layer=None, head=None, value=None):
    """The model's output on each sentence alone (no padding), with one head replaced."""
    handle = replace_head(model, layer, head, value) if value is not None else None
    try:
        with torch.no_grad():
            return [model(input_ids=torch.tensor([ids])) for ids in sentences]
    finally:
        if handle is not None:
            handle.remove()


def head_mean(model, sentences, layer, head) -> torch.Tensor:
    """The head's z averaged over every token of the sentences, read from the projection."""
    seen = []
    o = blocks(model)[layer].get_submodule(architecture(model).o)
    d = head_dim(model)
    handle = o.register_forward_pre_hook(
        lambda _m, args: seen.append(args[0][0, :, head * d : (head + 1) * d])
    )
    try:
        each_sentence(model, sentences)
    finally:
        handle.remove()
    return torch.cat(seen).mean(0)


@pytest.mark.parametrize("ablation", ["zero", "mean"])
@pytest.mark.slow
def test_effect_on_the_hidden_state_against_plain_hooks(ablation):
    """Without a language-model head: mean over tokens of ‖h_ablated − h‖ / ‖h‖, one head
    ablated by a plain hook, sentence by sentence; the analysis batches and pads."""
    model, tokenizer = bert(), wordpiece()
    analysis, sentences = importance(model, tokenizer, ablation)
    table = analysis.finish()["importance"].set_index(["layer", "head"])
    layer, head = 1, 2
    mean = head_mean(model, sentences, layer, head) if ablation == "mean" else 0
    plain = each_sentence(model, sentences)
    ablated = each_sentence(model, sentences, layer, head, lambda x: torch.zeros_like(x) + mean)
    changes = torch.cat([
        (a.last_hidden_state - p.last_hidden_state).norm(dim=-1) / p.last_hidden_state.norm(dim=-1)
        for a, p in zip(ablated, plain, strict=True)
    ], dim=1)  # fmt: skip
    assert table.loc[(layer, head), "ablation_effect"] == pytest.approx(
        float(changes.mean()), rel=1e-4
    )
    assert table.gradient_importance.isna().all()  # no language-model head, no loss
    assert sorted(table["rank"]) == list(range(1, len(table) + 1))
    assert table["rank"].idxmin() == table.ablation_effect.idxmax()


@pytest.mark.slow
def test_effect_on_the_predictions_against_plain_hooks():
    """With a language-model head: mean over tokens of KL(p ‖ p_ablated) (float64: a random
    model's effects are small, and float32 would leave few significant digits)."""
    model, tokenizer = gpt2_lm(torch.float64), byte_level_bpe()
    analysis, sentences = importance(model, tokenizer, "zero")
    table = analysis.finish()["importance"].set_index(["layer", "head"])
    plain = each_sentence(model, sentences)
    for layer, head in [(0, 1), (1, 3)]:
        ablated = each_sentence(model, sentences, layer, head, torch.zeros_like)
        kl = torch.cat([
            torch.nn.functional.kl_div(a.logits.log_softmax(-1), p.logits.log_softmax(-1),
                                       log_target=True, reduction="none").sum(-1)
            for a, p in zip(ablated, plain, strict=True)
        ], dim=1)  # fmt: skip
        assert table.loc[(layer, head), "ablation_effect"] == pytest.approx(
            float(kl.mean()), rel=1e-4
        )


@pytest.mark.slow
def test_gradient_importance_against_finite_differences():
    """Michel et al.'s E_x |∂L(x)/∂ξ_h|, L the mean next-token loss of sentence x: against
    central differences of L with the head's output scaled by 1 ± ε (float64)."""
    model, tokenizer = gpt2_lm(torch.float64), byte_level_bpe()
    analysis, sentences = importance(model, tokenizer, "zero")
    table = analysis.finish()["importance"].set_index(["layer", "head"])
    eps = 1e-5

    def losses(layer, head, scale):
        outs = each_sentence(model, sentences, layer, head, lambda x: x * scale)
        return np.array([
            float(torch.nn.functional.cross_entropy(out.logits[0, :-1], torch.tensor(ids[1:])))
            for out, ids in zip(outs, sentences, strict=True)
        ])  # fmt: skip

    for layer, head in [(0, 0), (1, 2)]:
        slope = (losses(layer, head, 1 + eps) - losses(layer, head, 1 - eps)) / (2 * eps)
        expected = np.abs(slope).mean()
        assert table.loc[(layer, head), "gradient_importance"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow
def test_masked_model_gradient_and_curve():
    """A masked language model: gradient importance over a keyed 15% of word tokens masked;
    the pruning curve starts at 0 and removes 10%, 20%… of the heads."""
    tokenizer = wordpiece(mask=True)
    analysis, _ = importance(bert(lm=True), tokenizer, "mean")
    tables = analysis.finish()
    gradient = tables["importance"].gradient_importance
    assert gradient.notna().all() and (gradient >= 0).all() and gradient.max() > 0
    curve = tables["importance_curve"]
    assert curve.heads_removed.tolist() == [round(k * 0.8) for k in range(10)]  # of 8 heads
    assert curve.output_change.iloc[0] == 0 and (curve.output_change.iloc[1:] > 1e-4).all()
    run = tables["importance_run"].iloc[0].to_dict()
    assert {k: run[k] for k in ("measure", "ablation", "sentences")} == {
        "measure": "kl", "ablation": "mean", "sentences": N_SENTENCES}  # fmt: skip
    by_hand = np.corrcoef(tables["importance"].ablation_effect.rank(), gradient.rank())[0, 1]
    assert run["rank_correlation"] == pytest.approx(by_hand)


def test_kept_sentences_merge_and_ignore_batching():
    """The first sentences by position, whatever the batch size or the split between two
    instances (processes)."""
    model, tokenizer = bert(), wordpiece()
    whole, _ = importance(model, tokenizer, "zero", batch_size=32)
    small, _ = importance(model, tokenizer, "zero", batch_size=3)
    assert whole.kept == small.kept and sorted(whole.kept) == list(range(N_SENTENCES))
    a, b = Importance(whole.context), Importance(whole.context)
    for i, batch in enumerate(Corpus(iter_conllu(SAMPLE), tokenizer, 64).batches(5)):
        (a if i % 2 else b).begin_batch(batch)
    a.merge(b)
    assert a.kept == whole.kept


@pytest.fixture(scope="module")
def lm_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2-lm")
    gpt2_lm().save_pretrained(folder)
    byte_level_bpe().save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_command_line(lm_folder, tmp_path):
    """`-a importance --lm-head` writes the tables, joins the effect into heads.csv, and draws
    its section; a model without a head, or an unknown ablation, is one line."""
    out = tmp_path / "report"
    args = ["analyze", "-m", str(lm_folder), "-a", "importance", "--lm-head", "-o", str(out), "-q",
            "--importance-sentences", "10", "--importance-ablation", "zero"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    table = pd.read_csv(out / "importance.csv")
    assert len(table) == 8 and table.gradient_importance.notna().all()
    heads = pd.read_csv(out / "heads.csv")
    assert heads.importance_effect.tolist() == table.ablation_effect.tolist()
    run = json.loads((out / "run.json").read_text())
    assert run["lm_head"] and run["analyses"] == ["importance"]
    assert run["sentences_read"] == 10  # alone, it reads no further than it needs
    html = (out / "index.html").read_text()
    assert "Head importance" in html and "Pruning" in html and "rank correlation" in html

    bad = CliRunner().invoke(app, [*args[:-2], "--importance-ablation", "max", "--overwrite"])
    assert bad.exit_code == 1 and "unknown --importance-ablation 'max'" in bad.output


def test_a_model_without_a_head_is_one_line(tmp_path):
    folder = tmp_path / "bare"
    bert().save_pretrained(folder)
    wordpiece().save_pretrained(folder)
    result = CliRunner().invoke(
        app,
        ["analyze", "-m", str(folder), "-a", "importance", "--lm-head", "-o", str(tmp_path / "r")],
    )
    assert result.exit_code == 1
    assert "has no language-model head in its checkpoint" in result.output
    assert not (tmp_path / "r").exists()


def test_importance_is_not_run_by_default():
    from analyses import REGISTRY, defaults

    assert "importance" in REGISTRY and "importance" not in defaults()


@pytest.mark.slow
def test_ablated_passes_run_the_models_sdpa_kernel(monkeypatch):
    """Ablation reads z alone: importance's forward passes (means, effects, curve, gradient)
    run the model's own sdpa kernel and never compute a pattern, and give the tables the eager
    attention gives."""
    from transformers import AttentionInterface

    import probe.capture.attention_function

    tokenizer = byte_level_bpe()
    model = gpt2_lm()
    assert model.config._attn_implementation == "sdpa"
    calls = []
    sdpa = AttentionInterface._global_mapping["sdpa"]
    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa",
                        lambda *a, **k: calls.append(1) or sdpa(*a, **k))  # fmt: skip

    def no_pattern(*args):
        raise AssertionError("a pattern was computed")

    monkeypatch.setattr(probe.capture.attention_function, "_pattern_beside", no_pattern)
    fast = importance(model, tokenizer, "mean")[0].finish()
    # two layers of: the means, the reference, 8 heads, 9 shares of the curve, the gradient
    assert len(calls) == 2 * (1 + 1 + 8 + 9 + 1)
    monkeypatch.undo()
    model.set_attn_implementation("eager")
    slow = importance(model, tokenizer, "mean")[0].finish()
    for name, table in slow.items():
        pd.testing.assert_frame_equal(fast[name], table, check_exact=False, rtol=1e-4, atol=1e-6)
