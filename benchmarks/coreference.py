"""Coreference over the GUM dev split against the plain forward pass over the same windows.

    python benchmarks/coreference.py [--rounds 3] [--batch-size 32]

Floor: MiniLM as Hugging Face loads it (its default attention, no attention output) over the
windows ``probe analyze`` builds (whole sentences, 128 tokens) in the very same batches.
Ours: the coreference analysis streamed over those batches (mirrored forward pass, capture,
the scored rows of word-level attention, counts and bootstrap replicates) and its tables.
Also shown: the mirrored forward pass capturing attention with no analysis, to tell the cost of
materialising attention from that of the analysis.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from _common import timed
from transformers import AutoModel

import probe
from analyses import Context
from analyses.coreference import Coreference
from probe.inputs.coreference import Windows
from probe.inputs.corpus import Corpus
from probe.inputs.treebank import read_conllu
from probe.inputs.units.windows import WINDOWS_PER_BATCH_SHARE
from probe.pipeline.loading import resolve_name
from probe.pipeline.runner import stream

GUM_DEV = Path(__file__).resolve().parents[2] / "shared/data/ud-english-gum/en_gum-ud-dev.conllu"
WINDOW = 128


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not GUM_DEV.exists():
        sys.exit(f"needs {GUM_DEV} (../shared beside the checkout)")

    model, tokenizer = probe.load("minilm")
    plain = AutoModel.from_pretrained(resolve_name("minilm")).eval()
    windows = list(Windows(read_conllu(GUM_DEV), tokenizer, WINDOW))
    cells = args.batch_size * WINDOW * WINDOW // WINDOWS_PER_BATCH_SHARE
    batches = list(Corpus(windows, tokenizer, WINDOW).batches(args.batch_size, cells))
    tokens = sum(int(b.attention_mask.sum()) for b in batches)
    print(f"MiniLM, GUM dev: {len(windows)} windows, {len(batches)} batches, {tokens} tokens")

    @torch.inference_mode()
    def floor():
        for b in batches:
            plain(**b.inputs)

    def captured():
        stream(model, batches, [])

    def coreference():
        analysis = Coreference(Context(6, 12))
        stream(model, batches, [analysis])
        analysis.finish()

    base = timed(floor, args.rounds)
    bare = timed(captured, args.rounds)
    mine = timed(coreference, args.rounds)
    print(f"plain forward (floor)                 {base:6.2f} s")
    print(f"mirrored forward, attention captured  {bare:6.2f} s   {bare / base:4.2f}x floor")
    print(f"coreference analysis, all tables      {mine:6.2f} s   {mine / base:4.2f}x floor")


if __name__ == "__main__":
    main()
