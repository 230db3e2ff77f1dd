"""CoNLL-U reading and its error messages, the bundled sample, and the ud: source."""

import gzip
import hashlib
from dataclasses import replace
from pathlib import Path

import pytest

from probe.errors import ProbeError
from probe.inputs.treebank import (
    BUNDLED_SENTENCES,
    EWT_DEV,
    SAMPLE,
    UD_TREEBANKS,
    download_ud,
    load_treebank,
    read_conllu,
)

GOOD = """# sent_id = 1
# text = They don't sleep.
1\tThey\tthey\tPRON\tPRP\t_\t4\tnsubj\t_\t_
2-3\tdon't\t_\t_\t_\t_\t_\t_\t_\t_
2\tdo\tdo\tAUX\tVBP\t_\t4\taux\t_\t_
3\tn't\tnot\tPART\tRB\t_\t4\tadvmod\t_\t_
4\tsleep\tsleep\tVERB\tVB\t_\t0\troot\t_\t_
4.1\tthen\tthen\tADV\tRB\t_\t_\t_\t4:advmod\t_
5\t.\t.\tPUNCT\t.\t_\t4\tpunct\t_\t_

1\tYesterday\tyesterday\tNOUN\tNN\t_\t2\tobl:tmod\t_\t_
2\trained\train\tVERB\tVBD\t_\t0\troot\t_\t_
"""


def write(tmp_path, text, name="t.conllu"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_ranges_empty_nodes_and_subtypes(tmp_path):
    first, second = read_conllu(write(tmp_path, GOOD))
    assert first.words == ["They", "do", "n't", "sleep", "."]
    assert first.heads == [3, 3, 3, -1, 3]  # 0-based, -1 for the root
    assert first.relations == ["nsubj", "aux", "advmod", "root", "punct"]
    assert first.upos[-1] == "PUNCT" and first.sent_id == "1"
    assert second.relations == ["obl", "root"]


def line(head="2", rel="det", id_="1", cols=10):
    parts = [id_, "The", "the", "DET", "DT", "_", head, rel, "_", "_"]
    return "\t".join(parts[:cols])


ROOT = "2\tdog\tdog\tNOUN\tNN\t_\t0\troot\t_\t_"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            f"# c\n{line(cols=9)}\n{ROOT}\n",
            r"t\.conllu:2: expected 10 tab-separated columns, found 9",
        ),
        (f"{line(head='x')}\n{ROOT}\n", r"t\.conllu:1: head 'x' is not an integer"),
        (f"{line(head='7')}\n{ROOT}\n", r"t\.conllu:1: head 7 out of range"),
        (
            f"{line(head='2')}\n{ROOT.replace('0', '1', 1).replace('root', 'dep')}\n",
            "t.conllu:1: sentence has no root",
        ),
        (f"{line(head='0', rel='root')}\n{ROOT}\n", "t.conllu:1: sentence has 2 roots"),
        (
            "1\ta\ta\tX\tX\t_\t2\tdep\t_\t_\n2\tb\tb\tX\tX\t_\t1\tdep\t_\t_\n3\tc\tc\tX\tX\t_\t0\troot\t_\t_\n",
            "t.conllu:1: word 1 is in a cycle",
        ),
        (f"{line(rel='determiner')}\n{ROOT}\n", "t.conllu:1: unknown relation 'determiner'"),
        (f"{line(id_='3')}\n{ROOT}\n", r"t\.conllu:1: word ID '3' out of sequence"),
    ],
)
def test_malformed_files_name_file_and_line(tmp_path, text, message):
    with pytest.raises(ProbeError, match=message):
        read_conllu(write(tmp_path, text))


def test_unreadable_and_missing_files(tmp_path):
    with pytest.raises(ProbeError, match="does not exist"):
        load_treebank([tmp_path / "nope.conllu"])
    bad = tmp_path / "bad.conllu"
    bad.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ProbeError, match="cannot read treebank"):
        read_conllu(bad)


