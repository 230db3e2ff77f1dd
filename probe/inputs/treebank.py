"""Dependency treebanks in CoNLL-U: reading, validating, downloading UD, the bundled ones."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

from probe.errors import ProbeError
from probe.files import cache_dir
from probe.inputs.download import fetch
from probe.inputs.pipes import copy_pipe, is_pipe, read_from

SAMPLE = Path(__file__).parents[1] / "data" / "sample.conllu"  # hand-written: `--treebank sample`
# The default corpus: UD English EWT dev, the release UD_TREEBANKS pins, CC BY-SA 4.0, "Universal
# Dependencies English Web Treebank, (c) 2013-2021 The Board of Trustees of the Leland Stanford
# Junior University" (its licence is en_ewt-LICENSE.txt beside it).
EWT_DEV = Path(__file__).parents[1] / "data" / "en_ewt-ud-dev.conllu.gz"
BUNDLED = {"sample": SAMPLE, "ewt-dev": EWT_DEV}
# How many sentences each bundled treebank holds, said once for the help and the docs (checked
# against the files by tests/inputs/test_treebank.py).
BUNDLED_SENTENCES = {"sample": 76, "ewt-dev": 2001}


@dataclass(frozen=True)
class UDTreebank:
    """A UD treebank probe can download: its repository, the pinned release, and the SHA-256
    of each split's file in that release (only these splits are offered: each download is
    verified before it is cached)."""

    repo: str
    release: str
    sha256: dict[str, str]


UD_TREEBANKS = {
    "en_ewt": UDTreebank(
        "UD_English-EWT",
        "r2.15",
        {
            "dev": "531a54ff90d6ab12201c5a50c3e78e6ddac4de69abc4bce5d275d3cd29efe2b6",
            "test": "e266e515a0a7547657ed3d90d9ba46487d6bd251f27ad4269d4e8a427c8555cd",
        },
    ),
    # GUM carries coreference (Entity= brackets); its licence is non-commercial (CC BY-NC-SA 4.0
    # for the UD release), so probe downloads it on request and never ships it.
    "en_gum": UDTreebank(
        "UD_English-GUM",
        "r2.16",
        {
            "dev": "581997015a2d878ad49619032d265a9753e1b6b03d75ca18b04a00bb9ee8991d",
            "test": "fe95c0e744f81cdf2a307ce522604ecc05cd359c7c6d1abaa3a46c85d024f34c",
        },
    ),
}
# UD v2 universal relations; subtypes (obl:tmod) fold onto these.
RELATIONS = [
    "acl",
    "advcl",
    "advmod",
    "amod",
    "appos",
    "aux",
    "case",
    "cc",
    "ccomp",
    "clf",
    "compound",
    "conj",
    "cop",
    "csubj",
    "dep",
    "det",
    "discourse",
    "dislocated",
    "expl",
    "fixed",
    "flat",
    "goeswith",
    "iobj",
    "list",
    "mark",
    "nmod",
    "nsubj",
    "nummod",
    "obj",
    "obl",
    "orphan",
    "parataxis",
    "punct",
    "reparandum",
    "root",
    "vocative",
    "xcomp",
]
# CorefUD mention brackets: "(" opens a mention (its fields follow), ")" after them closes it on
# the same word, and "<entity>)" closes one opened earlier.
ENTITY_BRACKETS_ITEM = re.compile(r"\((?P<open>[^()\s]+)(?P<end>\))?|(?P<close>[^()\s]+)\)")
ENTITY_BRACKETS = re.compile(f"(?:{ENTITY_BRACKETS_ITEM.pattern})+")
# Where ud: treebanks come from; PROBE_UD_MIRROR replaces it (a mirror with the same layout).
UD_BASE = "https://raw.githubusercontent.com/UniversalDependencies"


@dataclass
class Sentence:
    """One sentence's basic dependency tree.

    ``heads[i]`` is the 0-based index of word i's head, -1 for the root (CoNLL-U's 1-based HEAD
    column is converted here, once); ``relations[i]`` is its universal relation with the subtype
    folded (``obl:tmod`` -> ``obl``).
    """

    words: list[str]
    heads: list[int]
    relations: list[str]
    upos: list[str] = field(default_factory=list)
    sent_id: str = ""
    source: str = ""
    document: str = ""  # the last ``# newdoc id`` before the sentence
    feats: list[str] = field(default_factory=list)  # FEATS, raw ("Number=Sing|Person=3")
    entity: list[str] = field(default_factory=list)  # MISC ``Entity=`` brackets, raw; "" if none
    entity_fields: tuple[str, ...] = ()  # ``# global.Entity``: what each bracket's fields mean


def read_conllu(path: str | Path, name: str | None = None) -> list[Sentence]:
    """Read and validate a whole CoNLL-U file (``iter_conllu`` streams it)."""
    return list(iter_conllu(path, name))


def check_conllu(path: str | Path, name: str | None = None) -> None:
    """Validate a CoNLL-U file without keeping it (memory stays flat whatever its size).

    Raises
    ------
    ProbeError
        As ``iter_conllu``; or when it holds no sentence.
    """
    if not sum(1 for _ in iter_conllu(path, name)):  # every sentence read, none kept
        raise ProbeError(f"no sentences in {name or path}")


def iter_conllu(path: str | Path, name: str | None = None) -> Iterator[Sentence]:
    """Stream the sentences of a CoNLL-U file, validating each as it is read.

    Comment lines, multiword-token ranges (``3-4``) and empty nodes (``8.1``) are skipped. A
    gzip file is read as such whatever its name (its first bytes say so). ``name`` stands for
    the file in messages (a URL for a download; default the path).

    Raises
    ------
    ProbeError
        ``file:line: what is wrong`` for a wrong column count, a non-integer or out-of-range
        head, a sentence with no root or several, or a cycle; or when the file cannot be read.
    """
    path = Path(path)
    name = name or str(path)
    try:
        with _text(path) as lines:
            yield from _parse(lines, name)
    except (OSError, UnicodeDecodeError, EOFError, zlib.error) as e:
        raise ProbeError(f"cannot read treebank {name}: {e}") from e


def _text(path: Path, errors: str = "strict") -> io.TextIOWrapper:
    """The file's lines, ungzipped when it is gzip (by its first bytes: a pipe or a download's
    temporary file has no telling name); a byte-order mark is no column."""
    raw = open(read_from(path), "rb")  # noqa: SIM115 (closed by the wrapper returned)
    try:
        binary = gzip.GzipFile(fileobj=raw) if raw.peek(2)[:2] == b"\x1f\x8b" else raw
        return io.TextIOWrapper(binary, encoding="utf-8-sig", errors=errors)
    except BaseException:
        raw.close()
        raise


def _parse(lines: Iterable[str], name: str) -> Iterator[Sentence]:
    rows: list[tuple[int, list[str]]] = []
    sent_id = document = ""
    entity_fields: tuple[str, ...] = ()
    for number, line in enumerate(chain(lines, [""]), start=1):
        line = line.rstrip("\r\n")
        if not line.strip():
            if rows:
                sentence = _sentence(rows, name, sent_id)
                sentence.document, sentence.entity_fields = document, entity_fields
                yield sentence
            rows, sent_id = [], ""
        elif line.startswith("#"):
            key, _, value = line[1:].partition("=")
            key, value = key.strip(), value.strip()
            if key == "sent_id":
                sent_id = value
            elif key in ("newdoc", "newdoc id"):
                document = value or f"{name}:{number}"  # a document without an id
            elif key == "global.Entity":
                entity_fields = tuple(value.split("-"))
        else:
            cols = line.split("\t")
            if len(cols) != 10:
                raise ProbeError(
                    f"{name}:{number}: expected 10 tab-separated columns, found {len(cols)}"
                )
            if "-" in cols[0] or "." in cols[0]:
                continue  # multiword-token range or empty node: not a word of the basic tree
            rows.append((number, cols))


def _sentence(rows: list[tuple[int, list[str]]], name: str, sent_id: str) -> Sentence:
    n = len(rows)
    words, heads, relations, upos, feats, entity = [], [], [], [], [], []
    for i, (number, cols) in enumerate(rows, start=1):
        if cols[0] != str(i):
            raise ProbeError(f"{name}:{number}: word ID {cols[0]!r} out of sequence, expected {i}")
        try:
            head = int(cols[6])
        except ValueError:
            raise ProbeError(f"{name}:{number}: head {cols[6]!r} is not an integer") from None
        if head == i:
            raise ProbeError(f"{name}:{number}: word {i} is its own head (a tree has no loops)")
        if not 0 <= head <= n:
            raise ProbeError(f"{name}:{number}: head {head} out of range for a {n}-word sentence")
        relation = cols[7].split(":")[0]
        if relation not in RELATIONS:
            raise ProbeError(
                f"{name}:{number}: unknown relation {cols[7]!r} (not a UD v2 universal relation)"
            )
        if (relation == "root") != (head == 0):
            raise ProbeError(f"{name}:{number}: only the root (head 0) has relation 'root'")
        # (most words have no Entity: their MISC column need not be taken apart)
        brackets = _misc(cols[9]).get("Entity", "") if "Entity=" in cols[9] else ""
        if brackets and not ENTITY_BRACKETS.fullmatch(brackets):
            raise ProbeError(
                f"{name}:{number}: malformed Entity={brackets!r} (CorefUD brackets expected, "
                "e.g. (3-person-new, 3) or (3-person-new))"
            )
        words.append(cols[1])
        heads.append(head - 1)
        relations.append(relation)
        upos.append(cols[3])
        feats.append(cols[5])
        entity.append(brackets)
    roots = [i for i, h in enumerate(heads) if h < 0]
    first_line = rows[0][0]
    if len(roots) != 1:
        found = "no root" if not roots else f"{len(roots)} roots"
        raise ProbeError(
            f"{name}:{first_line}: sentence has {found} (head 0); it needs exactly one"
        )
    _check_acyclic(heads, rows, name)
    return Sentence(words, heads, relations, upos, sent_id, name, feats=feats, entity=entity)


def _check_acyclic(heads: list[int], rows: list[tuple[int, list[str]]], name: str) -> None:
    """Every word's chain of heads reaches the root: linear time, each word walked once (a word
    whose chain is known to reach the root ends the walks that meet it)."""
    ROOTED, WALKING = 1, 2
    state = [0] * len(heads)
    for i in range(len(heads)):
        path, j = [], i
        while j >= 0 and not state[j]:
            state[j] = WALKING
            path.append(j)
            j = heads[j]
        if j >= 0 and state[j] == WALKING:
            raise ProbeError(f"{name}:{rows[i][0]}: word {i + 1} is in a cycle of heads")
        for k in path:
            state[k] = ROOTED


def _misc(column: str) -> dict[str, str]:
    """The MISC column's ``Key=Value`` attributes (``_`` is none)."""
    return dict(item.partition("=")[::2] for item in column.split("|") if "=" in item)


