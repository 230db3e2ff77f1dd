"""Train the tiny GPT-2 of `tests/support/induction.py` and save it to tests/data/induction-gpt2/.

    python tests/support/make_induction_model.py

Seeded and deterministic on the CPU (one thread; about five minutes on a busy two-core machine).
It trains on repeated sequences, BOS + n random tokens + the same n tokens (`induction.repeated`),
with the next-token loss, saves the model (float32 safetensors) and a word-level tokenizer over
"t0".."t63", and prints every head's previous-token and induction scores and the losses, from
which `induction.PREVIOUS_TOKEN` and `induction.INDUCTION` were set.

Trained on n from 20 to 30 alone, with GPT-2's learned absolute positions, the model does not
learn the textbook circuit: it finds shortcuts instead (layer-0 heads that look a fixed ~20
positions back, or to absolute positions where the second copy tends to be), which reach a low
loss on those lengths and fail on others. Four choices make the previous-token + induction
circuit the one that forms:

- n is drawn per sequence from 2..30 (`LENGTHS`; shorter sequences padded on the right, their
  padding left out of the loss), and the first `training.WARM_STEPS` steps draw n from 2..4,
  where a head that copies the previous token already predicts the second copy;
- each sequence's positions start at a random offset, so no absolute position tells where the
  second copy starts (at use, positions start at 0 as usual);
- the position embeddings start as sinusoids (then train), which makes "one position back" one
  linear map at every position.
"""

from __future__ import annotations

import math
import time

import torch
import training
from induction import (
    BOS,
    MODEL,
    VOCAB,
    copy_losses,
    fresh,
    induction_scores,
    previous_token_scores,
    repeated,
)
from transformers import GPT2Config, GPT2LMHeadModel

import probe

SEED = 0
STEPS = 8000
SINUSOID = 0.05  # amplitude of the sinusoidal position embeddings at initialisation


def config() -> GPT2Config:
    return GPT2Config(
        vocab_size=VOCAB,
        n_positions=128,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=BOS,
        eos_token_id=BOS,
    )


def tokenizer():
    """Word level over "t0".."t63" (token i is "ti"), BOS "t0" put in front of every text, as in
    training; "t0" also pads, and stands for any word outside the vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    bos = f"t{BOS}"
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token=bos))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, BOS)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=bos, pad_token=bos, unk_token=bos
    )


def sinusoids(positions: int, d: int) -> torch.Tensor:
    """``[positions, d]``: sin and cos of position × 10000^(-2k/d), interleaved."""
    pos = torch.arange(positions)[:, None].float()
    freq = torch.exp(-math.log(10000.0) * torch.arange(0, d, 2).float() / d)
    table = torch.zeros(positions, d)
    table[:, 0::2], table[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)
    return table


def train(seed: int = SEED) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config())
    wpe = model.transformer.wpe.weight
    with torch.no_grad():
        wpe.copy_(SINUSOID * sinusoids(*wpe.shape))
    return training.train(model, STEPS, model.config.n_positions, print_every=500, seed=seed)


def report(model: GPT2LMHeadModel) -> None:
    """Every head's scores, the losses, and the loss with each layer-1 head ablated."""
    torch.set_printoptions(precision=3)
    for n in (12, 20, 24, 25, 30):
        ids = repeated(256, n, VOCAB, seed=1)
        with torch.no_grad(), probe.trace(model, "hook_pattern") as cache:
            logits = model(input_ids=ids).logits
        patterns = torch.stack([cache[f"blocks.{layer}.attn.hook_pattern"] for layer in range(2)])
        null = fresh(256, n, VOCAB, seed=1)
        with torch.no_grad():
            null_logits = model(input_ids=null).logits
        print(f"n={n}: previous-token scores [layer, head]\n{previous_token_scores(patterns)}")
        print(f"n={n}: induction scores [layer, head]\n{induction_scores(patterns, n)}")
        print(f"n={n}: repeated: {losses(logits, ids, n)}")
        print(f"n={n}: fresh:    {losses(null_logits, null, n)}")
        for head in [(0, 0), *((1, h) for h in range(4))]:
            with torch.no_grad(), probe.ablate(model, [head]):
                ablated = model(input_ids=ids).logits
            print(f"n={n}: repeated, {head} zero-ablated: {losses(ablated, ids, n)}")


def losses(logits: torch.Tensor, ids: torch.Tensor, n: int) -> str:
    first, second = copy_losses(logits, ids, n)
    return f"first copy {first:.3f}  second copy {second:.3f}"


def main() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    start = time.perf_counter()
    model = train()
    print(f"trained in {time.perf_counter() - start:.0f} s")
    model.save_pretrained(MODEL, safe_serialization=True)
    tokenizer().save_pretrained(MODEL)
    print(f"saved to {MODEL}: {sum(f.stat().st_size for f in MODEL.iterdir())} bytes")
    report(model)


if __name__ == "__main__":
    main()
