"""One forward and one backward pass over prompt pairs: the metric per pair, and its gradient at
chosen hook points, with the run's start interpolated between the corrupted and the clean input.

Attribution (``probe.attribute``) and edges (``probe.edges``) both need ∂metric/∂activation at
many points of one run. The run starts from a leaf made here, so that the user's model is left
as it is (no parameter gradients are computed or stored): for a Hugging Face model the input of
the first block (``blocks.0.hook_resid_pre``: the embeddings, where both inputs share their
positions), for probe's own modules the floating-point inputs. Integrated gradients run several
interpolations between the two in one pass, as copies stacked along the batch. A linear LM
head's backward multiplies only the rows of the logits that the metric's gradient reaches.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from probe.capture.hookpoints import Hook, hook_points, hooks, trace
from probe.capture.names import hook_name
from probe.capture.spec import describe
from probe.errors import ProbeError
from probe.interventions.pairs import SCALAR, Metric, copies_of, read, same_form, stacked
from probe.options import MAX_BYTES

START = hook_name("hook_resid_pre", 0)
# MAX_BYTES (probe.options, where the command line, which imports no torch, reads it too): what
# patching, attribution, edges and edge patching may hold at once (``max_bytes``) where the
# memory free on the model's device cannot be read (``memory_budget``). Their runs take as many
# pairs at a time as it holds (``run_bytes``), and what they compute from the runs a chunk at a
# time within it.
FREE_SHARE = 0.5  # of the memory free on the device when a call starts: its default budget


def memory_budget(model: nn.Module, max_bytes: int | None) -> int:
    """A call's memory budget: ``max_bytes`` where given; by default ``FREE_SHARE`` of the memory
    free on the device of the model's first parameter when the call starts (a GPU's free and
    cached memory, a CPU's MemAvailable), or ``MAX_BYTES`` where that cannot be read. So a
    TransformerLens script whose metric cannot be split (``metric(logits)``, a scalar) runs
    unchanged wherever its pairs fit the machine, and is refused in one line where they do not,
    rather than run out of memory."""
    if max_bytes is not None:
        return check_budget(max_bytes)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    free = free_bytes(device)
    return MAX_BYTES if free is None else int(free * FREE_SHARE)


def check_budget(max_bytes: Any) -> int:
    """``max_bytes`` as a whole number of bytes, checked.

    Raises
    ------
    ProbeError
        For what is not a positive, finite number of bytes (NaN, inf, a string, 0).
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, numbers.Real):
        raise ProbeError(f"max_bytes must be a number of bytes (e.g. 2**30), not {max_bytes!r}")
    if not math.isfinite(max_bytes) or max_bytes < 1:
        raise ProbeError(f"max_bytes must be a positive, finite number of bytes, not {max_bytes!r}")
    return int(max_bytes)


def free_bytes(device: torch.device) -> int | None:
    """The memory free on ``device`` now, in bytes, or None where it cannot be read."""
    try:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
            return int(free + cached)
        if device.type == "cpu":
            with open("/proc/meminfo", encoding="ascii") as info:
                for line in info:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
    except (OSError, RuntimeError, ValueError, IndexError):
        return None
    return None


def run_bytes(model: nn.Module, inputs: Mapping[str, Any], pairs: int, *, backward: bool) -> int:
    """An estimate of what one pair adds to a run of ``model`` on ``inputs`` (``pairs`` pairs):
    a forward pass (no gradient: a layer's activations at a time, and the logits with their
    log-softmax) or a forward and backward pass (every layer's activations kept for the
    backward pass, and the logits' gradient).

    Per position of a Hugging Face model, in its parameters' bytes: a layer's activations 12
    d_model + 3 d_mlp + 3 heads x positions (the attention scores, pattern and its gradient)
    and the logits 3 vocab (4 with a backward pass). Probe's own modules (no config): 32 copies
    of the pair's floating-point inputs for each hook point.
    """
    size = next((p.element_size() for p in model.parameters()), 4)
    floating = [v for v in inputs.values() if isinstance(v, torch.Tensor) and v.dim()]
    config = getattr(model, "config", None)
    try:
        spec = describe(model) if config is not None else None
    except ProbeError:  # a module of probe's own, or one probe cannot describe
        spec = None
    if spec is None:
        with hook_points(model) as points:
            count = max(1, len(points))
        per = sum(v[0].numel() * max(v.element_size(), size) for v in floating if len(v) == pairs)
        return 32 * count * max(per, 1)
    positions = max((v.shape[1] for v in floating if v.dim() > 1), default=1)
    d = spec.d_model
    mlp = int(getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
              or 4 * d)  # fmt: skip
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    vocab = spec.d_vocab if head is not None else 0
    layer = 12 * d + 3 * mlp + 3 * spec.n_heads * positions
    per_position = spec.n_layers * layer + 4 * vocab if backward else layer + 3 * vocab
    return size * positions * per_position


