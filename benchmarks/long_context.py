"""Memory and time of the roles and taxonomy analyses on one long text, in blocks of query rows.

    python benchmarks/long_context.py [--lengths 4096,8192,16384,32768] [--budget 256MiB]
                                      [--rounds 3] [--d-head 16] [--layers 2]

A random Llama (by default tiny: 2 layers, 4 query heads, 2 key/value heads, d_head 16, RoPE)
reads one text of T tokens: EWT dev's sentences, joined into one sentence of T MiniLM tokens. For
each T, two fresh processes: the floor, the model's plain sdpa forward over the tokens; and the
analysis, the same forward with the roles and taxonomy analyses fed row blocks
(``probe.pipeline.runner.
stream_rows``), alternating with the floor. Each prints its peak resident memory (ru_maxrss);
times are CPU seconds (all threads), the floor's and the analysis's from the same process, the
median of ``--rounds``, with the wall seconds beside them; the load average says how busy a
shared machine was. Each child runs under the threads' wait policy ``probe analyze`` sets for its
length (``probe.pipeline.threads``), floor and analysis alike; ``--busy N`` keeps N processes
spinning
on the cores meanwhile, as other users' jobs would.

Goals (issue #45): at 32k tokens with `-a roles`, the analysis at most 1.5x the floor with heads
64 wide (``--d-head 64 --layers 4 --analyses roles``), idle and with two busy processes
(``--busy 2``); at most 2x idle with heads 16 wide (``--d-head 16 --layers 2``, roles and
taxonomy); peak memory linear in the length. The ratio depends on the head width: sdpa's cost per
query-key pair grows with d_head, while the statistics' cost per pair does not, so the 16-wide
heads are the worst case.

Where the time goes (32k tokens, d_head 16, two layers, two threads, wall seconds of one
analysis, profiled in blocks of 8 MiB a thread): the scores' product 1.4 (sdpa never writes its
scores to memory; the blocks must), the fused kernel's softmax and statistics 3.0
(``probe.capture.fused``: one pass over each block, bound by the memory it reads and writes), the
output's product p · V 0.7, the rest (per-block operations, the model's other layers) about 1;
the floor 3.1. Before the kernel, the softmax, entropy's shift and sum, the two maxima and what
each key receives were a pass over the block each: 3.03x the floor, where it is now 1.66x.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ewt_dev


def long_text(tokens: int, tokenizer, path: Path) -> Path:
    """A CoNLL-U file of one sentence: EWT dev's words, in order (from the start again when they
    run out), as many as fit in ``tokens`` tokens with the special ones; every word attaches to
    the first."""
    words = []
    for line in ewt_dev().read_text(encoding="utf-8").splitlines():
        parts = line.split("\t")
        if len(parts) == 10 and parts[0].isdigit():
            words.append((parts[1], parts[3]))
    words = (words * (tokens // len(words) + 1))[:tokens]  # EWT dev has about 25k words
    lengths = [len(ids) for ids in tokenizer([w for w, _ in words], add_special_tokens=False)
               ["input_ids"]]  # fmt: skip
    total, kept = 2, 0  # [CLS] and [SEP]
    while kept < len(words) and total + lengths[kept] <= tokens:
        total, kept = total + lengths[kept], kept + 1
    rows = [f"{i + 1}\t{w}\t_\t{upos}\t_\t_\t{0 if i == 0 else 1}\t{'root' if i == 0 else 'dep'}"
            "\t_\t_" for i, (w, upos) in enumerate(words[:kept])]  # fmt: skip
    path.write_text("\n".join(rows) + "\n\n", encoding="utf-8")
    return path


def child(
    tokens: int, mode: str, budget: str, rounds: int, d_head: int, layers: int, names: str
) -> dict:
    from probe.pipeline import threads

    threads.settle(tokens)  # as probe analyze does for windows this long, before torch starts
    import torch
    import transformers as tf

    import probe
    from analyses import Context
    from analyses.roles import Roles
    from analyses.taxonomy import Taxonomy
    from probe.inputs.units import Source
    from probe.inputs.units.sentences import Sentences
    from probe.options import parse_size
    from probe.pipeline.runner import stream_rows

    torch.manual_seed(0)
    _, tokenizer = probe.load("minilm")
    config = tf.LlamaConfig(hidden_size=4 * d_head, num_attention_heads=4, num_key_value_heads=2,
                            num_hidden_layers=layers, intermediate_size=8 * d_head,
                            vocab_size=len(tokenizer), max_position_embeddings=tokens)  # fmt: skip
    model = tf.LlamaModel(config).eval()
    with tempfile.TemporaryDirectory() as folder:
        batches = []
        for length in (512, tokens):  # a short warm-up, then the text
            source = Source((long_text(length, tokenizer, Path(folder) / f"{length}.conllu"),))
            batches.append(next(iter(Sentences(source, tokenizer, length).batches(1))))
    context = Context(layers, 4, causal=True, model=model, tokenizer=tokenizer)
    kinds = {"roles": Roles, "taxonomy": Taxonomy}

    def floor(batch) -> None:
        with torch.inference_mode():
            model(**batch.inputs)

    def analysis(batch) -> None:
        consumers = [kinds[name](context) for name in names.split(",")]
        stream_rows(model, [batch], consumers, parse_size(budget))

    # The floor and the analysis alternate in one process and are timed in CPU seconds, so that
    # the other processes on a shared machine slow neither more than the other.
    passes = [floor] if mode == "floor" else [floor, analysis]
    times: dict[str, list[float]] = {n + w: [] for f in passes for n in [f.__name__]
                                     for w in ("", "_wall")}  # fmt: skip
    for f in passes:
        f(batches[0])  # warm-up
    for _ in range(rounds):
        for f in passes:
            start, wall = time.process_time(), time.perf_counter()
            f(batches[1])
            times[f.__name__].append(time.process_time() - start)
            times[f.__name__ + "_wall"].append(time.perf_counter() - wall)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB
    median = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    policy = threads.in_effect()["wait_policy"]
    return {"tokens": batches[1].input_ids.shape[1], "peak_mib": peak, "policy": policy, **median}


def run(tokens: int, mode: str, args: argparse.Namespace) -> dict:
    args = [sys.executable, __file__, "--child", str(tokens), mode, "--budget", args.budget,
            "--rounds", str(args.rounds), "--d-head", str(args.d_head), "--layers",
            str(args.layers), "--analyses", args.analyses]  # fmt: skip
    out = subprocess.run(args, capture_output=True, text=True, env=os.environ)
    if out.returncode:
        sys.exit(f"{mode} at {tokens} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="4096,8192,16384,32768")
    parser.add_argument("--budget", default="256MiB", help="--attention-budget of the analysis")
    parser.add_argument("--rounds", type=int, default=3, help="timed passes of each")
    parser.add_argument("--d-head", type=int, default=16, help="the model's head width")
    parser.add_argument("--layers", type=int, default=2, help="the model's depth")
    parser.add_argument("--analyses", default="roles,taxonomy", help="roles, taxonomy or both")
    parser.add_argument(
        "--busy",
        type=int,
        default=0,
        help="processes spinning on the cores meanwhile, as other users' jobs",
    )
    parser.add_argument("--child", nargs=2, metavar=("TOKENS", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        tokens, mode = int(args.child[0]), args.child[1]
        print(
            json.dumps(
                child(
                    tokens, mode, args.budget, args.rounds, args.d_head, args.layers, args.analyses
                )
            )
        )
        return
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(args.busy)]  # fmt: skip
    try:
        table(args)
    finally:
        for spinner in spinners:
            spinner.kill()


def table(args: argparse.Namespace) -> None:
    print(f"Llama of {args.layers} layers, 4 heads of {args.d_head}, {args.analyses}; threads "
          f"{os.environ.get('OMP_NUM_THREADS', 'default')} (waiting: as probe analyze sets it for "
          f"the length, floor and analysis alike), {args.busy} busy processes, budget "
          f"{args.budget}; "
          f"CPU seconds, median of {args.rounds} rounds; load: 1-minute load average, "
          f"{os.cpu_count()} cores")  # fmt: skip
    print(f"{'tokens':>7} {'floor s':>8} {'analysis s':>10} {'time x':>7} {'floor wall':>10} "
          f"{'analysis wall':>13} {'wall x':>7} {'waiting':>8} "
          f"{'floor MiB':>9} {'analysis MiB':>12} {'load':>5}")  # fmt: skip
    for tokens in map(int, args.lengths.split(",")):
        floor = run(tokens, "floor", args)
        rows = run(tokens, "rows", args)
        ratio = rows["analysis"] / rows["floor"]
        wall = rows["analysis_wall"] / rows["floor_wall"]
        print(f"{rows['tokens']:>7} {rows['floor']:>8.2f} {rows['analysis']:>10.2f} "
              f"{ratio:>7.2f} {rows['floor_wall']:>10.2f} {rows['analysis_wall']:>13.2f} "
              f"{wall:>7.2f} {rows['policy'] or 'spinning':>8} {floor['peak_mib']:>9.0f} "
              f"{rows['peak_mib']:>12.0f} "
              f"{os.getloadavg()[0]:>5.1f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
