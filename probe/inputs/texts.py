"""Plain-text corpora read through 🤗 datasets, streamed: local files, folders and hub datasets.

``corpus_spec`` resolves what the user gave (``--corpus``, ``--text-column``) and checks it when
the run is planned, before torch: the file exists, its kind is known, the text column is there
and the corpus holds a text. ``windows`` streams it, so memory does not grow with the corpus
nor with its longest text: short texts are tokenized in batches, each cut into consecutive
windows of at most the context's tokens; a text longer than ``PIECE_CHARS`` characters is read,
tokenized and cut in pieces (``probe.inputs.pieces``), giving the windows its whole would (the
cutting: ``probe.inputs.windowing``). The windows are shared between torchrun's processes one in
turn to each: the same windows whatever the number of processes, each numbered by its place in
the whole stream.

``.txt`` files are read here, line by line in bounded pieces (datasets' text builder holds a
whole line, however long); the other kinds through datasets, which holds each text whole (a
few times its size), and which probe then tokenizes in pieces as well.

Imports nothing heavy until it reads: ``datasets`` (about half a second) on the first call.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

from probe.errors import ProbeError
from probe.inputs.pieces import PIECE_CHARS
from probe.inputs.unreadable import explain, first_line, not_text
from probe.inputs.windowing import TEXTS_PER_MAP, Cutter

if TYPE_CHECKING:
    from datasets import IterableDataset
    from transformers import PreTrainedTokenizerBase

# file suffix -> the datasets builder that reads it
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
HUB = "hf:"
# Bytes of a .txt or .json file that datasets reads at once (its default, 10 MiB, holds a
# hundred thousand lines in memory however few of them the run reads).
CHUNK_BYTES = 1 << 20
READ_CHARS = 1 << 20  # characters of a .txt file read at once
# A local corpus's files are held open from the plan (``CorpusSpec.sources``), the first this
# many of a folder's: the rest are read by their paths.
HELD_FILES = 256


@dataclass(frozen=True)
class CorpusSpec:
    """A corpus, resolved: a datasets builder with its files, or a hub dataset.

    ``name`` is what the user wrote; ``builder`` is ``text``, ``json``, ``csv``, ``parquet`` or
    the hub dataset's name; ``files`` the local files (none for the hub), in name order.
    """

    name: str
    builder: str
    files: tuple[str, ...] = ()
    config: str | None = None
    split: str = "train"
    column: str = "text"
    # The files as the plan opened them (``/proc/self/fd`` names, in the process ``holder``),
    # so that the run reads what it planned on though a file is deleted, moved or replaced
    held: tuple[str, ...] = field(default=(), compare=False, repr=False)
    holder: int | None = field(default=None, compare=False, repr=False)

    @property
    def hub(self) -> bool:
        return not self.files

    def sources(self) -> tuple[str, ...]:
        """Where each of ``files`` is read from: the file the plan opened, where it is held in
        this process; else its path."""
        if not self.held or os.getpid() != self.holder:  # a child has no such descriptors
            return self.files
        return self.held + self.files[len(self.held) :]

    def describe(self) -> str:
        """The corpus as the run card names it."""
        column = "" if self.builder == "text" else f" (column {self.column!r})"
        return self.name + column


def corpus_spec(spec: str, column: str = "text") -> CorpusSpec:
    """Resolve and check ``--corpus`` and ``--text-column``, reading the corpus's first text.

    Raises
    ------
    ProbeError
        One line: a file that does not exist, a kind of file not accepted, a folder with none or
        with several kinds, a text column that is not there (naming those that are), a hub
        dataset that cannot be reached or is unknown, or a corpus with no text.
    """
    if spec.startswith(HUB):
        found = _hub_spec(spec, column)
    else:
        found = _hold(CorpusSpec(spec, *_local(Path(spec)), column=column))
    empty = found.files and not any(os.path.getsize(f) for f in found.sources())
    with _torch_unseen():
        try:
            first = None if empty else _first(found)
        except ProbeError:
            raise
        except Exception as e:  # a file datasets cannot parse: where, in one line
            raise _unreadable(found, e) from None
    if first is None:
        raise ProbeError(f"corpus {spec} holds no text; give a corpus with at least one")
    if found.column not in first:
        columns = ", ".join(map(repr, first))
        raise ProbeError(
            f"corpus {spec} has no column {found.column!r}; its columns are {columns}: "
            "name one with --text-column"
        )
    if not isinstance(first[found.column], str | None):
        raise not_text(spec, found.column, 0, first[found.column])
    return found


def _first(spec: CorpusSpec) -> dict[str, Any] | None:
    """The corpus's first row, or None; of a .txt file, its first line's first piece (a line
    may be longer than memory allows to hold)."""
    if spec.builder == "text" and not spec.hub:
        return next(({"text": piece} for piece, _ in _txt_pieces(spec.sources())), None)
    return next(iter(_open(spec)), None)


@contextmanager
def _torch_unseen() -> Iterator[None]:
    """datasets makes each iterable dataset a torch one where torch is installed, importing it;
    the plan's look at a corpus's first row needs no torch, and the plan runs before torch."""
    from datasets import config

    available, config.TORCH_AVAILABLE = config.TORCH_AVAILABLE, False
    try:
        yield
    finally:
        config.TORCH_AVAILABLE = available


def _local(path: Path) -> tuple[str, tuple[str, ...]]:
    """The builder and files of a local file or folder."""
    accepted = ", ".join(BUILDERS)
    if path.is_dir():
        files = sorted(
            p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")
            and p.suffix.lower() in BUILDERS
        )  # fmt: skip
        kinds = sorted({BUILDERS[p.suffix.lower()] for p in files})
        if not files:
            raise ProbeError(f"corpus folder {path} holds no {accepted} file")
        if len(kinds) > 1:
            raise ProbeError(f"corpus folder {path} mixes {' and '.join(kinds)} files; "
                             "give a folder of one kind")  # fmt: skip
        return kinds[0], tuple(map(str, files))
    if path.exists() and not path.is_file():  # a pipe, a device, a socket
        raise ProbeError(f"corpus {path} is not a regular file (a pipe or a device): the plan "
                         "reads its first text and the run reads it again; save it to a file "
                         "and give that")  # fmt: skip
    if not path.is_file():
        raise ProbeError(f"corpus {path} does not exist (give a {accepted} file, a folder of "
                         "them, or hf:NAME[:CONFIG][@SPLIT])")  # fmt: skip
    if path.suffix.lower() not in BUILDERS:
        raise ProbeError(f"corpus {path}: unknown kind of file {path.suffix or '(no suffix)'!r}; "
                         f"give one of {accepted}")  # fmt: skip
    return BUILDERS[path.suffix.lower()], (str(path),)


def _hold(spec: CorpusSpec) -> CorpusSpec:
    """``spec`` with its files held open (the first ``HELD_FILES``) until it is forgotten, where
    the system names open files (Linux's ``/proc/self/fd``); else ``spec``."""
    if not os.path.isdir("/proc/self/fd"):
        return spec
    descriptors = []
    for path in spec.files[:HELD_FILES]:
        try:
            descriptors.append(os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)))
        except OSError:  # read by its path: its reader says what is wrong
            break
    held = tuple(f"/proc/self/fd/{fd}" for fd in descriptors)
    found = replace(spec, held=held, holder=os.getpid())
    weakref.finalize(found, _close, descriptors)
    return found


