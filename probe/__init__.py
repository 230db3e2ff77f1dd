"""probe: what does each attention head do?

>>> import probe
>>> model, tokenizer = probe.load("minilm")
>>> with probe.trace(model, ["hook_pattern"]) as cache:
...     model(**tokenizer("The cat sat.", return_tensors="pt"))
>>> cache["blocks.0.attn.hook_pattern"].shape  # [batch, head, q_pos, k_pos]

Names are imported on first use, so ``import probe`` (and the ``probe`` command's start-up)
does not pay for torch and transformers until they are needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS = {
    "ablate": "probe.interventions.ablation",
    "attribute": "probe.interventions.attribution",
    "head_means": "probe.interventions.ablation",
    "HeadWeights": "probe.capture.head_weights",
    "head_weights": "probe.capture.head_weights",
    "MultiHeadAttention": "probe.attention",
    "spectra": "probe.weights.spectra",
    "composition_scores": "probe.weights.composition",
    "copying_scores": "probe.weights.copying",
    "circuit": "probe.interventions.circuit",
    "edges": "probe.interventions.edge_scores",
    "ProbeError": "probe.errors",
    "HeadId": "probe.heads",
    "head_types": "probe.patterns.headtypes",
    "Cache": "probe.capture.hookpoints",
    "Hook": "probe.capture.hookpoints",
    "HookPoint": "probe.capture.hookpoints",
    "hooks": "probe.capture.hookpoints",
    "trace": "probe.capture.hookpoints",
    "load": "probe.pipeline.loading",
    "attention_rows": "probe.patterns.long_context",
    "head_statistics": "probe.patterns.long_context",
    "patch": "probe.interventions.patching",
    "qk_attribution": "probe.interventions.qk",
    "qk_means": "probe.interventions.qk_table",
    "show": "probe.patterns.viewer",
    "View": "probe.patterns.viewer",
}

__all__ = [
    "Cache",
    "HeadId",
    "HeadWeights",
    "Hook",
    "HookPoint",
    "MultiHeadAttention",
    "ProbeError",
    "View",
    "__version__",
    "ablate",
    "attention_rows",
    "attribute",
    "circuit",
    "composition_scores",
    "copying_scores",
    "edges",
    "head_means",
    "head_statistics",
    "head_types",
    "head_weights",
    "hooks",
    "load",
    "patch",
    "qk_attribution",
    "qk_means",
    "show",
    "spectra",
    "trace",
]


def __getattr__(name: str):
    if name not in _EXPORTS:
        # ``probe.plot`` is a module of the app's (it reads report folders and draws what the
        # analyses declare), so the library does not import it: ``from probe import plot`` does.
        hint = "; import the notebook figures as: from probe import plot" if name == "plot" else ""
        raise AttributeError(f"module 'probe' has no attribute {name!r}{hint}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if TYPE_CHECKING:
    from probe.attention import MultiHeadAttention
    from probe.errors import ProbeError
    from probe.heads import HeadId
    from probe.interventions.ablation import ablate, head_means
    from probe.interventions.attribution import attribute
    from probe.interventions.circuit import circuit
    from probe.interventions.edge_scores import edges
    from probe.interventions.patching import patch
    from probe.interventions.qk import qk_attribution
    from probe.interventions.qk_table import qk_means
    from probe.patterns.headtypes import head_types
    from probe.patterns.long_context import attention_rows, head_statistics
    from probe.patterns.viewer import View, show
    from probe.pipeline.loading import load
    from probe.weights.composition import composition_scores
    from probe.weights.copying import copying_scores
    from probe.weights.spectra import spectra
