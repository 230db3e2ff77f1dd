"""Data-parallel `probe analyze` under torchrun on this machine, and what each analysis exchanges.

    python benchmarks/scaling.py [--rounds 1] [--max-sentences N]

Throughput: `probe analyze --model minilm` over EWT dev (every sentence analysis, no
coreference: EWT has no Entity= annotation) as whole processes, in sentences per second of the
analyses stage (streaming and, for several processes, the merge) and of the whole run:
1 process x 1 thread, 1 process x 2 threads, and 2 processes x 1 thread (torchrun, gloo), the
last two using the same two cores.

Exchange: the pickled size of each analysis's state after EWT dev (after GUM dev for
coreference), which is what one process sends another in the merge; fixed by the model and
the budgets, not by the corpus, except the attention probe's sample, which is capped.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ewt_dev

GUM_DEV = Path(__file__).resolve().parents[2] / "shared/data/ud-english-gum/en_gum-ud-dev.conllu"


def run(processes: int, threads: int, dev: Path, out: Path, extra: list[str]) -> dict:
    command = [str(Path(sys.executable).with_name("probe"))]
    if processes > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={processes}", "--no-python", *command]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    subprocess.run([*command, "analyze", "-m", "minilm", "-t", str(dev), "-o", str(out), "-q",
                    "-a", "syntax,roles,probe", *extra],
                   check=True, env=env, capture_output=True)  # fmt: skip
    wall = time.perf_counter() - start
    card = json.loads((out / "run.json").read_text())
    stage = card["timings_s"]["analyses"] + card["timings_s"].get("merge", 0.0)
    return {"wall": wall, "stage": stage, "sentences": card["sentences_analysed"]}


def exchanged() -> dict[str, int]:
    """Bytes each analysis sends in the merge, after streaming the dev splits."""
    import probe
    from analyses import REGISTRY, Context, get
    from probe.app.examples import Examples
    from probe.inputs.coreference import Windows
    from probe.inputs.corpus import Corpus
    from probe.inputs.treebank import iter_conllu
    from probe.pipeline.runner import stream

    model, tokenizer = probe.load("minilm")
    context = Context(len(model.encoder.layer), model.config.num_attention_heads, model=model)
    chosen = {name: get(name)(context) for name in REGISTRY}
    sentence = [a for a in chosen.values() if a.captures and a.unit == "sentence"]
    examples = Examples(tokenizer, context.n_layers, context.n_heads)
    corpus = Corpus(iter_conllu(ewt_dev()), tokenizer, 512)
    stream(model, corpus.batches(32), [*sentence, examples], ["hook_pattern"])
    if GUM_DEV.exists():
        windows = Corpus(Windows(iter_conllu(GUM_DEV), tokenizer, 128), tokenizer, 128)
        stream(model, windows.batches(32, 32 * 128 * 128 // 4), [chosen["coref"]])
    sizes = {name: len(pickle.dumps(a)) for name, a in chosen.items()}
    sizes["(examples)"] = len(pickle.dumps(examples))
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--max-sentences", type=int)
    args = parser.parse_args()
    dev = ewt_dev()
    extra = ["-n", str(args.max_sentences)] if args.max_sentences else []
    configurations = {"1 process x 1 thread": (1, 1), "1 process x 2 threads": (1, 2),
                      "2 processes x 1 thread": (2, 1)}  # fmt: skip
    results: dict[str, list[dict]] = {name: [] for name in configurations}
    with tempfile.TemporaryDirectory(prefix="probe-scaling-") as work:
        for i in range(args.rounds):
            for name, (processes, threads) in configurations.items():
                out = Path(work) / f"{processes}x{threads}-{i}"
                results[name].append(run(processes, threads, dev, out, extra))

    print(f"MiniLM over EWT dev ({dev.name}), syntax+roles+probe, medians of {args.rounds} run(s)")
    print(f"{'':26}{'analyses stage':>16}{'sentences/s':>13}{'whole run':>11}{'sentences/s':>13}")
    rates = {}
    for name, runs in results.items():
        stage = statistics.median(r["stage"] for r in runs)
        wall = statistics.median(r["wall"] for r in runs)
        n = runs[0]["sentences"]
        rates[name] = n / stage
        print(f"{name:26}{stage:14.1f} s{n / stage:13.1f}{wall:9.1f} s{n / wall:13.1f}")
    base = rates["1 process x 1 thread"]
    for name in list(configurations)[1:]:
        print(f"speed-up of the analyses stage, {name}: {rates[name] / base:.2f}x")
    print(f"2 processes x 1 thread against 1 process x 2 threads: "
          f"{rates['2 processes x 1 thread'] / rates['1 process x 2 threads']:.2f}x")  # fmt: skip

    print("\nwhat each analysis sends in the merge (pickled state, MiniLM: 6 layers x 12 heads)")
    for name, size in exchanged().items():
        print(f"  {name:12}{size / 2**20:9.2f} MiB")


if __name__ == "__main__":
    main()
