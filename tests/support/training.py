"""The repeats task's training, one loop for both trained models (`make_induction_model.py`'s
GPT-2 and `make_induction_llama.py`'s Llama): the batches, the learning-rate schedule and the
optimisation steps, with the losses on held-out repeats printed as it goes.

The batches: n drawn per sequence from 2..30 (`induction.LENGTHS`; shorter sequences padded on
the right, their padding left out of the loss), after `WARM_STEPS` steps that draw n from 2..4,
where a head that copies the previous token already predicts the second copy; each sequence's
positions start at a random offset, so no absolute position tells where the second copy starts
(a model with relative positions ignores it).
"""

from __future__ import annotations

import math
import time

import torch
from induction import BOS, LENGTHS, VOCAB, copy_losses, repeated

BATCH = 32
LR = 1e-3
WARMUP = 200  # steps of linear learning-rate warm-up
DECAY = 0.75  # cosine decay of the learning rate to 0 over the steps after this fraction
WARM_LENGTHS, WARM_STEPS = (2, 4), 600


def batch(step: int, g: torch.Generator, n_positions: int):
    """One training batch: token ids ``[BATCH, T]`` (BOS, x, x, then padding), next-token
    targets ``[BATCH, T-1]`` (-100 on padding) and position ids ``[BATCH, T]``."""
    low, high = WARM_LENGTHS if step < WARM_STEPS else LENGTHS
    ns = torch.randint(low, high + 1, (BATCH,), generator=g)
    T = 1 + 2 * int(ns.max())
    ids = torch.full((BATCH, T), BOS)
    targets = torch.full((BATCH, T - 1), -100)
    for b, n in enumerate(ns.tolist()):
        x = torch.randint(1, VOCAB, (n,), generator=g)
        ids[b, 1 : 1 + 2 * n] = torch.cat([x, x])
        targets[b, : 2 * n] = ids[b, 1 : 1 + 2 * n]
    offsets = torch.randint(0, n_positions - T + 1, (BATCH, 1), generator=g)
    return ids, targets, offsets + torch.arange(T)


def learning_rate(step: int, steps: int) -> float:
    """Factor on LR at ``step`` of ``steps``: linear warm-up, constant, then cosine decay to 0."""
    if step > steps * DECAY:
        return 0.5 * (1 + math.cos(math.pi * (step - steps * DECAY) / (steps * (1 - DECAY))))
    return min(1.0, (step + 1) / WARMUP)


def train(model, steps: int, n_positions: int, print_every: int, seed: int):
    """``model`` (a causal LM over `VOCAB`, freshly initialised) trained ``steps`` steps on the
    repeats task, its batches drawn from ``seed``, its positions below ``n_positions``; the loss
    and the held-out losses (n = 25) printed every ``print_every`` steps and at the last."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: learning_rate(step, steps))
    g = torch.Generator().manual_seed(seed)
    held_out = repeated(64, 25, VOCAB, seed=3)
    start = time.perf_counter()
    model.train()
    for step in range(steps):
        ids, targets, positions = batch(step, g, n_positions)
        logits = model(input_ids=ids, position_ids=positions).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100
        )
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % print_every == 0 or step == steps - 1:
            with torch.no_grad():
                first, second = copy_losses(model(input_ids=held_out).logits, held_out, 25)
            print(
                f"step {step:5d}  loss {loss.item():.3f}  n=25: first copy {first:.3f}  "
                f"second copy {second:.3f}  {time.perf_counter() - start:.0f} s",
                flush=True,
            )
    return model.eval()