def start_point(model: nn.Module) -> str | None:
    """Where runs start: the first block's input of a Hugging Face model, else None."""
    with hook_points(model) as points:
        return START if START in points else None


def clean_start(model: nn.Module, clean: Mapping[str, Any], cache: Mapping[str, Any]) -> Any:
    """The clean run's start: its tensor at ``START`` from ``cache`` (a trace of the clean run
    that included ``start_point(model)``), or the clean inputs themselves."""
    return clean if start_point(model) is None else cache[START]


class _ReadRows(torch.autograd.Function):
    """A linear LM head's logits, passed on as they are, whose backward multiplies only the
    rows (positions) where the gradient is not zero: a metric that reads the logits of a few
    positions then costs no product over the vocabulary at every other one. Exact: a row of
    zeros adds exactly zero to the head's input's gradient."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, logits: torch.Tensor):
        ctx.save_for_backward(weight)
        return logits

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        flat = grad.flatten(0, -2)
        rows = flat.any(-1).nonzero().squeeze(-1)  # one pass, no mask of the whole
        out = flat.new_zeros(len(flat), weight.shape[1])
        out[rows] = flat[rows] @ weight.to(flat.dtype)
        return out.view(*grad.shape[:-1], -1), None, None


def _read_rows(module: nn.Module, inputs: tuple, logits: Any) -> torch.Tensor | None:
    if not inputs or not isinstance(logits, torch.Tensor):  # called by keyword: as it is
        return None
    return _ReadRows.apply(inputs[0], module.weight.detach(), logits.detach())


def _with_clean_copy(
    corrupted: Mapping[str, Any], clean: Mapping[str, Any], copies: int, pairs: int, own: int
) -> dict[str, Any]:
    """The corrupted inputs stacked ``copies`` times, copy ``own``'s rows the clean inputs."""
    inputs = stacked(corrupted, copies, pairs)
    for key, value in clean.items():
        if isinstance(value, torch.Tensor) and value.dim() and len(value) == pairs:
            inputs[key] = inputs[key].clone()
            inputs[key][own * pairs : (own + 1) * pairs] = value
    return inputs


def _objective(values: list[torch.Tensor], pairs: int) -> torch.Tensor:
    """What the gradient is taken of: the copies' metrics summed over pairs and copies, a scalar
    metric's times ``pairs`` (see ``metric_gradients``)."""
    total = torch.stack(values).sum()
    return total * pairs if same_form(values, pairs) == SCALAR else total


def check_grad_mode() -> None:
    """Refuse to take gradients inside ``torch.inference_mode()``: ``enable_grad`` cannot undo
    it, and the metric would be blamed for a value without one.

    Raises
    ------
    ProbeError
        Saying to call outside the block.
    """
    if torch.is_inference_mode_enabled():
        raise ProbeError(
            "this call takes gradients, which torch.inference_mode() turns off: call it outside "
            "the inference_mode block (torch.no_grad() is fine)"
        )


