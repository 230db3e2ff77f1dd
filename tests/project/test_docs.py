"""The docs say what the code says: the generated references (``docs/generate.py``) list every
hook point, analysis, table, option and public name; the hook points' declared shapes are what a
trace captures; facts are written once (in the code), and the pages' copies of them, between
markers, are what the code gives now; no page points outside the repository or shows a raw
placeholder; the site loads nothing from the web; the front page stays short."""

import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import transformers as tf
from models import CONFIGS, SEQ2SEQ, seq2seq_batch

import probe
from probe.capture.names import _POINTS, describe, known_points, point_of

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").rglob("*.md"))
README = ROOT / "README.md"
NAV_CONFIG = ROOT / "mkdocs.yml"


def _generator():
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate = _generator()


def test_every_hook_point_has_a_shape_and_a_meaning():
    points = known_points()
    assert len(points) == len(set(points)) > 40
    for point in points:
        shape, meaning = describe(point)
        assert shape.startswith("[") and shape.endswith("]") and meaning, point
    used = {p.rpartition(".")[2] for p in points}
    assert set(_POINTS) == used, "a described point that probe does not name, or the reverse"
    with pytest.raises(ValueError, match="unknown hook point"):
        describe("hook_nothing")


# Sizes of tests/support/models.py's small models, by the dimension names of the declared shapes.
SIZES = {"batch": {3}, "head": {4}, "kv_head": {2, 4}, "d_head": {8}, "d_model": {32},
         "d_vocab": {99}, "1": {1}}  # fmt: skip
MLP = {"gpt2": 128, "t5": 64, "bart": 64}


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen3", "gemma2", "bert", "phi3", "bart", "t5"])
def test_the_declared_shapes_are_the_traced_ones(kind):
    """Every point a traced model has holds a tensor of the shape ``describe`` declares, each
    dimension the size its name says (positions: the source's or the target's)."""
    torch.manual_seed(0)
    config = (CONFIGS | SEQ2SEQ)[kind]()
    if kind in SEQ2SEQ:
        model = tf.AutoModelForSeq2SeqLM.from_config(config)
        inputs, positions = seq2seq_batch(), {7, 6}
    else:
        auto = tf.AutoModelForMaskedLM if kind == "bert" else tf.AutoModelForCausalLM
        ids = torch.randint(3, 99, (3, 7), generator=torch.Generator().manual_seed(0))
        model, inputs, positions = auto.from_config(config), {"input_ids": ids}, {7}
    sizes = SIZES | {"pos": positions, "q_pos": positions, "k_pos": positions}
    sizes |= {"d_mlp": {MLP.get(kind, 64)}}
    with torch.no_grad(), probe.trace(model.eval()) as cache:
        model(**inputs)
    checked = 0
    for name, tensor in cache.items():
        point = point_of(name)
        if kind == "t5" and point == "hook_pos_embed":
            continue  # T5's relative position bias, [q_pos, k_pos, head], as its meaning says
        dims = describe(point).shape.strip("[]").split(", ")
        assert tensor.dim() == len(dims), (name, tuple(tensor.shape), dims)
        for size, dim in zip(tensor.shape, dims, strict=True):
            assert size in sizes[dim], (name, tuple(tensor.shape), dims)
        checked += 1
    assert checked > 50


def test_the_hook_reference_lists_every_point_with_its_architectures():
    page = generate.hooks_page()
    for point in known_points():
        assert f"| `{point}` | `{describe(point).shape}` |" in page, point
    every = generate.points_by_architecture()
    assert (
        every["hook_rot_q"] >= {"llama", "gpt_neox", "qwen3"} and "gpt2" not in every["hook_rot_q"]
    )
    assert every["hook_cross_attn_out"] == {"bart", "mbart", "marian", "t5", "flan-t5"}
    assert "none of these" not in page  # every point some architecture has


