"""What ``probe.trace`` captures: tensors by hook name, with TransformerLens's conveniences.

``cache["pattern", 0]`` and ``cache["q", 1, "attn"]`` name points as TransformerLens's
``ActivationCache`` does (``probe.capture.names.act_name``); ``accumulated_resid``,
``decompose_resid``,
``stack_head_results``, ``apply_ln_to_stack`` and ``logit_attrs`` decompose the residual stream
as its methods of the same names do, from the captured points and the traced model's norms and
unembedding. Components are stacked on a new first axis: ``[component, batch, pos, d_model]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from probe.capture.names import Attention, HookName, act_name, parse, point_of, unknown
from probe.errors import ProbeError

# A position selection, as TransformerLens's Slice takes it: None (all), an int (that position,
# its axis dropped), a (start, stop[, step]) tuple, or a list or tensor of indices.
PosSlice = None | int | tuple[int, ...] | Sequence[int] | torch.Tensor | slice


def sliced(x: torch.Tensor, pos_slice: PosSlice, dim: int = -2) -> torch.Tensor:
    """``x`` at the positions ``pos_slice`` (see ``PosSlice``) along ``dim``."""
    if pos_slice is None:
        return x
    if isinstance(pos_slice, int):
        return x.select(dim, pos_slice)
    if isinstance(pos_slice, tuple):
        pos_slice = slice(*pos_slice)
    if isinstance(pos_slice, slice):
        index = [slice(None)] * x.dim()
        index[dim] = pos_slice
        return x[tuple(index)]
    return x.index_select(dim, torch.as_tensor(pos_slice, device=x.device))


def _missing(name: str, captured: Sequence[str]) -> str:
    """One line for a name the cache does not hold: a probe point that was not captured (with
    what was), or a misspelt one (with the nearest names, ``names.unknown``)."""
    points = sorted({point_of(n) for n in captured})
    held = f"it holds {', '.join(points)}" if points else "it is empty (the model did not run?)"
    try:
        parse(name)
    except ValueError:  # not a name probe gives: misspelt
        return unknown(name, captured) + ("" if captured else f"; {held}")
    if point_of(name) in points:  # captured, at other layers or attentions
        return f"{name} was not captured: {held}, at {', '.join(_sites(captured, name))}"
    return (f"{name} was not captured: {held}; name its point in probe.trace(model, names), or "
            "leave names out for every point")  # fmt: skip


def _sites(captured: Sequence[str], name: str) -> list[str]:
    """Where the cache holds ``name``'s point: its full names (the first four, then a count)."""
    same = [n for n in captured if point_of(n) == point_of(name)]
    return same[:4] + ([f"{len(same) - 4} more"] if len(same) > 4 else [])


