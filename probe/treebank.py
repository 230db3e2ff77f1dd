"""Dependency treebanks in CoNLL-U: reading, validating, downloading UD, the bundled sample."""

from __future__ import annotations

import os
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

from probe.errors import ProbeError

SAMPLE = Path(__file__).parent / "data" / "sample.conllu"
UD_RELEASE = "r2.15"
UD_TREEBANKS = {"en_ewt": "UD_English-EWT"}
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
UD_URL = "https://raw.githubusercontent.com/UniversalDependencies/{repo}/{release}/{file}"


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


def read_conllu(path: str | Path) -> list[Sentence]:
    """Read and validate a whole CoNLL-U file (``iter_conllu`` streams it)."""
    return list(iter_conllu(path))


def iter_conllu(path: str | Path) -> Iterator[Sentence]:
    """Stream the sentences of a CoNLL-U file, validating each as it is read.

    Comment lines, multiword-token ranges (``3-4``) and empty nodes (``8.1``) are skipped.

    Raises
    ------
    ProbeError
        ``file:line: what is wrong`` for a wrong column count, a non-integer or out-of-range
        head, a sentence with no root or several, or a cycle; or when the file cannot be read.
    """
    path = Path(path)
    try:
        with path.open(encoding="utf-8") as lines:
            yield from _parse(lines, str(path))
    except (OSError, UnicodeDecodeError) as e:
        raise ProbeError(f"cannot read treebank {path}: {e}") from e


def _parse(lines: Iterable[str], name: str) -> Iterator[Sentence]:
    rows: list[tuple[int, list[str]]] = []
    sent_id = ""
    for number, line in enumerate(chain(lines, [""]), start=1):
        line = line.rstrip("\r\n")
        if not line.strip():
            if rows:
                yield _sentence(rows, name, sent_id)
            rows, sent_id = [], ""
        elif line.startswith("#"):
            if line.startswith("# sent_id"):
                sent_id = line.split("=", 1)[-1].strip()
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
    words, heads, relations, upos = [], [], [], []
    for i, (number, cols) in enumerate(rows, start=1):
        if cols[0] != str(i):
            raise ProbeError(f"{name}:{number}: word ID {cols[0]!r} out of sequence, expected {i}")
        try:
            head = int(cols[6])
        except ValueError:
            raise ProbeError(f"{name}:{number}: head {cols[6]!r} is not an integer") from None
        if not 0 <= head <= n or head == i:
            raise ProbeError(f"{name}:{number}: head {head} out of range for a {n}-word sentence")
        relation = cols[7].split(":")[0]
        if relation not in RELATIONS:
            raise ProbeError(
                f"{name}:{number}: unknown relation {cols[7]!r} (not a UD v2 universal relation)"
            )
        if (relation == "root") != (head == 0):
            raise ProbeError(f"{name}:{number}: only the root (head 0) has relation 'root'")
        words.append(cols[1])
        heads.append(head - 1)
        relations.append(relation)
        upos.append(cols[3])
    roots = [i for i, h in enumerate(heads) if h < 0]
    first_line = rows[0][0]
    if len(roots) != 1:
        found = "no root" if not roots else f"{len(roots)} roots"
        raise ProbeError(
            f"{name}:{first_line}: sentence has {found} (head 0); it needs exactly one"
        )
    for i in range(n):
        seen, j = set(), i
        while j >= 0:
            if j in seen:
                raise ProbeError(f"{name}:{rows[i][0]}: word {i + 1} is in a cycle of heads")
            seen.add(j)
            j = heads[j]
    return Sentence(words, heads, relations, upos, sent_id, name)


def cache_dir() -> Path:
    """Where downloaded treebanks are kept (``$PROBE_CACHE`` or ``~/.cache/probe``)."""
    base = (
        os.environ.get("PROBE_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "probe"
    )
    return Path(base)


def download_ud(spec: str) -> list[Path]:
    """The local files of ``ud:<treebank>[-dev|-test|-train]``, downloaded once into the cache.

    ``ud:en_ewt`` is the dev split (the one to analyse; keep test for final figures).
    """
    name = spec.removeprefix("ud:")
    treebank, _, split = name.partition("-")
    split = split or "dev"
    if treebank not in UD_TREEBANKS or split not in ("dev", "test", "train"):
        known = ", ".join(f"ud:{t}[-dev|-test|-train]" for t in UD_TREEBANKS)
        raise ProbeError(f"unknown treebank {spec!r}; known: {known}, or a .conllu path")
    file = f"{treebank}-ud-{split}.conllu"
    target = cache_dir() / "ud" / UD_RELEASE / file
    if not target.exists():
        url = UD_URL.format(repo=UD_TREEBANKS[treebank], release=UD_RELEASE, file=file)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            with urllib.request.urlopen(url, timeout=60) as response:
                data = response.read()
        except (urllib.error.URLError, OSError) as e:
            raise ProbeError(
                f"cannot download {spec} from {url} ({e}); offline, pass a local .conllu file "
                "with --treebank, or leave it out for the bundled sample"
            ) from e
        with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as tmp:
            tmp.write(data)
        os.replace(tmp.name, target)  # atomic: no half-written file in the cache
    return [target]


def treebank_paths(specs: str | Path | Iterable[str | Path] | None = None) -> list[Path]:
    """The local files of ``.conllu`` paths and ``ud:`` names (downloaded once); None is the
    bundled sample. Checks that each exists, so a run fails before any compute starts."""
    if specs is None:
        specs = [SAMPLE]
    elif isinstance(specs, str | Path):
        specs = [specs]
    paths = []
    for spec in specs:
        for path in download_ud(spec) if str(spec).startswith("ud:") else [Path(spec)]:
            if not path.is_file():
                raise ProbeError(
                    f"treebank {path} does not exist (give a .conllu file or ud:en_ewt)"
                )
            paths.append(path)
    return paths


def iter_treebank(paths: Iterable[Path]) -> Iterator[Sentence]:
    """The sentences of several CoNLL-U files, one after another, read lazily."""
    for path in paths:
        yield from iter_conllu(path)


def load_treebank(specs: str | Path | Iterable[str | Path] | None = None) -> list[Sentence]:
    """All sentences of ``.conllu`` paths and ``ud:`` names; None is the bundled sample."""
    paths = treebank_paths(specs)
    sentences = list(iter_treebank(paths))
    if not sentences:
        raise ProbeError(f"no sentences in {', '.join(map(str, paths))}")
    return sentences
