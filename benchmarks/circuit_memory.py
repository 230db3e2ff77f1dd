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

    python benchmarks/circuit_memory.py --sweep 16 64 256 [--max-bytes 67108864] [--unbounded]
    python benchmarks/circuit_memory.py --analysis 16 256 4096 [--max-bytes 8388608]

``--sweep``: what the circuit analysis's library calls add (``probe.attribute`` AtP,
``probe.patch`` of every head, ``probe.edges`` EAP-IG and ``probe.circuit``), one after the
other in one process, as the number of pairs grows, at a fixed ``--max-bytes`` (``--unbounded``:
64 GiB as well, every pair at once), on a GPT-2 of width 256, 4 heads, 2 layers and a
vocabulary of 8,192 (random weights), pairs of ``--length`` tokens. Goal: flat in the pairs
(what 256 pairs add at most 1.2x what 16 add), where every pair at once grows with them.
``--analysis``: the peak resident memory of ``probe analyze -a circuit --task FILE --lm-head``
on tests/data/induction-gpt2 with ``--circuit-max-bytes``, a task file of that many pairs (20
random tokens, then the first 19 again; corrupted: 20 fresh ones first; the answer the 20th).
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


def sweep_one(pairs: int, length: int, max_bytes: int) -> dict:
    """The circuit analysis's library calls on ``pairs`` pairs in this process: bytes added."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import probe

    torch.manual_seed(0)
    config = GPT2Config(n_embd=256, n_head=4, n_layer=2, vocab_size=8192, n_positions=128)
    model = GPT2LMHeadModel(config).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, config.vocab_size, (pairs, length), generator=g)
    other = ids.clone()
    middle = slice(length // 4, length // 2)
    other[:, middle] = torch.randint(3, config.vocab_size, other[:, middle].shape, generator=g)
    clean, corrupted = {"input_ids": ids}, {"input_ids": other}

    def metric(logits, pairs):  # the pairs it is given
        logp = torch.log_softmax(logits[:, -2].float(), dim=-1)
        return logp[torch.arange(len(logp)), ids[pairs, -1]]

    loaded = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    start = time.perf_counter()
    budget = {"max_bytes": max_bytes}
    probe.attribute(model, clean, corrupted, metric, "atp", **budget)
    probe.patch(model, clean, corrupted, metric, **budget)
    scores = probe.edges(model, clean, corrupted, metric, "eap-ig", 5, **budget)
    probe.circuit(model, clean, corrupted, metric, 0.8, scores=scores, **budget)
    took = time.perf_counter() - start
    return {"pairs": pairs, "loaded": loaded, "adds": _status("VmHWM") - loaded,
            "seconds": took, "chunks": scores.attrs["chunks"]}  # fmt: skip


def analysis_one(pairs: int, max_bytes: int) -> dict:
    """``probe analyze -a circuit`` on a task file of ``pairs`` pairs, in a child process of
    this one (its only one): its peak resident memory."""
    import random
    import resource
    import tempfile

    root = Path(__file__).resolve().parent.parent
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as folder:
        task = Path(folder) / "task.jsonl"
        with task.open("w") as out:
            for _ in range(pairs):
                first = [rng.randrange(1, 64) for _ in range(20)]
                fresh = [rng.randrange(1, 64) for _ in range(20)]
                words = lambda ts: " ".join(f"t{t}" for t in ts)  # noqa: E731
                out.write(json.dumps({"clean": words(first + first[:-1]),
                                      "corrupted": words(fresh + first[:-1]),
                                      "answer": f"t{first[-1]}"}) + "\n")  # fmt: skip
        command = [sys.executable, "-m", "probe.app.cli", "analyze", "--model",
                   str(root / "tests/data/induction-gpt2"), "-a", "circuit", "--lm-head",
                   "--task", str(task), "--circuit-pairs", str(pairs), "--circuit-max-bytes",
                   str(max_bytes), "--out", str(Path(folder) / "report")]  # fmt: skip
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=root)
        took = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:] or done.stdout[-2000:])
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return {"pairs": pairs, "peak": peak, "seconds": took}


def _child(flag: str, value: str, args) -> dict | None:
    command = [sys.executable, __file__, flag, value, "--length", str(args.length),
               "--threads", str(args.threads)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        print(f"  {value} failed:\n{done.stderr[-2000:]}")
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def sweeps(args) -> None:
    """``--sweep`` and ``--analysis``: each count in a process of its own."""
    budgets = [args.max_bytes] + ([64 * GiB] if args.unbounded else [])
    for budget in budgets if args.sweep else []:
        print(f"library calls, GPT-2 width 256, {args.length} tokens, max_bytes "
              f"{budget / 2**20:g} MiB, {args.threads} thread(s)")  # fmt: skip
        for pairs in args.sweep:
            r = _child("--one-sweep", f"{pairs}:{budget}", args)
            if r:
                print(f"  {pairs} pairs: adds {r['adds'] / 2**20:.0f} MiB, {r['seconds']:.1f} s, "
                      f"edges in {r['chunks']} chunks", flush=True)  # fmt: skip
    if args.analysis:
        print(f"probe analyze -a circuit --task on induction-gpt2, --circuit-max-bytes "
              f"{args.max_bytes / 2**20:g} MiB")  # fmt: skip
        for pairs in args.analysis:
            r = _child("--one-analysis", f"{pairs}:{args.max_bytes}", args)
            if r:
                print(f"  {pairs} pairs: peak {r['peak'] / 2**20:.0f} MiB, {r['seconds']:.1f} s",
                      flush=True)  # fmt: skip


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
    parser.add_argument("--sweep", type=int, nargs="+")
    parser.add_argument("--unbounded", action="store_true")
    parser.add_argument("--analysis", type=int, nargs="+")
    parser.add_argument("--one-sweep", help=argparse.SUPPRESS)
    parser.add_argument("--one-analysis", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_analysis:
        pairs, budget = map(int, args.one_analysis.split(":"))
        print(json.dumps(analysis_one(pairs, budget)))
        return
    import torch

    torch.set_num_threads(args.threads)
    if args.one_sweep:
        pairs, budget = map(int, args.one_sweep.split(":"))
        print(json.dumps(sweep_one(pairs, args.length, budget)))
        return
    if args.sweep or args.analysis:
        sweeps(args)
        return
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
