"""Input units (``probe.inputs.units``): each knows its size before reading, shards without overlap,
and counts what it read; the default output folder names its input; ``-q`` still says where
the report is."""

import gzip
import re

import pytest
from tokenizers_util import wordpiece
from treebanks import GUM, needs_gum
from typer.testing import CliRunner

from probe.app.cli import app
from probe.app.output import default_out
from probe.inputs import units
from probe.inputs.treebank import BUNDLED, SAMPLE, count_sentences, iter_treebank


def test_counting_sentences_without_parsing_agrees_with_parsing(tmp_path):
    crlf = tmp_path / "crlf.conllu"  # Windows line ends, comments, no blank line at the end
    crlf.write_bytes(b"# c\r\n1\ta\t_\tX\t_\t_\t0\troot\t_\t_\r\n\r\n# d\r\n"
                     b"1\tb\t_\tX\t_\t_\t0\troot\t_\t_")  # fmt: skip
    zipped = tmp_path / "sample.conllu.gz"
    zipped.write_bytes(gzip.compress(SAMPLE.read_bytes()))
    for paths in ([BUNDLED["ewt-dev"]], [SAMPLE], [crlf], [zipped, SAMPLE]):
        assert count_sentences(paths) == sum(1 for _ in iter_treebank(paths)), paths
    assert count_sentences([BUNDLED["ewt-dev"]]) == 2001


@needs_gum()
def test_counting_gum_as_parsing_does():
    paths = sorted(GUM.glob("*.conllu"))
    assert count_sentences(paths) == sum(1 for _ in iter_treebank(paths))


@pytest.mark.parametrize(
    ("shard", "stop", "max_sentences", "size"),
    [((0, 1), None, None, 76), ((0, 1), 10, None, 10), ((0, 1), 30, 20, 20),
     ((0, 2), None, None, 38), ((1, 2), None, 75, 37), ((2, 3), 10, None, 3)],
)  # fmt: skip
def test_the_sentence_unit_knows_its_size_and_reads_exactly_that(shard, stop, max_sentences, size):
    """The progress bar's total is what the unit then reads, in every process's share."""
    source = units.Source((SAMPLE,), max_sentences)
    unit = units.get("sentence")(source, wordpiece(), 512, shard=shard, stop=stop)
    assert unit.size() == size
    seen = [int(i) for batch in unit.batches(8) for i in batch.index]
    assert unit.tally()["read"] == size == len(seen) + sum(unit.tally()["skipped"].values())
    assert all(i % shard[1] == shard[0] for i in seen)


def test_shards_of_the_window_unit_add_up_to_the_whole():
    source = units.Source((SAMPLE,))
    make = lambda shard: units.get("window")(source, wordpiece(), 512, shard=shard)  # noqa: E731
    whole, first, second = make((0, 1)), make((0, 2)), make((1, 2))
    for unit in (whole, first, second):
        list(unit.batches(4))
    for count in ("documents", "windows", "mentions"):
        assert whole.tally()[count] == first.tally()[count] + second.tally()[count] > 0


def test_units_are_registered_and_light():
    """Each registered unit is a Unit with a name equal to its key; reading the registry and
    the options imports no torch (the run plans before loading it)."""
    for name in units.UNITS:
        cls = units.get(name)
        assert issubclass(cls, units.Unit) and cls.name == name and cls.label


def test_the_default_output_folder_names_its_input():
    assert default_out("minilm") == default_out("minilm", None) == default_out("minilm", [])
    assert str(default_out("minilm")) == "reports/minilm"
    assert str(default_out("minilm", ["sample"])) == "reports/minilm-sample"
    assert str(default_out("org/bert-base", ["ud:en_gum"])) == "reports/bert-base-en_gum"
    gum = "../shared/data/ud-english-gum/en_gum-ud-dev.conllu"
    assert str(default_out("minilm", [gum])) == "reports/minilm-en_gum-ud-dev"


def test_quiet_still_says_where_the_report_is(minilm, tmp_path):
    out = tmp_path / "r"
    args = ["analyze", "-m", "minilm", "-t", "sample", "-n", "8", "-a", "spectra,roles",
            "-o", str(out), "-q"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert re.fullmatch(rf"report: {re.escape(str(out / 'index.html'))}\n", result.output)


def test_progress_bars_get_each_units_total(minilm, tmp_path):
    """The run gives each unit's bar the total it knows (sentences: counted before reading)
    and sees that many items go by."""
    from probe.app.analyze import analyze
    from probe.app.plan import Settings

    seen = {}

    def progress(description, total):
        def wrap(batches):
            seen[description] = [total, 0]
            for batch in batches:
                seen[description][1] += len(batch)
                yield batch

        return wrap

    settings = Settings(model="minilm", treebank=["sample"], out=tmp_path / "r",
                        analyses=["roles", "coref"])  # fmt: skip
    analyze(settings, progress=progress)
    assert seen["analysing sentences"] == [76, 76]
    total, windows = seen["analysing coreference windows"]
    assert total is None and windows > 0
