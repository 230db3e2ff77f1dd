"""Train the induction GPT-2's recipe again and save checkpoints along the way, to
tests/data/induction-gpt2-steps/, for ``probe timeline``'s tests.

    python tests/support/make_induction_checkpoints.py      # the shipped checkpoints
    python tests/support/make_induction_checkpoints.py --every 100 --out /tmp/steps  # to choose
    python tests/support/make_induction_checkpoints.py --every 250 --seed 1 --out /tmp/seed-1

The recipe is `tests/support/make_induction_model.py`'s, step for step (its config, batches,
learning rate and seed): the model after the last step saved is the one that script's training
reaches at that step. Each checkpoint is a trainer's ``checkpoint-N/`` folder (N optimizer
steps taken; ``checkpoint-0`` is the initialisation), saved with ``save_pretrained`` and the
word-level tokenizer, and ``losses.json`` beside them holds the held-out loss on the first and
the second copy (n = 25, `induction.copy_losses`) at each one. Seeded and deterministic on
one CPU thread.

`STEPS_SAVED` was chosen from a run with ``--every 250`` (--last 5500): the second copy's
loss stays near log 63 until step ~2000, then falls in a phase change, 3.42 (2250), 3.05
(2500), 2.10 (2750), 1.21 (3000), 0.93 (3250), 0.61 (3750), 0.41 (4500). With
``probe analyze -a taxonomy --repeat-length 20``, the four layer-1 heads gain the induction
role at 2750 (the steepest fall) and heads 0-0 and 0-1 the previous-token role at 3000; their
scores rise together (layer 0's previous-token scores 0.11 each at 2250, 0.20 at 2750). The
steps saved are the initialisation, 2000 and every 250 steps through the fall, and 4500.
Training to 4500 takes about 2 minutes on an idle CPU thread (15 on a busy two-core machine).

`--seed` trains the recipe from another seed. Seeds 1 to 4 (``--every 250 --last 8000``, the
recipe's full run) form this circuit less cleanly: no layer-0 head gains the previous-token role
at any step (their layer-0 heads attend to the previous token only over a band of absolute
positions and look several tokens back elsewhere); the four layer-1 heads gain the induction
role at 5000 with seed 4, head 1-3 alone at 5250 with seed 1, and none by 8000 with seeds 2
and 3 (seed 3's second-copy loss is still 2.06 there).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from induction import VOCAB, copy_losses, repeated
from make_induction_model import SEED, SINUSOID, STEPS, config, sinusoids, tokenizer
from training import BATCH, LR, batch, learning_rate
from transformers import GPT2LMHeadModel

OUT = Path(__file__).parents[1] / "data" / "induction-gpt2-steps"
STEPS_SAVED = (0, 2000, 2250, 2500, 2750, 3000, 3250, 3500, 3750, 4500)
HELD_OUT_N = 25  # copy length of the held-out loss, as make_induction_model.py logs it


def train(saved: list[int], out: Path, seed: int = SEED) -> dict[int, dict[str, float]]:
    """Train for ``max(saved)`` steps, saving ``out/checkpoint-N/`` after N steps for each N in
    ``saved``; returns each saved step's held-out ``{"first_copy", "second_copy"}`` loss."""
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config())
    wpe = model.transformer.wpe.weight
    with torch.no_grad():
        wpe.copy_(SINUSOID * sinusoids(*wpe.shape))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    # the recipe's schedule is over its STEPS, whatever the last step saved here
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: learning_rate(step, STEPS))
    g = torch.Generator().manual_seed(seed)
    held_out = repeated(64, HELD_OUT_N, VOCAB, seed=3)
    losses: dict[int, dict[str, float]] = {}
    start = time.perf_counter()

    def save(step: int) -> None:
        model.eval()
        with torch.no_grad():
            first, second = copy_losses(model(input_ids=held_out).logits, held_out, HELD_OUT_N)
        model.train()
        losses[step] = {"first_copy": round(first, 4), "second_copy": round(second, 4)}
        folder = out / f"checkpoint-{step}"
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer().save_pretrained(folder)
        print(
            f"step {step:5d}  first copy {first:.3f}  second copy {second:.3f}  "
            f"{time.perf_counter() - start:.0f} s",
            flush=True,
        )

    model.train()
    for step in range(max(saved)):
        if step in saved:
            save(step)
        ids, targets, positions = batch(step, g, model.config.n_positions)
        logits = model(input_ids=ids, position_ids=positions).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100
        )
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    save(max(saved))
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=int, help="save every this many steps instead")
    parser.add_argument("--last", type=int, default=max(STEPS_SAVED), help="with --every")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--seed", type=int, default=SEED, help="the recipe's seed by default")
    args = parser.parse_args()
    saved = list(range(0, args.last + 1, args.every)) if args.every else list(STEPS_SAVED)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    losses = train(saved, args.out, seed=args.seed)
    record = {
        "held_out": f"repeated(64, {HELD_OUT_N}, seed=3): BOS, {HELD_OUT_N} random tokens, "
        "the same again; mean next-token loss on each copy (induction.copy_losses)",
        "batch": BATCH,
        "seed": args.seed,
        "steps": {str(step): value for step, value in sorted(losses.items())},
    }
    (args.out / "losses.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"saved {len(saved)} checkpoints to {args.out}: {size} bytes")


if __name__ == "__main__":
    main()
