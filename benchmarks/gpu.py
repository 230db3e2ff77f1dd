"""The main command, capture, long inputs and edges on a GPU in bfloat16: time, throughput and
peak memory of each, against the plain forward pass over the same inputs.

    python benchmarks/gpu.py [--device cuda] [--dtype bfloat16] [--size 1b] [--arch llama]
        [--sentences 2000] [--batch-size 32] [--context 8192] [--windows 4] [--pairs 16]
        [--length 64] [--steps 5] [--rounds 3] [--only main,capture,long,edges]

    python benchmarks/gpu.py --device cpu --size small      # every path, small, on the CPU

The model is random (its weights do not change the time): ``--arch llama`` with ``--size 1b`` has
the shape of Llama-3.2-1B's layers (16 layers, 32 query heads and 8 key/value heads of 64,
d_model 2048, MLP 8192: RoPE, RMSNorm, grouped-query attention), ``--arch gpt2`` GPT-2's parts at
the same shape without grouping; ``--size small`` is 2 layers of 4 heads, for the CPU. Its
vocabulary is a BPE of 8,000 tokens trained on EWT dev's text, and the model and tokenizer are
saved in a temporary folder that ``probe analyze`` loads as a user's model. Nothing is downloaded.

- main: ``probe analyze`` (the default analyses) over EWT dev's first ``--sentences``; its
  stream's seconds (``run.json``'s ``analyses`` stage) against the plain forward of the same
  sentences in batches of ``--batch-size``, shortest first (as probe batches them);
- capture: ``probe.trace`` of ``hook_pattern``, ``hook_z`` and ``hook_resid_pre`` around the same
  forward passes, against the passes alone;
- long: ``probe analyze -a roles`` on a corpus of ``--windows`` windows of ``--context`` tokens
  (patterns in row blocks), against the plain forward of windows of that length;
- edges: ``probe.patch`` of every head, ``probe.attribute`` and ``probe.edges`` (EAP-IG,
  ``--steps``) on ``--pairs`` prompt pairs of ``--length`` tokens, each against one plain forward
  pass of the pairs. Where the model's edges are refused (grouped-query attention), the refusal
  is printed and they are measured on the same shape with as many key/value heads as queries.

Peak memory is ``torch.cuda.max_memory_allocated`` from a reset before each measurement (the
weights included); on the CPU it is not measured. Times are medians of ``--rounds`` after one
warm-up, the device synchronised before each clock reading. GPU numbers: still to be measured
(docs/guide/scaling.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _common import ewt_dev

import probe
from probe.app.analyze import analyze
from probe.app.plan import Settings

SIZES = {
    "1b": {"layers": 16, "d_model": 2048, "heads": 32, "kv_heads": 8, "ffn": 8192},
    "small": {"layers": 2, "d_model": 64, "heads": 4, "kv_heads": 2, "ffn": 128},
}
VOCAB = 8000
POINTS = ("hook_pattern", "hook_z", "hook_resid_pre")
SECTIONS = ("main", "capture", "long", "edges")


# -- the model, its tokenizer and its inputs ---------------------------------------------------


def sentences(limit: int | None = None) -> list[list[str]]:
    """EWT dev's sentences as words (multiword tokens and empty nodes left out), in order."""
    found, words = [], []
    for line in ewt_dev().read_text(encoding="utf-8").splitlines():
        parts = line.split("\t")
        if len(parts) == 10 and parts[0].isdigit():
            words.append(parts[1])
        elif not line.strip() and words:
            found.append(words)
            words = []
            if limit is not None and len(found) == limit:
                break
    return found + ([words] if words and (limit is None or len(found) < limit) else [])