def download_ud(spec: str) -> list[Path]:
    """The local files of ``ud:<treebank>[-dev|-test]``, downloaded once into the cache.

    ``ud:en_ewt`` is the dev split (the one to analyse; keep test for final figures). The file
    comes from the pinned release, is checked against its SHA-256, and appears in the cache
    whole or not at all.
    """
    name = spec.removeprefix("ud:")
    treebank, _, split = name.partition("-")
    split = split or "dev"
    if treebank not in UD_TREEBANKS or split not in UD_TREEBANKS[treebank].sha256:
        known = ", ".join(
            f"ud:{t}[-{'|-'.join(source.sha256)}]" for t, source in UD_TREEBANKS.items()
        )
        raise ProbeError(f"unknown treebank {spec!r}; known: {known}, or a .conllu path")
    source = UD_TREEBANKS[treebank]
    file = f"{treebank}-ud-{split}.conllu"
    target = cache_dir() / "ud" / source.release / file
    mirror = os.environ.get("PROBE_UD_MIRROR", UD_BASE).rstrip("/")
    url = f"{mirror}/{source.repo}/{source.release}/{file}"
    checks = {"sha256": source.sha256[split], "validate": check_conllu}
    return [fetch(url, target, what=f"ud:{treebank}-{split} ({source.release})", **checks)]