def test_bundled_treebanks():
    """The default is EWT dev, gzipped in the package: the facts its README gives, and the
    same sentences as the copy beside the project where there is one."""
    ewt = load_treebank()
    # The data README says 25,149 words; the file has 25,147 lines with an integer ID.
    assert len(ewt) == BUNDLED_SENTENCES["ewt-dev"] == 2001
    assert sum(len(s.words) for s in ewt) == 25147
    # It is the dev split of the release probe pins for ud:en_ewt, which the docs name.
    digest = hashlib.sha256(gzip.decompress(EWT_DEV.read_bytes())).hexdigest()
    assert digest == UD_TREEBANKS["en_ewt"].sha256["dev"]
    shared = Path(__file__).resolve().parents[3] / "shared/data/ud-english-ewt/en_ewt-ud-dev.conllu"
    if shared.exists():
        same = lambda sentences: [replace(s, source="") for s in sentences]  # noqa: E731
        assert same(read_conllu(shared)) == same(ewt)
    assert load_treebank("ewt-dev") == ewt


def test_bundled_sample_is_valid_and_varied():
    sentences = load_treebank("sample")
    assert len(sentences) == BUNDLED_SENTENCES["sample"]
    relations = {r for s in sentences for r in s.relations}
    expected = "nsubj obj det amod case obl nmod advmod aux cop mark cc conj compound xcomp ccomp"
    assert {*expected.split(), "acl", "advcl", "iobj", "expl"} <= relations
    assert read_conllu(SAMPLE) == sentences


def serve(monkeypatch, data: bytes) -> list[str]:
    """Answer every download with ``data``; returns the list of URLs asked for."""
    calls = []

    import email.message
    import io

    class Response(io.BytesIO):  # what fetch reads of http.client's: read1, headers, length
        headers, length = email.message.Message(), None

    def fake_urlopen(url, timeout):
        calls.append(getattr(url, "full_url", url))  # a urllib Request, or a plain URL
        return Response(data)

    monkeypatch.setattr("urllib.request.urlopen", fake_urlopen)
    return calls


def test_ud_source_downloads_once_atomically(tmp_path, monkeypatch):
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path))
    calls = serve(monkeypatch, GOOD.encode())
    pinned = UD_TREEBANKS["en_ewt"].sha256
    monkeypatch.setitem(pinned, "test", hashlib.sha256(GOOD.encode()).hexdigest())
    (path,) = download_ud("ud:en_ewt-test")
    assert path == tmp_path / "ud" / "r2.15" / "en_ewt-ud-test.conllu"
    assert calls == [
        "https://raw.githubusercontent.com/UniversalDependencies/UD_English-EWT/r2.15/en_ewt-ud-test.conllu"
    ]
    assert len(load_treebank(["ud:en_ewt-test"])) == 2 and len(calls) == 1  # cached
    assert [p.name for p in path.parent.iterdir()] == ["en_ewt-ud-test.conllu"]


def test_ud_source_offline_and_unknown(tmp_path, monkeypatch):
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path))

    def offline(url, timeout):
        raise OSError("network is unreachable")

    monkeypatch.setattr("urllib.request.urlopen", offline)
    with pytest.raises(ProbeError, match=r"cannot download ud:en_ewt.*offline"):
        download_ud("ud:en_ewt")
    assert not any(tmp_path.rglob("*.conllu"))
    with pytest.raises(ProbeError, match="unknown treebank 'ud:xx'"):
        download_ud("ud:xx")


def test_gum_download_is_pinned_and_checked(tmp_path, monkeypatch):
    """``ud:en_gum-test`` comes from UD r2.16; bytes that do not match the pinned SHA-256 are
    refused with one line, and nothing is left in the cache."""
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path))
    calls = serve(monkeypatch, GOOD.encode())  # not GUM: its checksum differs
    with pytest.raises(ProbeError, match=r"\(r2\.16\) from .* does not match its pinned SHA-256"):
        download_ud("ud:en_gum-test")
    assert calls == [
        "https://raw.githubusercontent.com/UniversalDependencies/UD_English-GUM/r2.16/en_gum-ud-test.conllu"
    ]
    assert not any(tmp_path.rglob("*.conllu*")) and not any(
        p.is_file() for p in tmp_path.rglob("*")
    )