def _close(descriptors: list[int]) -> None:
    for fd in descriptors:
        with suppress(OSError):
            os.close(fd)


def _unreadable(spec: CorpusSpec, error: BaseException) -> ProbeError:
    """The one line for a reader's ``error`` (``probe.inputs.unreadable.explain``), naming the
    files by their paths; a file that is gone (not held, and deleted or moved since the plan)
    said so."""
    if isinstance(error, FileNotFoundError) and error.filename in spec.files:
        return ProbeError(f"corpus {spec.name}: {error.filename} was deleted or moved while "
                          "probe read it; nothing was written: put it back and re-run")  # fmt: skip
    message = str(explain(spec.name, spec.builder, spec.files, error, spec.sources()))
    for alias, path in sorted(zip(spec.sources(), spec.files, strict=True), reverse=True):
        message = message.replace(alias, path)  # /proc/self/fd/12 before /proc/self/fd/1
    return ProbeError(message)


def _hub_spec(spec: str, column: str) -> CorpusSpec:
    """``hf:NAME[:CONFIG][@SPLIT]``, the split ``train`` unless given."""
    rest, _, split = spec.removeprefix(HUB).partition("@")
    name, _, config = rest.partition(":")
    if not name:
        raise ProbeError(f"corpus {spec}: name a hub dataset, as hf:NAME[:CONFIG][@SPLIT]")
    if name.startswith(("/", ".", "~")) or Path(name).exists():  # datasets would read it
        raise ProbeError(f"corpus {spec}: {name} is a local path, not a hub dataset (datasets "
                         f"would read the local one); give it without hf: (--corpus {name}), "
                         "or run from a folder where no such path exists")  # fmt: skip
    return CorpusSpec(spec, name, (), config or None, split or "train", column)