def test_the_analysis_reference_lists_every_analysis_table_column_option_and_role():
    import analyses
    from probe.inputs import units

    page = generate.analyses_page()
    for name in analyses.REGISTRY:
        cls = analyses.get(name)
        assert f"## `{name}`" in page
        for table, schema in cls.tables.items():
            assert f"`{table}.csv`" in page
            assert all(f"`{column}` ({kind})" in page for column, kind in schema.items())
        assert all(f"`{column}`" in page for column in cls.head_columns)
        assert all(f"| `{option.flag}` |" in page for option in cls.options)
    for name in units.UNITS:
        assert all(f"| `{o.flag}` |" in page for o in units.get(name).options)
    for role in ("syntactic", "previous-token", "sink", "induction", "copying", "retrieval"):
        assert f"- `{role}`: " in page


def test_the_command_line_reference_lists_every_option():
    page = generate.cli_page()
    for name, command in generate._commands().items():
        assert f"## `probe {name}`" in page
        for param in command.params:
            if param.param_type_name == "option":
                assert f"`{param.opts[0]}`" in page, (name, param.opts)


def test_the_api_reference_names_every_public_name():
    page = generate.api_page()
    for name, module in probe._EXPORTS.items():
        assert f"::: {module}.{name}\n" in page
    generate.API_GROUPS += (("Stray", ("not_public",)),)
    try:
        with pytest.raises(ValueError, match="not_public"):
            generate.api_page()
    finally:
        generate.API_GROUPS = generate.API_GROUPS[:-1]


def test_facts_come_from_the_code_and_an_unknown_one_fails():
    from probe.app import examples
    from probe.inputs.treebank import BUNDLED_SENTENCES, UD_TREEBANKS

    facts = generate.facts()
    assert facts["ud.en_gum.release"] == UD_TREEBANKS["en_gum"].release
    assert facts["cards.candidates"] == str(examples.N_CANDIDATES)
    assert facts["ewt_dev.sentences"] == f"{BUNDLED_SENTENCES['ewt-dev']:,}"  # counted, checked
    assert facts["sample.sentences"] == str(BUNDLED_SENTENCES["sample"])
    stale = "first <!-- generated: cards.candidates -->16<!-- end --> sentences"
    assert (
        generate.fill(stale, "x")
        == "first <!-- generated: cards.candidates -->32<!-- end --> sentences"
    )
    coded = "by default <!-- generated: cli.device (code) -->?<!-- end -->"
    assert (
        generate.fill(coded, "x")
        == "by default <!-- generated: cli.device (code) -->`cpu`<!-- end -->"
    )
    assert generate.unmarked(generate.fill(coded, "x")) == "by default `cpu`"
    block = "text\n\n<!-- generated: design.layers -->\nold\n<!-- end -->\n"
    assert generate.fill(block, "x").endswith(f"-->\n\n{facts['design.layers']}\n\n<!-- end -->\n")
    with pytest.raises(KeyError, match=r"page\.md: unknown fact cards\.nothing"):
        generate.fill("a <!-- generated: cards.nothing -->1<!-- end -->", "page.md")


def test_a_fact_that_starts_a_line_or_a_placeholder_is_refused():
    """A region at a line's start inside a paragraph would start a block of HTML there (GitHub and
    the site would break the paragraph), and one inside a code span would show its markers; a
    ``{{ name }}`` would show as written on GitHub."""
    with pytest.raises(ValueError, match=r"page\.md:2: the fact cli\.seed starts a line"):
        generate.fill(
            "the seed, by default\n  <!-- generated: cli.seed -->0<!-- end -->.", "page.md"
        )
    with pytest.raises(ValueError, match=r"page\.md:1: the fact cli\.seed is inside a code span"):
        generate.fill("`x`, `--seed <!-- generated: cli.seed -->0<!-- end -->`", "page.md")
    assert generate.fill("`x`, `--seed` <!-- generated: cli.seed -->0<!-- end -->", "-")  # outside
    with pytest.raises(ValueError, match=r"\{\{ cli\.seed \}\} is shown as written"):
        generate.fill("the seed, by default {{ cli.seed }}.", "page.md")


