"""Peak memory of `probe analyze` against the depth of the model and the size of the corpus.

    python benchmarks/memory.py [--copies 50] [--skip-depth] [--skip-corpus]

Depth: random BERTs of 2 and 24 layers (hidden 64, 8 heads) over sentences of about 1,000
tokens, every analysis; the goal is at most 150 MB more for 24 layers than for 2.
Corpus: MiniLM over EWT dev (2,001 sentences) and over EWT dev repeated ``--copies`` times
(100k sentences for 50), syntax only; the goal is a peak at most 1.1x.
Each figure is the peak resident memory of a fresh `probe analyze` process (ru_maxrss).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ewt_dev

PROBE = str(Path(sys.executable).with_name("probe"))
LONG_TOKENS = 1000  # tokens per long sentence, about
N_LONG = 6  # long sentences in the depth test


def peak_mib(args: list[str]) -> tuple[float, float]:
    """Peak resident memory (MiB) and seconds of one `probe analyze` process."""
    start = time.perf_counter()
    child = subprocess.Popen([PROBE, "analyze", "-q", *args], stderr=subprocess.PIPE, text=True)
    err = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    if status:
        sys.exit(f"probe analyze {' '.join(args)} failed:\n{err[-2000:]}")
    return usage.ru_maxrss / 1024, time.perf_counter() - start


def long_sentences(path: Path, n: int) -> str:
    """CoNLL-U of ``n`` sentences, each EWT dev sentences joined into about ``LONG_TOKENS``
    tokens: each part's root attaches to the first part's root, so every tree stays valid."""
    blocks = [b for b in ewt_dev().read_text(encoding="utf-8").split("\n\n") if b.strip()]
    out, part = [], iter(blocks)
    for _ in range(n):
        rows, root = [], None
        while len(rows) < LONG_TOKENS * 0.8:  # about 1.25 tokens per word for this vocabulary
            words = [r.split("\t") for r in next(part).splitlines() if r and r[0].isdigit()]
            words = [w for w in words if w[0].isdigit()]
            offset = len(rows)
            for w in words:
                head = int(w[6])
                if head == 0 and root is not None:
                    head, relation = root, "parataxis"
                else:
                    head, relation = (head + offset if head else 0), w[7]
                rows.append([str(len(rows) + 1), w[1], "_", w[3], "_", "_", str(head), relation])
            root = root or next(int(r[0]) for r in rows if r[6] == "0")
        out.append("\n".join("\t".join([*r, "_", "_"]) for r in rows))
    path.write_text("\n\n".join(out) + "\n\n", encoding="utf-8")
    return str(path)


def bert_folder(folder: Path, layers: int) -> str:
    """A random BERT (hidden 64, 8 heads) with a WordPiece tokenizer trained on EWT dev."""
    import transformers as tf
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    text = [line.split("= ", 1)[1] for line in ewt_dev().read_text().splitlines()
            if line.startswith("# text")]  # fmt: skip
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    tok.train_from_iterator(
        text, trainers.WordPieceTrainer(vocab_size=4000, special_tokens=special)
    )
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    tokenizer = tf.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
        sep_token="[SEP]", model_max_length=2 * LONG_TOKENS,
    )  # fmt: skip
    config = tf.BertConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, num_attention_heads=8,
        num_hidden_layers=layers, intermediate_size=128, max_position_embeddings=2 * LONG_TOKENS,
    )  # fmt: skip
    tf.BertModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def depth_figures(work: Path) -> None:
    treebank = long_sentences(work / "long.conllu", N_LONG)
    depth = {}
    for layers in (2, 24):
        model = bert_folder(work / f"bert-{layers}", layers)
        depth[layers] = peak_mib(["-m", model, "-t", treebank, "-o", str(work / f"out-{layers}")])
    print(f"depth: random BERT, hidden 64, 8 heads, {N_LONG} sentences of ~{LONG_TOKENS} tokens")
    for layers, (mib, seconds) in depth.items():
        print(f"  {layers:2d} layers: peak {mib:7.1f} MiB  ({seconds:.1f} s)")
    growth = (depth[24][0] - depth[2][0]) * 2**20 / 1e6
    print(f"  24 - 2 layers: {growth:+.0f} MB  (goal ≤ +150 MB)")


def corpus_figures(work: Path, copies: int) -> None:
    dev = ewt_dev().read_text(encoding="utf-8").rstrip("\n") + "\n\n"
    repeated = work / "repeated.conllu"
    repeated.write_text(dev * copies, encoding="utf-8")
    corpus = {}
    for name, path in (("2k", str(ewt_dev())), (f"{2 * copies}k", str(repeated))):
        out = str(work / f"corpus-{name}")
        corpus[name] = peak_mib(["-m", "minilm", "-a", "syntax", "-t", path, "-o", out])
    print("corpus: MiniLM, syntax only, EWT dev repeated")
    for name, (mib, seconds) in corpus.items():
        print(f"  {name:>5s} sentences: peak {mib:7.1f} MiB  ({seconds:.1f} s)")
    (small, _), (large, _) = corpus.values()
    print(f"  ratio: {large / small:.2f}x  (goal ≤ 1.1x)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--copies", type=int, default=50)
    parser.add_argument("--skip-corpus", action="store_true")
    parser.add_argument("--skip-depth", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="probe-memory-"))
    try:
        if not args.skip_depth:
            depth_figures(work)
        if not args.skip_corpus:
            corpus_figures(work, args.copies)
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