def metric_gradients(
    model: nn.Module,
    corrupted: Mapping[str, Any],
    metric: Metric,
    pairs: int,
    names: Sequence[str],
    start: Any,
    alphas: Sequence[float] = (0.0,),
    keep: Sequence[str] = (),
    clean: Mapping[str, Any] | None = None,
    rows: slice | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Run the pairs from ``corrupted + α (clean - corrupted)`` at the start, for each α (stacked
    copies), and take the gradient of the metric summed over pairs and copies.

    A scalar metric (``probe.interventions.pairs``) is the whole batch's: its gradient is taken
    times ``pairs``, so that the mean over pairs of each pair's (Δa · gradient) is the
    linearised change of the scalar, and equals the per-pair form's mean where the scalar is
    the mean of per-pair values.

    ``start`` is the clean run's start (``clean_start``); the corrupted one is this run's own.
    Or, for a Hugging Face model whose ``alphas`` hold 1 and another, ``start`` None and the
    ``clean`` inputs: the copy at α = 1 runs them, and its start is the clean start (so that
    the clean run needs no pass of its own; its ``kept`` points are the clean run's).
    ``rows``: the batch's pairs these are (``pairs.read``).

    Returns
    -------
    values : ``[copies, pairs]`` float (``[copies, 1]`` for a scalar metric)
        The metric of each copy.
    grads : dict
        Hook name -> ∂metric/∂activation, ``[copies, pairs, ...]`` (the pairs' rows of the
        point's tensor per copy).
    kept : dict
        Hook name -> activation (detached), ``[copies, pairs, ...]``, for the names in ``keep``.
    """
    check_grad_mode()
    copies = len(alphas)
    alpha = torch.tensor(list(alphas), dtype=torch.float32)
    clean_start = start
    grads: dict[str, torch.Tensor] = {}
    leaves: list[torch.Tensor] = []

    def mix(c: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        a = alpha.to(x.device, x.dtype).view(copies, *(1,) * x.dim())
        # lerp: exactly x at α = 0 and exactly c at α = 1.
        mixed = torch.lerp(x.unsqueeze(0), c.unsqueeze(0), a).flatten(0, 1)
        leaf = mixed.detach().requires_grad_(True)
        leaves.append(leaf)
        return leaf

    def collect(grad: torch.Tensor, hook: Hook) -> None:
        name = str(hook)
        grads[name] = grad.detach() if name not in grads else grads[name] + grad.detach()

    with torch.enable_grad():
        if clean is not None:  # the copy at α = 1 is the clean run, which gives the start
            own, other = list(alphas).index(1.0), next(i for i, a in enumerate(alphas) if a != 1)

            def begin(x: torch.Tensor, hook: Hook) -> torch.Tensor:
                rows = x.unflatten(0, (copies, pairs))
                return mix(rows[own], rows[other])

            inputs = _with_clean_copy(corrupted, clean, copies, pairs, own)
            forward = [(START, begin)]
        elif isinstance(clean_start, torch.Tensor):  # a Hugging Face model's first block's input

            def begin(x: torch.Tensor, hook: Hook) -> torch.Tensor:
                return mix(clean_start, x[:pairs])  # every copy's rows start alike

            inputs = stacked(corrupted, copies, pairs)
            forward = [(START, begin)]
        else:  # probe's own modules: their floating-point inputs
            inputs = stacked(corrupted, copies, pairs)
            for key, value in corrupted.items():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    inputs[key] = mix(clean_start[key], value)
            forward = []
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        with (
            trace(model, list(keep)) as cache,
            hooks(model, forward, backward=dict.fromkeys(names, collect)),
            contextlib.ExitStack() as stack,
        ):
            if type(head) is nn.Linear:  # the rows it reads (below the model's own hooks)
                stack.callback(head.register_forward_hook(_read_rows, prepend=True).remove)
            output = model(**inputs)
            values = [
                read(metric, seen, pairs, differentiable=True, rows=rows)
                for seen in copies_of(output, copies, pairs)
            ]
            torch.autograd.grad(_objective(values, pairs), leaves, allow_unused=True)
    split = {name: g.unflatten(0, (copies, pairs)) for name, g in grads.items()}
    kept = {name: cache[name].unflatten(0, (copies, pairs)) for name in keep}
    return torch.stack(values).detach(), split, kept