@pytest.mark.slow
def test_the_pages_facts_are_what_the_code_gives_now():
    """``python docs/generate.py --write`` has been run since the code last changed a fact; each
    page the README links to shows its facts written out, no placeholder."""
    stale = [str(p.relative_to(ROOT)) for p in generate.stale()]
    assert not stale, f"stale facts in {stale}: run python docs/generate.py --write"
    linked = {
        README.parent / link for link in re.findall(r"\]\((docs/[^)#]+\.md)", README.read_text())
    }
    assert len(linked) >= 10 and linked <= set(generate.marked_pages())
    for path in generate.marked_pages():
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"\{\{.*?\}\}", text), path
        assert generate.unmarked(text).count("<!-- generated") == 0


def test_facts_are_not_copied_into_the_pages():
    """Release numbers, the bundled treebanks' sizes and the cards' sentences are written by
    ``docs/generate.py`` between markers, never by hand, in the docs, the README and the reports'
    README."""
    from probe.app import examples

    copied = re.compile(
        rf"\br2\.\d+|\b2,001\b|first {examples.N_CANDIDATES}\b|first 16\b"
        r"|\b76 (?:hand-written|sent)"
    )
    for path in [*PAGES, README, ROOT / "reports" / "README.md"]:
        by_hand = generate.REGION.sub("", path.read_text(encoding="utf-8"))
        found = copied.findall(by_hand)
        assert not found, f"{path.relative_to(ROOT)} writes out {found}: mark the fact instead"


def test_nothing_points_outside_the_repository():
    for path in [*PAGES, README, *(ROOT / "docs" / "tutorials").glob("*.py")]:
        assert "../shared" not in path.read_text(encoding="utf-8"), path


def test_the_front_page_is_short_and_says_how_to_set_up_run_and_test():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    for command in ("pip install", "probe analyze", "python -m pytest -q", '-m "not slow"'):
        assert command in text, command
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / link).exists(), link


def test_ci_runs_the_readmes_test_command():
    """.ci/run ends with the README's first test command, so that the time the README gives is
    the time CI takes."""
    readme = next(line.split("#")[0].strip() for line in README.read_text().splitlines()
                  if line.strip().startswith("python -m pytest"))  # fmt: skip
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1].strip() == readme == "python -m pytest -q"