class Cache(dict):
    """Captured tensors by hook name, e.g. ``cache["blocks.0.attn.hook_pattern"]``, or as
    TransformerLens writes it, ``cache["pattern", 0]``; ``model`` is the traced model (the
    residual-stream methods need its norms and unembedding)."""

    def __init__(self, *args, model: nn.Module | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.model = model

    def __getitem__(self, key):
        if isinstance(key, tuple):
            name, layer, *part = (*key, None) if len(key) == 1 else key
            if layer is not None and layer < 0:
                layer += self.n_layers
            key = act_name(name, layer, *part)
        elif not dict.__contains__(self, key) and isinstance(key, str):
            key = act_name(key)
        try:
            return super().__getitem__(key)
        except KeyError:
            if not isinstance(key, str):
                raise
            raise KeyError(_missing(key, self)) from None

    @property
    def n_layers(self) -> int:
        """Layers of the traced model's stack (encoder-only and decoder-only models)."""
        return len(self._blocks())

    def stack(self, suffix: str, dim: int = 0, *, attention: str | None = None) -> torch.Tensor:
        """Stack one hook point over layers: ``cache.stack("hook_pattern")`` is ``[layer, ...]``.

        Parameters
        ----------
        suffix : str
            The hook's short name, e.g. ``"hook_z"`` (``"ln1.hook_scale"`` for a block part's).
        dim : int
            Where the layer dimension goes (``dim=1`` gives ``[batch, layer, ...]``).
        attention : str, optional
            Whose layers, where the cache holds several attentions (an encoder-decoder model):
            ``"encoder.attn"``, ``"decoder.attn"`` or ``"decoder.cross_attn"``; for the
            residual stream's points, the stack (``"encoder"``, or an attention of it).

        Returns
        -------
        torch.Tensor
            The captured tensors of every layer that has it, in layer order, e.g.
            ``[layer, batch, head, q_pos, k_pos]`` for ``hook_pattern``.

        Raises
        ------
        KeyError
            When no captured point (of ``attention``) is ``suffix``.
        ProbeError
            When the points are of several attentions or stacks and ``attention`` is not given:
            their layers would be stacked together.
        """
        names = [name for name in self if point_of(name) == suffix]
        if not names:
            raise KeyError(f"no captured hook is {suffix!r}; captured: {sorted(self)}")
        # Names that are not probe's (modules at other paths) keep the order they ran in.
        parsed = {name: _parsed(name) for name in names}
        sites = list(dict.fromkeys(str(p.site) for p in parsed.values() if p.site))
        if attention is not None:
            names = [n for n in names if _belongs(parsed[n], attention)]
            if not names:
                raise KeyError(f"no captured {suffix} of {attention!r}; captured: {sites}")
        elif len(sites) > 1:
            raise ProbeError(
                f"cache.stack({suffix!r}) would stack the layers of {', '.join(sites)} together; "
                f"name one, e.g. cache.stack({suffix!r}, attention={sites[-1]!r})"
            )
        names.sort(key=lambda n: parsed[n].layer or 0)
        return torch.stack([self[n] for n in names], dim=dim)

    def accumulated_resid(
        self,
        layer: int | None = None,
        incl_mid: bool = False,
        apply_ln: bool = False,
        pos_slice: PosSlice = None,
        mlp_input: bool = False,
        return_labels: bool = False,
    ):
        """The residual stream as it stands before each layer: ``[component, batch, pos,
        d_model]`` (TransformerLens's method of the same name).

        Parameters
        ----------
        layer : int, optional
            Up to the input of this layer; None or -1 (or n_layers) for every layer and the
            stream after the last (``"final_post"``).
        incl_mid : bool
            Each layer's resid_mid too (after its attention).
        apply_ln : bool
            Normalise as the norm that reads them does (``apply_ln_to_stack``); at the final
            layer each component with its own statistics (a logit lens).
        pos_slice : PosSlice
        mlp_input : bool
            End with resid_mid of ``layer`` (the input of its MLP).
        return_labels : bool
            Also return the labels ``"0_pre"``, ``"0_mid"``…, ``"final_post"``.
        """
        n = self.n_layers
        layer = n if layer is None or layer == -1 else layer
        parts, labels = [], []
        for i in range(min(layer + 1, n)):  # the input of ``layer`` included
            parts.append(self["resid_pre", i])
            labels.append(f"{i}_pre")
            if (incl_mid and i < layer) or (mlp_input and i == layer):
                parts.append(self["resid_mid", i])
                labels.append(f"{i}_mid")
        if layer == n:
            parts.append(self["resid_post", n - 1])
            labels.append("final_post")
        stack = torch.stack([sliced(p, pos_slice) for p in parts])
        if apply_ln:
            recompute = layer == n
            stack = self.apply_ln_to_stack(stack, layer, mlp_input, pos_slice, recompute=recompute)
        return (stack, labels) if return_labels else stack

    def decompose_resid(
        self,
        layer: int | None = None,
        mlp_input: bool = False,
        mode: str = "all",
        apply_ln: bool = False,
        pos_slice: PosSlice = None,
        incl_embeds: bool = True,
        return_labels: bool = False,
    ):
        """The residual stream before ``layer`` as the sum of what wrote to it: the embeddings,
        then each layer's attn_out and mlp_out, ``[component, batch, pos, d_model]``
        (TransformerLens's method of the same name).

        Parameters
        ----------
        layer : int, optional
            Components that write before this layer's input; None or -1 for every layer.
        mlp_input : bool
            Also this layer's attn_out (the stream into its MLP).
        mode : {"all", "attn", "mlp"}
            Which layer outputs.
        apply_ln, pos_slice, return_labels
            As in ``accumulated_resid``; labels ``"embed"``, ``"pos_embed"``, ``"0_attn_out"``…
        incl_embeds : bool
            Begin with hook_embed and hook_pos_embed (where captured).
        """
        layer = self.n_layers if layer is None or layer == -1 else layer
        parts: list[tuple[str, torch.Tensor]] = []
        if incl_embeds:
            parts += [(label, self[label]) for label in ("embed", "pos_embed") if label in self]
        for i in range(layer):
            for kind in ("attn", "mlp"):
                if mode in ("all", kind):
                    parts.append((f"{i}_{kind}_out", self[f"{kind}_out", i]))
        if mlp_input and mode != "mlp":
            parts.append((f"{layer}_attn_out", self["attn_out", layer]))
        stack = torch.stack([sliced(x, pos_slice) for _, x in parts])
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input, pos_slice)
        labels = [label for label, _ in parts]
        return (stack, labels) if return_labels else stack

    def __contains__(self, key) -> bool:
        if dict.__contains__(self, key):
            return True
        try:
            return isinstance(key, str) and dict.__contains__(self, act_name(key))
        except ValueError:
            return False

    def stack_head_results(
        self,
        layer: int = -1,
        return_labels: bool = False,
        incl_remainder: bool = False,
        pos_slice: PosSlice = None,
        apply_ln: bool = False,
    ):
        """Every head's result (its write to the stream) before ``layer``, ``[layer·head,
        batch, pos, d_model]``, labelled ``"L0H0"``… (TransformerLens's method of the name).

        Parameters
        ----------
        layer : int
            Heads of the layers before this one; -1 or None for all.
        incl_remainder : bool
            Append what the heads do not explain: resid_post of ``layer - 1`` minus their sum.
        pos_slice, apply_ln, return_labels
            As in ``accumulated_resid``.
        """
        layer = self.n_layers if layer is None or layer == -1 else layer
        parts, labels = [], []
        for i in range(layer):
            result = sliced(self["result", i, "attn"], pos_slice, dim=-3)  # [..., head, d_model]
            parts.append(result.movedim(-2, 0))
            labels += [f"L{i}H{h}" for h in range(result.shape[-2])]
        # Before layer 0 no head has written: an empty stack of the stream's shape.
        stack = torch.cat(parts) if parts else sliced(self["embed"], pos_slice)[None][:0]
        if incl_remainder:
            total = sliced(self["resid_post", layer - 1], pos_slice)
            stack = torch.cat([stack, (total - stack.sum(0))[None]])
            labels.append("remainder")
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    def apply_ln_to_stack(
        self,
        residual_stack: torch.Tensor,
        layer: int | None = None,
        mlp_input: bool = False,
        pos_slice: PosSlice = None,
        batch_slice: PosSlice = None,
        has_batch_dim: bool = True,
        *,
        recompute: bool = False,
    ) -> torch.Tensor:
        """Components of the stream as the norm that reads them sees them: centred (LayerNorm,
        not RMSNorm) and divided by that norm's captured ``hook_scale``, the one of the whole
        stream (TransformerLens's method of the same name).

        Parameters
        ----------
        residual_stack : torch.Tensor
            ``[component, batch, pos, d_model]`` (positions already sliced by ``pos_slice``).
        layer : int, optional
            The norm of this layer's input (ln1, or ln2 with ``mlp_input``); None, -1 or
            n_layers for the final norm.
        pos_slice, batch_slice : PosSlice
            Applied to the scale (and ``batch_slice`` to the stack's batch axis).
        has_batch_dim : bool
            Whether the stack has a batch axis.
        recompute : bool
            At the final norm, run it on each component with its own statistics, weights
            included (TransformerLens's ``recompute_ln``, its logit lens).
        """
        n = self.n_layers
        final = layer is None or layer in (-1, n)
        if has_batch_dim:
            residual_stack = sliced(residual_stack, batch_slice, dim=1)
        norm = self._norm(None if final else layer, mlp_input)
        if recompute and final:
            from probe.capture.norms import normalise

            model = self._traced()
            return torch.stack([normalise(model, norm, x) for x in residual_stack])
        if isinstance(norm, nn.LayerNorm):
            residual_stack = residual_stack - residual_stack.mean(-1, keepdim=True)
        key = ("scale",) if final else ("scale", layer, "ln2" if mlp_input else "ln1")
        scale = sliced(self[key], pos_slice)
        return residual_stack / (sliced(scale, batch_slice, dim=0) if has_batch_dim else scale)

    def logit_attrs(
        self,
        residual_stack: torch.Tensor,
        tokens: int | torch.Tensor,
        incorrect_tokens: int | torch.Tensor | None = None,
        pos_slice: PosSlice = None,
        batch_slice: PosSlice = None,
        has_batch_dim: bool = True,
    ) -> torch.Tensor:
        """Each component's direct contribution to the logits of ``tokens`` (minus those of
        ``incorrect_tokens``): the component through the final norm's captured scale, dotted
        with the tokens' unembedding directions (TransformerLens's method of the same name).

        Parameters
        ----------
        residual_stack : torch.Tensor
            ``[component, batch, (pos,) d_model]``, e.g. ``decompose_resid(pos_slice=-1)``.
        tokens, incorrect_tokens : int or torch.Tensor
            One token, ``[batch]`` (one per example) or ``[batch, pos]``.
        pos_slice, batch_slice, has_batch_dim
            As in ``apply_ln_to_stack``.

        Returns
        -------
        torch.Tensor
            ``[component, batch, (pos)]``.
        """
        directions = self._directions(tokens)
        if incorrect_tokens is not None:
            if torch.as_tensor(tokens).shape != torch.as_tensor(incorrect_tokens).shape:
                raise ValueError("tokens and incorrect_tokens must have the same shape")
            directions = directions - self._directions(incorrect_tokens)
        scaled = self.apply_ln_to_stack(
            residual_stack, None, pos_slice=pos_slice, batch_slice=batch_slice,
            has_batch_dim=has_batch_dim,
        )  # fmt: skip
        per_example = directions.dim() == 2 and directions.shape[0] == scaled.shape[1]
        if has_batch_dim and scaled.dim() == 4 and per_example:
            directions = directions.unsqueeze(-2)  # one direction per example, every position
        return (scaled * directions).sum(-1)

    def _directions(self, tokens: int | torch.Tensor) -> torch.Tensor:
        unembed = self._traced().get_output_embeddings()
        if unembed is None:
            raise ProbeError("logit_attrs needs a model with its unembedding (an LM head)")
        return unembed.weight[torch.as_tensor(tokens, device=unembed.weight.device)]

    def _traced(self) -> nn.Module:
        if self.model is None:
            raise ProbeError(
                "this cache does not know its model: the residual-stream methods need one traced "
                "with probe.trace(model) from a Hugging Face model"
            )
        return self.model

    def _blocks(self) -> list[nn.Module]:
        from probe.capture.architectures import blocks

        return blocks(self._traced())

    def _norm(self, layer: int | None, mlp_input: bool) -> nn.Module | None:
        """The final norm (layer None), or ln1 / ln2 of a layer."""
        from probe.capture.architectures import architecture, model_part

        if layer is None:
            return model_part(self._traced(), "ln_final")
        arch = architecture(self._traced())
        return self._blocks()[layer].get_submodule(arch.ln2 if mlp_input else arch.ln1)


def _parsed(name: str) -> HookName:
    try:
        return parse(name)
    except ValueError:
        return HookName(point_of(name))


def _belongs(name: HookName, attention: str) -> bool:
    """Whether a point is of ``attention``, or for a residual point, of its stack."""
    if name.attention is not None:
        return name.attention == attention
    stack = Attention(attention).stack if attention in set(Attention) else attention
    return name.stack is not None and name.stack == stack
