"""What ``probe.qk_attribution`` costs: time against a forward pass, and memory at Llama-3-8B's
width.

    python benchmarks/qk_attribution.py [--sentences 32] [--threads 1]
    python benchmarks/qk_attribution.py --memory [--layers 4] [--length 64] [--max-bytes 0]

Time: every head of MiniLM (``probe.load("minilm")``) on the first ``--sentences`` sentences of
EWT dev in one padded batch, each query (every token that is not padding) at the key it attends
to most, the ten largest terms of each score kept (``top=10``; every term of 144 heads would be
some hundred million rows). Against one forward pass under ``probe.trace`` (every point
captured) and a plain forward pass; medians of 3 after a warm-up. Goal: at most 3x the traced
forward pass.

Memory (``--memory``): a Llama of hidden size 4096, 32 query heads, 8 key/value heads of 128,
MLP 14336, a 32,000-token vocabulary (random weights, float32) and ``--layers`` layers; one
input of ``--length`` random tokens; every head, each query's most-attended key, ``top=10``.
In a process of its own: the model built, its resident memory read, the peak reset
(``/proc/self/clear_refs``), the call made, the peak read again; "adds" is the peak less the
loaded model.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from _common import ewt_dev, timed

GiB = 1 << 30


def sentences(n: int) -> list[str]:
    """The first ``n`` sentences' text of EWT dev."""
    texts = []
    for line in ewt_dev().read_text(encoding="utf-8").splitlines():
        if line.startswith("# text = "):
            texts.append(line.removeprefix("# text = "))
            if len(texts) == n:
                break
    return texts


def timing(n: int) -> dict:
    import torch

    import probe

    model, tokenizer = probe.load("minilm")
    batch = tokenizer(sentences(n), return_tensors="pt", padding=True)

    def forward():
        with torch.no_grad():
            model(**batch)

    def traced():
        with torch.no_grad(), probe.trace(model):
            model(**batch)

    def split():
        return probe.qk_attribution(model, batch, top=10)

    terms = split()
    plain, trace, qk = timed(forward), timed(traced), timed(split)
    return {
        "sentences": n, "tokens": int(batch["attention_mask"].sum()),
        "padded": list(batch["input_ids"].shape), "rows": len(terms),
        "scores": len(terms.attrs["scores"]), "forward_s": plain, "trace_s": trace,
        "qk_s": qk, "qk_over_trace": qk / trace, "qk_over_forward": qk / plain,
    }  # fmt: skip


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def memory_one(layers: int, length: int, max_bytes: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import probe

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        intermediate_size=14336, vocab_size=32000, num_hidden_layers=layers,
        max_position_embeddings=max(length, 128),
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(3, config.vocab_size, (1, length), generator=torch.Generator())
    with torch.no_grad():
        model(ids)  # the first call's one-off allocations out of the measurement
    loaded = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from here
    start = time.perf_counter()
    budget = {"max_bytes": max_bytes} if max_bytes else {}
    terms = probe.qk_attribution(model, ids, top=10, **budget)
    took = time.perf_counter() - start
    adds = _status("VmHWM") - loaded
    Path("/proc/self/clear_refs").write_text("5")
    with torch.no_grad():
        model(ids)
    forward = _status("VmHWM") - loaded
    return {"layers": layers, "length": length, "max_bytes": terms.attrs["max_bytes"],
            "loaded_gib": loaded / GiB, "adds_gib": adds / GiB, "forward_adds_gib": forward / GiB,
            "seconds": took, "rows": len(terms)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--max-bytes", type=int, default=0)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.memory and args.one:
        print(json.dumps(memory_one(args.layers, args.length, args.max_bytes)))
    elif args.memory:  # a fresh process, so that the peak is the call's
        command = [sys.executable, __file__, "--memory", "--one", "--layers", str(args.layers),
                   "--length", str(args.length), "--max-bytes", str(args.max_bytes),
                   "--threads", str(args.threads)]  # fmt: skip
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        print(json.dumps(json.loads(out.splitlines()[-1]), indent=1))
    else:
        print(json.dumps(timing(args.sentences), indent=1))


if __name__ == "__main__":
    main()
