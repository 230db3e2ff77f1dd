"""``probe.show``: an interactive attention viewer that needs no network.

One self-contained HTML fragment (a ``<div>``, the data and a plain inline script drawing on a
canvas: no CDN, no require.js, no DOM node per token), so it works in Jupyter Lab and Notebook,
VS Code notebooks, Colab and a plain browser. Three views: the head view (lines from each token
to the tokens it attends to), a token x token heatmap, and the model view (every head as a
thumbnail; a click opens it); layer, head and sentence selectors; hovering a token shows only
its own attention.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import numpy as np
import torch

from probe.capture.names import Attention, HookName, parse, point_of
from probe.capture.spec import describe
from probe.errors import ProbeError

FULL_TOKENS = 64  # longer inputs keep each token's TOP_K largest weights
TOP_K = 16
VIEWS = ("head", "heatmap", "both", "model")


@dataclass(frozen=True)
class TopKeys:
    """A long input's attention as each query's ``TOP_K`` largest weights and their keys, found
    a block of query rows at a time (``probe.capture.rows``): no T × T pattern is ever held."""

    weights: np.ndarray  # [layer, head, q_pos, k] float32, largest first
    index: np.ndarray  # [layer, head, q_pos, k]: the keys they fall on

    @property
    def shape(self) -> tuple[int, int, int, int]:
        L, H, T, _ = self.weights.shape
        return L, H, T, T


@dataclass
class View:
    """Attention patterns ready to be shown.

    Attributes
    ----------
    tokens : list of list of str
        Per sentence, its tokens.
    patterns : list of array ``[layer, head, q_pos, k_pos]`` or TopKeys
        Per sentence, float32 attention weights (or, for a long input, each query's largest).
    arcs : list of list of (int, int), optional
        Per sentence, (query, key) token pairs to mark in gold over the attention (a treebank's
        dependency arcs, say).
    captions : list of str, optional
        Per sentence, a line shown under the selectors.
    view : str
        The view shown first: ``"head"``, ``"heatmap"``, ``"both"`` or ``"model"``.
    """

    tokens: list[list[str]]
    patterns: list[np.ndarray | TopKeys]
    arcs: list[list[tuple[int, int]]] | None = None
    captions: list[str] | None = None
    view: str = "head"

    def __post_init__(self) -> None:
        if self.view not in VIEWS:
            raise ValueError(f"unknown view {self.view!r}; use one of {', '.join(VIEWS)}")

    def _repr_html_(self) -> str:
        return self.html()

    def html(self, script: bool = True) -> str:
        """The view as an HTML fragment: its own ``<div>`` with its data and, unless ``script``
        is false (a page that adds ``viewer_script()`` once, after its views), the script."""
        layers, heads = self.patterns[0].shape[:2]
        n = len(self.tokens)
        arcs, captions = self.arcs or [[]] * n, self.captions or [""] * n
        sentences = [
            {**_encode(t, p), "arcs": [[int(q), int(k)] for q, k in a], "caption": c}
            for t, p, a, c in zip(self.tokens, self.patterns, arcs, captions, strict=True)
        ]
        data = {"layers": layers, "heads": heads, "k": TOP_K, "view": self.view,
                "sentences": sentences}  # fmt: skip
        # JSON inside <script>: "<", ">", "&" and "'" escaped, so no token can close the
        # element, and the page holds no text of the data unescaped.
        payload = json.dumps(data)
        for character in "<>&'":
            payload = payload.replace(character, f"\\u{ord(character):04x}")
        return f"""<div class="probe-view" style="--probe-accent:#2f5fd0;\
font:13px system-ui,sans-serif">
<div style="display:flex;gap:8px;align-items:center;flex-wrap:wrap;margin:4px 0">
<select data-role="view" aria-label="view"><option value="head">head view</option>\
<option value="heatmap">heatmap</option><option value="both">head view and heatmap</option>\
<option value="model">model view</option></select>
<select data-role="sentence" aria-label="sentence"></select>
<select data-role="layer" aria-label="layer"></select>
<select data-role="head" aria-label="head"></select>
<button data-role="prev" aria-label="earlier tokens" hidden>◀</button>\
<button data-role="next" aria-label="later tokens" hidden>▶</button>
<span data-role="status" style="opacity:.7"></span></div>
<div data-role="caption"></div>
<div style="overflow:auto;max-height:720px"><canvas data-role="canvas"></canvas></div>
<script type="application/json" class="probe-data">{payload}</script>
{viewer_script() if script else ""}</div>"""

    def save(self, path: str | Path) -> Path:
        """Write the view as a page of its own; returns the path."""
        path = Path(path)
        page = ('<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
                "<title>probe · attention</title></head><body>"
                f"{self.html()}</body></html>\n")  # fmt: skip
        from probe.files import write_file

        return write_file(path, page)


def viewer_script() -> str:
    """The ``<script>`` that starts every view on a page not yet started."""
    return (
        "<script>"
        + files("probe").joinpath("data/show.js").read_text(encoding="utf-8")
        + "</script>"
    )


def _encode(tokens: list[str], pattern: np.ndarray) -> dict:
    """One sentence's weights as bytes: every weight, or each query's TOP_K largest."""
    T = pattern.shape[-1]
    quantised = lambda w: np.clip(np.rint(w * 255), 0, 255).astype(np.uint8)  # noqa: E731
    b64 = lambda a: base64.b64encode(np.ascontiguousarray(a).tobytes()).decode()  # noqa: E731
    if isinstance(pattern, TopKeys):
        return {"tokens": tokens, "T": T, "mode": "top", "weights": b64(quantised(pattern.weights)),
                "index": b64(pattern.index.astype("<u2"))}  # fmt: skip
    if T <= FULL_TOKENS:
        return {"tokens": tokens, "T": T, "mode": "full", "weights": b64(quantised(pattern))}
    index = np.argsort(-pattern, axis=-1, kind="stable")[..., :TOP_K]
    weights = np.take_along_axis(pattern, index, -1)
    return {"tokens": tokens, "T": T, "mode": "top", "weights": b64(quantised(weights)),
            "index": b64(index.astype("<u2"))}  # fmt: skip


def show(source, tokens_or_tokenizer=None, text=None, *, attention: str | None = None) -> View:
    """An interactive view of attention patterns (display it in a notebook, or ``.save()``).

    Two ways to call it:

    - ``probe.show(model, tokenizer, text)``: runs the Hugging Face ``model`` on ``text`` (a
      string, or a list of them: one sentence per entry of the sentence selector) and shows
      every layer and head;
    - ``probe.show(patterns, tokens)``: shows patterns already captured: a ``Cache`` (or any
      mapping of hook names to ``[batch, head, q_pos, k_pos]`` tensors), a tensor
      ``[layer, head, q_pos, k_pos]`` or ``[batch, layer, head, q_pos, k_pos]``, or a list of
      per-layer ``[batch, head, q_pos, k_pos]`` tensors; ``tokens`` is a list of strings, or
      one list per sentence.

    Parameters
    ----------
    attention : str, optional
        Which attention of an encoder-decoder model (``"decoder.cross_attn"``…); by default
        the first (an encoder-decoder model's encoder).

    Returns
    -------
    View
        Shown by ``_repr_html_`` in notebooks; ``.save(path)`` writes a page.
    """
    if isinstance(source, torch.nn.Module):
        return _from_model(source, tokens_or_tokenizer, text, attention)
    if tokens_or_tokenizer is None:
        raise TypeError("probe.show(patterns, tokens) needs the tokens")
    tokens = tokens_or_tokenizer
    batch = [list(tokens)] if tokens and isinstance(tokens[0], str) else [list(t) for t in tokens]
    patterns = _patterns(source, attention)  # [batch, layer, head, q, k]
    if patterns.shape[0] != len(batch):
        raise ValueError(f"{patterns.shape[0]} sentences of patterns but {len(batch)} of tokens")
    views = []
    for sentence, p in zip(batch, patterns, strict=True):
        n = len(sentence)
        if n > p.shape[-1]:
            raise ValueError(f"{n} tokens but patterns over {p.shape[-1]} positions")
        views.append(p[..., :n, :n])  # right padding dropped
    return View([[str(t) for t in s] for s in batch], [np.asarray(v, np.float32) for v in views])


def _patterns(source, attention: str | None) -> np.ndarray:
    """``[batch, layer, head, q, k]`` from a cache, a tensor or a list of layers."""
    if isinstance(source, Mapping):
        names = [n for n in source if point_of(n) == "hook_pattern"]
        layered = [_layered(n) for n in names]  # {stack}.{l}.{attn}.hook_pattern
        if layered and None not in layered:
            chosen = attention or layered[0].attention
            pairs = sorted(zip(layered, names, strict=True), key=lambda pair: pair[0].layer)
            names = [name for parsed, name in pairs if parsed.attention == chosen]
        if not names:
            raise ValueError("no hook_pattern in the cache: trace the model with 'hook_pattern'")
        source = [source[n] for n in names]
    if isinstance(source, Sequence) and not isinstance(source, torch.Tensor):
        source = torch.stack([torch.as_tensor(p) for p in source], 1)
    patterns = torch.as_tensor(source).detach().float().cpu()
    if patterns.dim() == 4:
        patterns = patterns[None]
    if patterns.dim() != 5 or patterns.shape[-1] != patterns.shape[-2]:
        raise ValueError(
            "patterns must be [layer, head, q_pos, k_pos] or [batch, layer, head, q_pos, k_pos]"
        )
    return patterns.numpy()


def _layered(name: str) -> HookName | None:
    """The parts of an attention's point in a layer of a model, else None (a bare attention's
    point, or a module's, named by its path)."""
    try:
        parsed = parse(name)
    except ValueError:
        return None
    return parsed if parsed.attention is not None else None


def _from_model(model, tokenizer, text, attention: str | None) -> View:
    from probe.capture.hookpoints import trace

    if tokenizer is None or text is None:
        raise TypeError("probe.show(model, tokenizer, text) needs the tokenizer and the text")
    texts = [text] if isinstance(text, str) else list(text)
    if attention == Attention.CROSS:
        raise ValueError(
            "probe.show draws self-attention (queries and keys over the same tokens); "
            "cross-attention is in cache['decoder.{l}.cross_attn.hook_pattern']"
        )
    decoder = attention == Attention.DECODER  # the decoder's tokens (cross-attention is refused)
    from probe.inputs.corpus import max_tokens

    device = next(model.parameters()).device
    limit = max_tokens(model.config, tokenizer)
    tokens, patterns = [], []
    for number, one in enumerate(texts):  # one at a time: no padding to remove
        inputs = dict(tokenizer(one, return_tensors="pt").to(device))
        if inputs["input_ids"].shape[1] > limit:
            raise ProbeError(
                f"text {number} is {inputs['input_ids'].shape[1]} tokens long; the model takes at "
                f"most {limit}: show a shorter text"
            )
        if describe(model).encoder_decoder:
            from probe.pipeline.runner import decoder_inputs

            inputs = decoder_inputs(model, inputs)
        if inputs["input_ids"].shape[1] > FULL_TOKENS and attention is None and \
                describe(model).rows_unsupported is None:  # fmt: skip
            patterns.append(top_keys(model, inputs))
        else:
            with torch.no_grad(), trace(model, "hook_pattern") as cache:
                model(**inputs)
            patterns.append(_patterns(cache, attention)[0])
        ids = inputs["decoder_input_ids" if decoder else "input_ids"][0]  # what the positions hold
        tokens.append(tokenizer.convert_ids_to_tokens(ids.tolist()))
    return View(tokens, patterns)


def top_keys(model, inputs: dict, k: int = TOP_K, budget: int = 2**28) -> TopKeys:
    """Each query's ``k`` largest weights in every layer and head of one input (a batch of 1),
    computed in blocks of query rows within ``budget`` bytes beside the model's sdpa kernel."""
    from probe.capture.rows import scored

    found: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def receive(layer: int, what) -> None:
        H, T = what.query.shape[1], what.query.shape[2]
        weights, index = torch.zeros(H, T, k), torch.zeros(H, T, k, dtype=torch.long)
        for block in what.blocks(budget):
            w, i = block.pattern[0].topk(min(k, block.pattern.shape[-1]), dim=-1)
            weights[:, block.rows, : w.shape[-1]] = w.cpu()
            index[:, block.rows, : w.shape[-1]] = i.cpu() + block.keys.start
        found[layer] = weights, index

    with torch.inference_mode(), scored(model, receive):
        model(**inputs)
    layers = [found[layer] for layer in sorted(found)]
    return TopKeys(torch.stack([w for w, _ in layers]).numpy(),
                   torch.stack([i for _, i in layers]).numpy())  # fmt: skip
