"""What edge attribution adds to a loaded model's memory, at Llama-3-8B's width.

    python benchmarks/circuit_memory.py [--layers 2 4] [--kv-heads 8] [--pairs 4] [--length 64]
        [--only floor eap eap-ig] [--max-bytes 1073741824] [--threads 1]

A Llama of hidden size 4096, 32 query heads, ``--kv-heads`` key/value heads, MLP 14336 and a
32,000-token vocabulary (random weights, float32), at each ``--layers``; ``--pairs`` random pairs
of ``--length`` tokens, the corrupted copy's second quarter redrawn; metric: the log-probability
of the last token at the position before it. Each measurement runs in a process of its own:
the model is built, its resident memory read, the peak reset (``/proc/self/clear_refs``), the
call made, and the peak read again; "adds" is the peak less the loaded model's memory.

- floor: a forward pass of the corrupted pairs (no gradient) and a forward and backward pass of
  the metric on the clean pairs, the gradient taken at the embeddings;
- eap, eap-ig: ``probe.edges`` with that method (EAP-IG's 5 steps) and ``--max-bytes`` (0: no
  such argument, as probe before it had one).

Goals at 4 layers: EAP adds under 2 GiB; what it adds grows at most 1.3x from 2 to 4 layers;
and its peak is at most 2.5x the floor's (adds against adds).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import _common  # noqa: F401  (sets the offline environment before transformers)

GiB = 1 << 30


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(what: str, layers: int, kv_heads: int, pairs: int, length: int, max_bytes: int):
    """One measurement in this process: a dict of bytes and seconds."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import probe

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=kv_heads,
        intermediate_size=14336, vocab_size=32000, num_hidden_layers=layers,
        max_position_embeddings=max(length, 128),
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, config.vocab_size, (pairs, length), generator=g)
    other = ids.clone()
    middle = slice(length // 4, length // 2)
    other[:, middle] = torch.randint(3, config.vocab_size, other[:, middle].shape, generator=g)
    clean, corrupted = {"input_ids": ids}, {"input_ids": other}
    answer = ids[:, -1]

    def metric(logits):
        logp = torch.log_softmax(logits[:, -2].float(), dim=-1)
        return logp[torch.arange(len(logp)), answer]

    loaded = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from here
    start = time.perf_counter()
    if what == "floor":
        with torch.no_grad():
            model(**corrupted)
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        total = metric(model(inputs_embeds=embeds).logits).sum()
        torch.autograd.grad(total, [embeds])
        chunks = None
    else:
        budget = {"max_bytes": max_bytes} if max_bytes else {}  # 0: the call as it is
        scores = probe.edges(model, clean, corrupted, metric, method=what, **budget)
        chunks = scores.attrs.get("chunks")
    took = time.perf_counter() - start
    peak = _status("VmHWM")
    return {"what": what, "layers": layers, "kv_heads": kv_heads, "loaded": loaded,
            "adds": peak - loaded, "seconds": took, "chunks": chunks}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--only", nargs="+", default=["floor", "eap", "eap-ig"])
    parser.add_argument("--max-bytes", type=int, default=GiB)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child's measurement, as JSON
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.one:
        what, layers = args.one.split(":")
        found = measure(what, int(layers), args.kv_heads, args.pairs, args.length, args.max_bytes)
        print(json.dumps(found))
        return
    print(f"Llama-3-8B width, {args.kv_heads} key/value heads, {args.pairs} pairs x "
          f"{args.length} tokens, max_bytes {args.max_bytes / GiB:g} GiB, "
          f"{args.threads} thread(s)")  # fmt: skip
    results = {}
    for layers in args.layers:
        for what in args.only:
            command = [sys.executable, __file__, "--one", f"{what}:{layers}",
                       "--kv-heads", str(args.kv_heads), "--pairs", str(args.pairs),
                       "--length", str(args.length), "--max-bytes", str(args.max_bytes),
                       "--threads", str(args.threads)]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode:
                print(f"  {what} at {layers} layers failed:\n{done.stderr[-2000:]}")
                continue
            r = json.loads(done.stdout.strip().splitlines()[-1])
            results[what, layers] = r
            print(f"  {layers} layers, {what}: model {r['loaded'] / GiB:.2f} GiB, adds "
                  f"{r['adds'] / GiB:.2f} GiB, {r['seconds']:.1f} s"
                  + (f", {r['chunks']} chunks" if r["chunks"] else ""), flush=True)  # fmt: skip
    for what in [w for w in args.only if w != "floor"]:
        for layers in args.layers:
            r, f = results.get((what, layers)), results.get(("floor", layers))
            if r and f:
                print(f"  {what} at {layers} layers: {r['adds'] / f['adds']:.2f}x the floor's "
                      f"addition, peak {(r['loaded'] + r['adds']) / (f['loaded'] + f['adds']):.2f}"
                      "x the floor's peak")  # fmt: skip
        ends = [results.get((what, n)) for n in (min(args.layers), max(args.layers))]
        if all(ends) and len(args.layers) > 1:
            print(f"  {what}: adds {ends[1]['adds'] / ends[0]['adds']:.2f}x from "
                  f"{min(args.layers)} to {max(args.layers)} layers")  # fmt: skip


if __name__ == "__main__":
    main()