def tokenizer_from_ewt():
    """A BPE of ``VOCAB`` tokens trained on EWT dev's words, adding ``<s>`` in front of each text,
    as a fast tokenizer of transformers."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials, show_progress=False)
    bpe.train_from_iterator((" ".join(s) for s in sentences()), trainer)
    bpe.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")  # fmt: skip


def build(arch: str, size: str, vocab: int, device: str, dtype, positions: int,
          grouped: bool = True):  # fmt: skip
    """A random causal language model of ``arch`` and ``size`` that reads ``positions`` tokens
    (GPT-2's learned table has as many rows), made on ``device`` in ``dtype`` (no float32 copy
    of a large model on the host)."""
    import transformers as tf

    s = SIZES[size]
    if arch == "llama":
        config = tf.LlamaConfig(
            vocab_size=vocab, hidden_size=s["d_model"], num_hidden_layers=s["layers"],
            num_attention_heads=s["heads"], intermediate_size=s["ffn"],
            num_key_value_heads=s["kv_heads"] if grouped else s["heads"],
            max_position_embeddings=positions, bos_token_id=1, eos_token_id=2, pad_token_id=3,
        )  # fmt: skip
    else:
        config = tf.GPT2Config(vocab_size=vocab, n_embd=s["d_model"], n_layer=s["layers"],
                               n_head=s["heads"], n_inner=s["ffn"], n_positions=positions,
                               bos_token_id=1, eos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        return tf.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def batches(tokenizer, words: list[list[str]], size: int, device: str) -> list[dict]:
    """``words`` tokenized, shortest first, in padded batches of ``size`` on ``device``."""
    ids = tokenizer(words, is_split_into_words=True)["input_ids"]
    ids.sort(key=len)
    found = []
    for start in range(0, len(ids), size):
        part = ids[start : start + size]
        width = max(map(len, part))
        pad = [[tokenizer.pad_token_id] * (width - len(r)) for r in part]
        found.append({
            "input_ids": torch.tensor([r + p for r, p in zip(part, pad, strict=True)],
                                      device=device),
            "attention_mask": torch.tensor([[1] * len(r) + [0] * len(p)
                                            for r, p in zip(part, pad, strict=True)],
                                           device=device),
        })  # fmt: skip
    return found


def pairs(vocab: int, n: int, length: int, device: str):
    """Prompt pairs: random tokens, the corrupted copy's second quarter redrawn; the metric, the
    log-probability of each clean prompt's last token at the position before."""
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(4, vocab, (n, length), generator=g)
    clean[:, 0] = 1  # <s>
    corrupted = clean.clone()
    part = slice(length // 4, length // 2)
    corrupted[:, part] = torch.randint(4, vocab, corrupted[:, part].shape, generator=g)
    answer = clean[:, -1].to(device)
    mask = torch.ones_like(clean, device=device)

    def metric(logits: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits[:, -2].float(), dim=-1)
        return logp.gather(-1, answer[: len(logp), None])[:, 0]

    return ({"input_ids": clean.to(device), "attention_mask": mask},
            {"input_ids": corrupted.to(device), "attention_mask": mask}, metric)  # fmt: skip


# -- measuring ---------------------------------------------------------------------------------


class Meter:
    """Seconds (median of ``rounds`` after a warm-up) and peak memory of a callable."""

    def __init__(self, device: str, rounds: int) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.rounds = rounds

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, fn: Callable[[], object], rounds: int | None = None
                 ) -> tuple[float, int | None]:  # fmt: skip
        """Median seconds of ``rounds`` calls (default: the meter's) after one to warm up, and
        the peak memory allocated over them."""
        fn()
        self.sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(rounds or self.rounds):
            start = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated() if self.cuda else None
        return statistics.median(times), peak


def mib(peak: int | None) -> str:
    return "–" if peak is None else f"{peak / 2**20:,.0f}"


def row(section: str, what: str, took: float, units: float, unit: str, floor: float | None,
        peak: int | None, floor_peak: int | None) -> None:  # fmt: skip
    ratio = "–" if floor is None else f"{took / floor:.2f}x"
    print(f"{section:8} {what:48} {took:9.3f} s {units / took:12,.0f} {unit + '/s':7} {ratio:>7}  "
          f"peak {mib(peak):>8} MiB (plain {mib(floor_peak)} MiB)", flush=True)  # fmt: skip


# -- the sections ------------------------------------------------------------------------------


