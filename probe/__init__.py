"""probe: what does each attention head do?

>>> import probe
>>> model, tokenizer = probe.load("minilm")
>>> with probe.trace(model, ["hook_pattern"]) as cache:
...     model(**tokenizer("The cat sat.", return_tensors="pt"))
>>> cache["blocks.0.attn.hook_pattern"].shape  # [batch, head, q_pos, k_pos]
"""

from probe.ablation import ablate
from probe.architectures import HeadWeights, head_weights
from probe.attention import MultiHeadAttention
from probe.circuits import spectra
from probe.errors import ProbeError
from probe.hooks import Cache, HookPoint, hooks, trace
from probe.loading import load

__version__ = "0.1.0"

__all__ = [
    "Cache",
    "HeadWeights",
    "HookPoint",
    "MultiHeadAttention",
    "ProbeError",
    "__version__",
    "ablate",
    "head_weights",
    "hooks",
    "load",
    "spectra",
    "trace",
]