def _open(spec: CorpusSpec) -> IterableDataset:
    """The corpus as an iterable dataset of rows, or a one-line ``ProbeError``."""
    import datasets

    if spec.hub:
        _offline_unless_reachable(datasets)
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors come as ours
    try:
        if spec.hub:
            return datasets.load_dataset(spec.builder, spec.config, split=spec.split,
                                         streaming=True)  # fmt: skip
        chunks = {"chunksize": CHUNK_BYTES} if spec.builder in ("text", "json") else {}
        return datasets.load_dataset(spec.builder, data_files=list(spec.sources()),
                                     split="train", streaming=True, **chunks)  # fmt: skip
    except ConnectionError as e:
        raise ProbeError(
            f"corpus {spec.name}: the hub cannot be reached (offline?) and the dataset is not in "
            f"the datasets cache ({first_line(e)}); give a local file instead"
        ) from None
    except Exception as e:  # datasets raises many kinds; the user needs the one line
        raise _unreadable(spec, e) from None


def _offline_unless_reachable(datasets) -> None:
    """Offline mode when the hub (``HF_ENDPOINT``) does not answer, so that an unknown name
    fails at once instead of after a minute of retries; a cached dataset still loads."""
    from probe.inputs.download import hub_reachable

    if not datasets.config.HF_HUB_OFFLINE and not hub_reachable():
        datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True


def texts(spec: CorpusSpec, max_texts: int | None = None) -> IterableDataset:
    """The corpus's texts (one column, ``text``), streamed, the first ``max_texts`` of them."""
    rows = _open(spec)
    rows = rows.select_columns([spec.column]).rename_column(spec.column, "text") if (
        spec.column != "text") else rows.select_columns(["text"])  # fmt: skip
    rows = rows if max_texts is None else rows.take(max_texts)
    return rows.map(_TextsOnly(spec), batched=True, batch_size=TEXTS_PER_MAP)


class _TextsOnly:
    """Passes a stream's batches of texts on, and refuses a text that is not a string (a
    number, an object) in one line naming its row and type, which the tokenizer would not."""

    def __init__(self, spec: CorpusSpec) -> None:
        self.spec, self.read = spec, 0

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        for i, text in enumerate(batch["text"]):
            if not isinstance(text, str | None):
                raise not_text(self.spec.name, self.spec.column, self.read + i, text)
        self.read += len(batch["text"])
        return batch


def pieces(spec: CorpusSpec, max_texts: int | None = None) -> Iterator[tuple[str, bool]]:
    """The corpus's first ``max_texts`` texts, each in pieces of at most ``PIECE_CHARS``
    characters, as ``(piece, last)``: a ``.txt`` corpus read here (``_txt_pieces``), the others
    through datasets, each text whole and then sliced."""
    if spec.builder == "text" and not spec.hub:
        yield from _txt_pieces(spec.sources(), max_texts)
        return
    for row in texts(spec, max_texts):
        yield from _sliced(row["text"] or "")


def _sliced(text: str) -> Iterator[tuple[str, bool]]:
    for start in range(0, len(text), PIECE_CHARS) if text else [0]:
        yield text[start : start + PIECE_CHARS], start + PIECE_CHARS >= len(text)