def stage_of(settings: Settings, out: Path, meter: Meter, rounds: int) -> tuple[dict, int | None]:
    """``probe analyze`` run ``rounds`` times after one to warm up: the run card of the run
    whose stream (the ``analyses`` stage) took the median time, and the peak memory over all."""
    cards = []

    def run() -> None:
        gc.collect()  # the last run's model, let go, is not counted in this one's peak
        analyze(settings)
        cards.append(json.loads((out / "run.json").read_text()))

    _, peak = meter(run)
    measured = sorted(cards[1:], key=lambda card: card["timings_s"]["analyses"])
    return measured[len(measured) // 2], peak


def plain_forward(args, folder: Path, meter: Meter, inputs: list[dict]) -> tuple[float, int | None]:
    """Seconds and peak memory of the model's plain forward passes over ``inputs``, the model
    loaded as ``probe analyze`` loads it (and let go on return)."""
    model, _ = probe.load(str(folder), device=args.device, dtype=args.dtype)

    @torch.no_grad()
    def plain() -> None:
        for batch in inputs:
            model(**batch)

    return meter(plain)


def main_command(args, folder: Path, work: Path, meter: Meter) -> None:
    """``probe analyze`` over EWT dev's first sentences against their plain forward passes."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    words = sentences(args.sentences)
    inputs = batches(tokenizer, words, args.batch_size, args.device)
    tokens = sum(int(b["attention_mask"].sum()) for b in inputs)
    floor, floor_peak = plain_forward(args, folder, meter, inputs)
    treebank = work / "ewt-dev.conllu"
    treebank.write_text(ewt_dev().read_text(encoding="utf-8"), encoding="utf-8")
    settings = Settings(model=str(folder), treebank=[str(treebank)], out=work / "main",
                        max_sentences=args.sentences, batch_size=args.batch_size,
                        device=args.device, dtype=args.dtype, overwrite=True)  # fmt: skip
    card, peak = stage_of(settings, work / "main", meter, args.rounds)
    label = f"probe analyze, {len(words)} sentences"
    row("main", label, card["timings_s"]["analyses"], tokens, "tok", floor, peak, floor_peak)
    print(f"main     analyses {', '.join(card['analyses'])}; the run's stages: {card['timings_s']}")


def capture(args, folder: Path, meter: Meter) -> None:
    model, tokenizer = probe.load(str(folder), device=args.device, dtype=args.dtype)
    inputs = batches(tokenizer, sentences(args.sentences), args.batch_size, args.device)
    tokens = sum(int(b["attention_mask"].sum()) for b in inputs)

    @torch.no_grad()
    def plain() -> None:
        for batch in inputs:
            model(**batch)

    @torch.no_grad()
    def traced() -> None:
        for batch in inputs:
            with probe.trace(model, list(POINTS)):
                model(**batch)

    floor, floor_peak = meter(plain)
    took, peak = meter(traced)
    row("capture", f"probe.trace: {', '.join(POINTS)}", took, tokens, "tok", floor, peak,
        floor_peak)  # fmt: skip
    row("capture", "plain forward", floor, tokens, "tok", None, floor_peak, floor_peak)


def long_inputs(args, folder: Path, work: Path, meter: Meter) -> None:
    """``probe analyze -a roles`` on windows of ``--context`` tokens against their plain
    forward passes."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    words = [w for s in sentences() for w in s]
    wanted = args.context * args.windows
    text = " ".join((words * (wanted // len(words) + 1))[:wanted])
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    step = args.context - 1  # and <s>
    windows = [ids[i : i + step] for i in range(0, len(ids), step)][: args.windows]
    inputs = [{"input_ids": torch.tensor([[tokenizer.bos_token_id, *w]], device=args.device)}
              for w in windows]  # fmt: skip
    tokens = sum(x["input_ids"].shape[1] for x in inputs)
    floor, floor_peak = plain_forward(args, folder, meter, inputs)
    corpus = work / "long.txt"
    kept = [token for w in windows for token in w]
    corpus.write_text(tokenizer.decode(kept) + "\n", encoding="utf-8")
    settings = Settings(model=str(folder), corpus=str(corpus), context=args.context,
                        max_texts=1, analyses=["roles"], out=work / "long", batch_size=1,
                        device=args.device, dtype=args.dtype, overwrite=True)  # fmt: skip
    card, peak = stage_of(settings, work / "long", meter, args.rounds)
    read = card["inputs"].get("text", {})
    label = f"probe analyze -a roles, {read.get('windows', '?')} x {card['context']} tokens"
    row("long", label, card["timings_s"]["analyses"], tokens, "tok", floor, peak, floor_peak)


def edges(args, vocab: int, meter: Meter) -> None:
    dtype = getattr(torch, args.dtype)
    model = build(args.arch, args.size, vocab, args.device, dtype, longest(args))
    clean, corrupted, metric = pairs(vocab, args.pairs, args.length, args.device)
    n = args.pairs

    @torch.no_grad()
    def plain() -> None:
        model(**clean)

    floor, floor_peak = meter(plain)
    heads = SIZES[args.size]["layers"] * SIZES[args.size]["heads"]
    for what, fn in (
        (
            f"probe.patch, every head ({heads})",
            lambda: probe.patch(model, clean, corrupted, metric),
        ),
        ("probe.attribute (AtP)", lambda: probe.attribute(model, clean, corrupted, metric)),
    ):
        took, peak = meter(fn)
        row("edges", what, took, n, "pairs", floor, peak, floor_peak)
    try:
        probe.edges(model, clean, corrupted, metric, steps=1)
    except probe.ProbeError as e:
        print(f"edges    refused on {args.arch} {args.size}: {e}")
        model = build(args.arch, args.size, vocab, args.device, dtype, longest(args),
                      grouped=False)  # fmt: skip
        floor, floor_peak = meter(plain)
        print("edges    measured instead on the same shape without grouped-query attention")
    took, peak = meter(lambda: probe.edges(model, clean, corrupted, metric, steps=args.steps))
    row("edges", f"probe.edges, EAP-IG, {args.steps} steps", took, n, "pairs", floor, peak,
        floor_peak)  # fmt: skip
    row("edges", f"plain forward of {n} pairs of {args.length} tokens", floor, n, "pairs", None,
        floor_peak, floor_peak)  # fmt: skip


def longest(args) -> int:
    """The longest input any section gives the model: a long window, or EWT's longest
    sentences."""
    return max(args.context, args.length, 1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--arch", choices=("llama", "gpt2"), default="llama")
    parser.add_argument("--size", choices=sorted(SIZES), help="default: 1b on a GPU, small else")
    parser.add_argument("--sentences", type=int, help="default: 2000 on a GPU, 64 else")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--context", type=int, help="default: 8192 on a GPU, 512 else")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=16)
    parser.add_argument("--length", type=int, help="default: 64 on a GPU, 16 else")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", help=f"comma-separated, of {', '.join(SECTIONS)}")
    args = parser.parse_args()
    gpu = torch.device(args.device).type == "cuda"
    if gpu and not torch.cuda.is_available():
        raise SystemExit("this torch sees no CUDA GPU; run with --device cpu (small sizes)")
    args.size = args.size or ("1b" if gpu else "small")
    args.sentences = args.sentences or (2000 if gpu else 64)
    args.context = args.context or (8192 if gpu else 512)
    args.length = args.length or (64 if gpu else 16)
    only = SECTIONS if not args.only else tuple(args.only.split(","))
    unknown = set(only) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown --only {', '.join(sorted(unknown))}; of {', '.join(SECTIONS)}")

    name = torch.cuda.get_device_name() if gpu else "CPU"
    s = SIZES[args.size]
    kv = s["kv_heads"] if args.arch == "llama" else s["heads"]
    print(f"{args.device} ({name}), {args.dtype}, torch {torch.__version__}; {args.arch} "
          f"{args.size}: {s['layers']} layers, {s['heads']} heads ({kv} key/value), d_model "
          f"{s['d_model']}; {torch.get_num_threads()} threads")  # fmt: skip
    meter = Meter(args.device, args.rounds)
    with tempfile.TemporaryDirectory(prefix="probe-gpu-") as tmp:
        work = Path(tmp)
        folder = work / "model"
        tokenizer = tokenizer_from_ewt()
        vocab = len(tokenizer)
        model = build(args.arch, args.size, vocab, args.device, getattr(torch, args.dtype),
                      longest(args))  # fmt: skip
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        del model
        if "main" in only:
            main_command(args, folder, work, meter)
        if "capture" in only:
            capture(args, folder, meter)
        if "long" in only:
            long_inputs(args, folder, work, meter)
        if "edges" in only:
            edges(args, vocab, meter)


if __name__ == "__main__":
    main()