def test_the_site_check_finds_a_link_to_nothing(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b.png").write_bytes(b"")
    page = tmp_path / "a" / "index.html"
    page.write_text('<h2 id="x">X</h2><a href="../b.png">b</a> <a href="../a/#x">a</a>')
    generate.on_post_build({"site_dir": str(tmp_path)})  # both exist
    page.write_text('<a href="../missing/">gone</a>')
    with pytest.raises(ValueError, match=r"a/index\.html: \.\./missing/"):
        generate.on_post_build({"site_dir": str(tmp_path)})


def test_the_site_check_finds_an_anchor_a_page_lacks(tmp_path):
    """As a notebook's table of contents did: ``#and`` for a heading whose id was another."""
    page = tmp_path / "index.html"
    page.write_text('<a href="#and">and</a><h2 id="run_with_cache-and-probetrace">…</h2>')
    with pytest.raises(ValueError, match=r"index\.html: #and"):
        generate.on_post_build({"site_dir": str(tmp_path)})
    page.write_text('<a href="#x">x</a><a href="./#x">x</a><a href="#">top</a><h2 id="x">…</h2>')
    generate.on_post_build({"site_dir": str(tmp_path)})


def test_the_site_asks_the_web_for_no_font():
    """Material asks Google Fonts for its fonts unless told not to; offline, every page would
    wait for them. The build's check refuses a page that loads anything from the web."""
    import yaml

    config = yaml.load(NAV_CONFIG.read_text(encoding="utf-8"), Loader=yaml.BaseLoader)
    assert config["theme"]["font"] == "false"


def test_the_site_check_finds_a_font_from_the_web(tmp_path):
    page = tmp_path / "index.html"
    fonts = '<link rel="stylesheet" href="https://fonts.googleapis.com/css?family=Roboto">'
    page.write_text(f"<head>{fonts}</head><a href='https://github.com'>a link is fine</a>")
    with pytest.raises(ValueError, match=r"index\.html: loads https://fonts\.googleapis"):
        generate.on_post_build({"site_dir": str(tmp_path)})


def _screenshots():
    spec = importlib.util.spec_from_file_location("screenshots", ROOT / "docs" / "screenshots.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium")
def test_the_screenshot_script_draws_a_card_and_refuses_a_head_the_pages_misname(
    sample_report, tmp_path
):
    """``docs/screenshots.py`` crops card.png to the card it names; the picture is not blank."""
    from matplotlib import image

    screenshots = _screenshots()
    report = tmp_path / "report"  # the script writes card.html beside the page: not the shared one
    shutil.copytree(sample_report, report)
    screenshots.card(report, "4-7", tmp_path, tmp_path / "profile")
    pixels = image.imread(tmp_path / "card.png")[..., :3]
    assert pixels.shape[1] == screenshots.CARD_WIDTH and 300 < pixels.shape[0] < 1500
    assert pixels.std() > 0.05 and (pixels.mean(-1) < 0.9).mean() > 0.02  # text and figures
    with pytest.raises(SystemExit, match="best relation is"):
        screenshots.card(report, "0-2", tmp_path, tmp_path / "profile")  # previous-token


def test_the_default_memory_budget_is_written_once_in_the_code():
    """``max_bytes``'s default (a share of the free memory, ``MAX_BYTES`` where that cannot be
    read: ``probe.options.MAX_BYTES``, also ``--circuit-max-bytes``'s default) is written once in
    the code; every page and tutorial that gives the default takes it
    from there, between markers, and none writes a size as the default by hand."""
    from analyses.circuit import BUDGET
    from probe.interventions.gradients import FREE_SHARE, MAX_BYTES

    assert BUDGET.default == MAX_BYTES
    assert generate.facts()["circuits.max_bytes"] == f"{MAX_BYTES / 2**30:g} GiB"
    assert generate.facts()["circuits.free_share"] == f"{FREE_SHARE:.0%}"
    tutorial = ROOT / "docs" / "tutorials" / "circuits.py"
    assert tutorial in generate.marked_pages()
    for path in (tutorial, ROOT / "docs" / "guide" / "python.md"):
        text = path.read_text(encoding="utf-8")
        assert generate.fill(text, path.name) == text, f"{path.name}: stale; generate.py --write"
        assert "generated: circuits.free_share" in text and "generated: circuits.max_bytes" in text
    by_default = re.compile(r"\d+(?:\.\d+)? ?[KMGT]i?B\)? by default"
                            r"|by default,? \(?\d+ ?[KMGT]i?B"
                            r"|by default,? half", re.IGNORECASE)  # fmt: skip
    for path in generate.marked_pages():
        by_hand = generate.REGION.sub("", path.read_text(encoding="utf-8"))
        found = by_default.findall(by_hand)
        assert not found, f"{path.relative_to(ROOT)} writes {found}: mark the fact instead"


def test_the_screenshot_script_without_chromium_says_so_before_the_analysis(monkeypatch):
    """No Chromium: one line at once, no half-minute of analysis first."""
    screenshots = _screenshots()
    monkeypatch.setattr(screenshots.shutil, "which", lambda name: None)
    monkeypatch.setattr(sys, "argv", ["screenshots.py"])
    ran = []
    monkeypatch.setattr(screenshots, "analyze", lambda folder: ran.append(folder))
    with pytest.raises(SystemExit, match="headless Chromium is needed"):
        screenshots.main()
    assert ran == []
