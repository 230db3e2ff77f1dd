"""Train the tiny Llama with grouped-query attention of `tests/support/induction.py` (`MODEL_GQA`)
and save it to tests/data/induction-llama-gqa/.

    python tests/support/make_induction_llama.py

The repeats task of `tests/support/make_induction_model.py` (same batches: n drawn per sequence from
2..30 after a warm-up on 2..4, BOS + x + x, padding left out of the loss, the same word-level
tokenizer), on a 2-layer Llama with 4 query heads sharing 2 key/value heads per layer (d_model
64, head width 16). Its rotary positions are relative, so no position shortcut needs breaking:
the random position offsets of the GPT-2's batches do nothing here. Seeded and deterministic on
the CPU (one thread; 550 s and 811 s on a busy two-core machine, the two runs' weights
byte-identical; the second copy's loss falls below 1 after some 2,000 steps), it prints the
losses, every head's previous-token and induction scores (low: it found an induction circuit
that looks 9 and 8 positions back instead of 1 and 0, see `induction.MODEL_GQA`), and the
losses with heads zero-ablated.

On this model `probe analyze -a circuit --task repeats --lm-head` reaches faithfulness 0.807
with 17 of its 110 edges (tests/interventions/test_grouped.py). With a learning rate of 5e-4 it
learned as well, but needed 32 edges; with 2e-3 decayed from step 1,500 of 3,000, it had not learned
to copy (second-copy loss 2.8).
"""

from __future__ import annotations

import time

import torch
import training
from induction import BOS, MODEL_GQA, VOCAB
from make_induction_model import report, tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

SEED = 0
STEPS = 4000


def config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=BOS,
        eos_token_id=BOS,
        pad_token_id=BOS,
    )


def train(seed: int = SEED) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config())
    n_positions = model.config.max_position_embeddings
    return training.train(model, STEPS, n_positions, print_every=250, seed=seed)


def main() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    start = time.perf_counter()
    model = train()
    print(f"trained in {time.perf_counter() - start:.0f} s")
    model.save_pretrained(MODEL_GQA, safe_serialization=True)
    tokenizer().save_pretrained(MODEL_GQA)
    print(f"saved to {MODEL_GQA}: {sum(f.stat().st_size for f in MODEL_GQA.iterdir())} bytes")
    report(model)


if __name__ == "__main__":
    main()