def _txt_pieces(files: Iterable[str], max_texts: int | None = None) -> Iterator[tuple[str, bool]]:
    """The lines of ``.txt`` files as datasets' text builder reads them (UTF-8, universal
    newlines, no line break kept, no last empty line after a final one), in pieces: a line never
    held whole, so that memory is bounded whatever its length."""
    read = 0
    for path in files:
        with open(path, encoding="utf-8") as f:  # newline=None: \r\n and \r read as \n
            line = ""  # the current line's characters read and not given
            while block := f.read(READ_CHARS):
                *ended, rest = block.split("\n")
                for end in ended:
                    yield from _sliced(line + end)
                    line, read = "", read + 1
                    if read == max_texts:
                        return
                line += rest
                while len(line) > PIECE_CHARS:  # a long line: given as it comes
                    yield line[:PIECE_CHARS], False
                    line = line[PIECE_CHARS:]
            if line:
                yield from _sliced(line)
                read += 1
                if read == max_texts:
                    return


def count_texts(spec: CorpusSpec) -> int | None:
    """How many texts a local corpus holds, counted without parsing it (progress bars): the
    lines of ``.txt`` files (universal newlines, as datasets reads them), the non-blank lines
    of ``.jsonl`` ones and the rows of ``.parquet`` ones; None for the hub, ``.json`` (one
    document or lines) and ``.csv`` (quoted newlines), which only parsing would tell."""
    if spec.hub:
        return None
    suffixes = {Path(f).suffix.lower() for f in spec.files}
    try:
        if suffixes == {".txt"}:
            return sum(_txt_lines(f) for f in spec.sources())
        if suffixes == {".jsonl"}:
            return sum(_lines(f, blank=False) for f in spec.sources())
        if suffixes == {".parquet"}:
            import pyarrow.parquet as pq

            return sum(pq.read_metadata(f).num_rows for f in spec.sources())
    except OSError as e:
        raise _unreadable(spec, e) from None
    return None


def _txt_lines(path: str) -> int:
    """The lines of a .txt file, as ``_txt_pieces`` reads them, counted in blocks (a line may
    be longer than memory allows to hold)."""
    lines, last = 0, "\n"
    with open(path, encoding="utf-8", errors="replace") as f:  # newline=None: universal
        while block := f.read(READ_CHARS):
            lines, last = lines + block.count("\n"), block[-1]
    return lines + (last != "\n")


def _lines(path: str, blank: bool) -> int:
    """The lines of a text file, streamed; blank ones too, or not."""
    with open(path, encoding="utf-8", errors="replace") as f:  # newline=None: universal
        return sum(1 for line in f if blank or line.strip())


def windows(
    spec: CorpusSpec,
    tokenizer: PreTrainedTokenizerBase,
    context: int,
    *,
    max_texts: int | None = None,
    stop: int | None = None,
    shard: tuple[int, int] = (0, 1),
) -> Iterator[dict[str, Any]]:
    """This process's windows, streamed: dicts of ``input_ids`` (special tokens included; empty
    for a text without tokens), ``punct`` (per text token), ``window`` (its place in its text),
    ``text`` (its text's place in the corpus), ``inexact`` (why its tokens may not be those of
    its whole text, or "": ``probe.inputs.pieces``) and ``index`` (its place among every
    process's windows).

    Parameters
    ----------
    spec : CorpusSpec
    tokenizer : PreTrainedTokenizerBase
    context : int
        Tokens per window at most, special tokens included.
    max_texts : int, optional
        Read the first texts alone.
    stop : int, optional
        Read the first windows alone (before sharding).
    shard : (int, int)
        ``(rank, size)``: the windows whose index is ``rank`` modulo ``size``.
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # datasets may fork
    cut = islice(Cutter(tokenizer, context).cut(pieces(spec, max_texts)), stop)
    rank, size = shard
    try:
        for i, row in enumerate(cut):
            if i % size == rank:
                yield row | {"index": i}
    except ProbeError:
        raise
    except Exception as e:  # a row that cannot be parsed, a column that changes type…
        raise _unreadable(spec, e) from None