def download_url(spec: str) -> list[Path]:
    """The local file of an ``http(s)://`` CoNLL-U URL (``#sha256=<hex>`` to pin it),
    downloaded once into the cache; it must read as CoNLL-U before it is kept."""
    url, _, fragment = spec.partition("#")
    sha256 = fragment.removeprefix("sha256=") if fragment.startswith("sha256=") else None
    if fragment and sha256 is None:
        raise ProbeError(f"{spec}: the only fragment a treebank URL takes is #sha256=<hex>")
    key = hashlib.sha256(spec.encode()).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", url.rstrip("/").rsplit("/", 1)[-1]) or "treebank"
    return [fetch(url, cache_dir() / "url" / key / name, sha256=sha256, validate=check_conllu)]


def treebank_paths(specs: str | Path | Iterable[str | Path] | None = None) -> list[Path]:
    """The local files of ``.conllu`` paths (``.conllu.gz`` too), ``ud:`` names and
    ``http(s)://`` URLs (downloaded once), pipes (``<(zcat x.conllu.gz)``: read once, into a
    copy, ``probe.inputs.pipes``), and the bundled ``sample`` and ``ewt-dev``; None is ``ewt-dev``.
    Checks that each exists, so a run fails before any compute starts."""
    if specs is None:
        specs = [EWT_DEV]
    elif isinstance(specs, str | Path):
        specs = [specs]
    paths = []
    for spec in specs:
        text = str(spec)
        if text in BUNDLED:
            paths.append(BUNDLED[text])
            continue
        if text.startswith("ud:"):
            found = download_ud(text)
        elif text.startswith(("http://", "https://")):
            found = download_url(text)
        else:
            found = [Path(spec)]
        for path in found:
            if path.is_dir():
                raise ProbeError(f"treebank {path} is a folder; give its .conllu file(s)")
            if is_pipe(path) or read_from(path) != path:  # read once, into a copy
                path = copy_pipe(path)
            elif path.exists() and not path.is_file():
                raise ProbeError(
                    f"treebank {path} is a device, not a file or a pipe; give a .conllu file "
                    "(a .conllu.gz is read as it is)"
                )
            elif not path.is_file():
                raise ProbeError(
                    f"treebank {path} does not exist (give a .conllu file or ud:en_ewt)"
                )
            paths.append(path)
    return paths


def iter_treebank(paths: Iterable[Path]) -> Iterator[Sentence]:
    """The sentences of several CoNLL-U files, one after another, read lazily."""
    for path in paths:
        yield from iter_conllu(path)


def count_sentences(paths: Iterable[Path]) -> int:
    """How many sentences the CoNLL-U files hold, counted without parsing them (a progress
    bar's total): a sentence is a block of lines with at least one that is not a comment."""
    count = 0
    for path in paths:
        try:
            with _text(Path(path), errors="replace") as lines:
                in_sentence = False
                for line in lines:
                    if not line.strip():
                        count += in_sentence
                        in_sentence = False
                    elif not line.startswith("#"):
                        in_sentence = True
                count += in_sentence
        except (OSError, EOFError, zlib.error) as e:
            raise ProbeError(f"cannot read treebank {path}: {e}") from e
    return count


def load_treebank(specs: str | Path | Iterable[str | Path] | None = None) -> list[Sentence]:
    """All sentences of the treebanks ``treebank_paths`` finds (None: EWT dev, bundled)."""
    paths = treebank_paths(specs)
    sentences = list(iter_treebank(paths))
    if not sentences:
        raise ProbeError(f"no sentences in {', '.join(map(str, paths))}")
    return sentences
