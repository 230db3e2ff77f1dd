"""The loss ``probe timeline`` draws beside its roles (``--lm-head``): the model's mean
next-token loss on the second copy of the run's repeated sequences, the loss an induction head
lowers (Olsson et al. 2022); and on the first copy, which no head can predict better than the
tokens' frequencies, for contrast.
"""

from __future__ import annotations

from typing import Any

from probe.app.execute import Inputs
from probe.app.plan import Plan


def copy_losses(logits, input_ids, start: int, n: int) -> tuple[float, float]:
    """Mean next-token cross-entropy (nats) over each copy of repeated sequences.

    Parameters
    ----------
    logits : torch.Tensor
        ``[batch, pos, vocab]``, the model's predictions.
    input_ids : torch.Tensor
        ``[batch, pos]``: ``start`` special tokens, ``n`` random tokens, the same ``n`` again.
    start, n : the first copy's position and length

    Returns
    -------
    (summed loss on the first copy, summed loss on the second), over every row's ``n`` tokens.
    The first copy's first token has no earlier context than the specials: it counts too.
    """
    import torch

    log_p = torch.log_softmax(logits.float(), dim=-1)
    # the token at position p is predicted at p - 1
    taken = -log_p[:, :-1].gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # [batch, pos - 1]
    first = taken[:, start - 1 : start - 1 + n]
    second = taken[:, start - 1 + n : start - 1 + 2 * n]
    return float(first.sum()), float(second.sum())


def second_copy_loss(model, tokenizer, inputs: Inputs, plan: Plan) -> dict[str, Any]:
    """The model's mean loss on each copy of the run's repeated sequences (the repeats, not
    their nulls), as the step's ``run.json`` records it under ``loss``."""
    import torch

    from probe.inputs.units.repeats import specials
    from probe.pipeline.loading import main_device

    start, n = len(specials(tokenizer)[0]), plan.options["repeat_length"]
    device = main_device(model)
    sums, count = [0.0, 0.0], 0
    with torch.inference_mode():
        for batch in inputs.units["repeats"][0]:
            repeats = batch.index % 2 == 0  # each repeat's null follows it (index 2s + 1)
            ids = batch.input_ids[repeats].to(device)
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
            first, second = copy_losses(logits, ids, start, n)
            sums[0], sums[1], count = sums[0] + first, sums[1] + second, count + len(ids) * n
    return {"measured_on": f"the second copy of {count // n} repeated sequences of "
                           f"{n} random tokens", "second_copy": sums[1] / count,
            "first_copy": sums[0] / count, "tokens": count}  # fmt: skip
