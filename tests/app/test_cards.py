"""The report's head cards: the sentences each head shows (right ones first), the patterns kept
for them against the model's own, the gold arcs worked out by hand, and the cards driven in
headless Chromium (every card drawn, a sentence picked from a card's menu)."""

import base64
import json
import re

import numpy as np
import pytest
import torch
from browser import chromium, console_messages, needs_chromium

import probe
from probe.app import examples as examples_io
from probe.app.examples import COREFERENCE, Examples, _Candidate, coreference_links
from probe.app.report import gold_arcs, head_view
from probe.heads import HeadId
from probe.inputs.treebank import Sentence

pytestmark = pytest.mark.slow  # runs real models or the whole command line

# Reads every card's view as the page left it, then picks another sentence in the first card
# that has several.
DRIVER = """<pre id="result"></pre><script>
(function () {
  const views = [...document.querySelectorAll("article.head .probe-view")], out = {};
  out.cards = views.length;
  out.started = views.filter((v) => v.probeView && v.probeView.draws >= 1).length;
  out.views = views.map((v) => v.probeView.view);
  const data = (v) => JSON.parse(v.querySelector("script.probe-data").textContent);
  out.withArcs = views.filter((v) => data(v).sentences[0].arcs.length > 0).length;
  const card = views.find((v) => !v.querySelector("[data-role=sentence]").hidden);
  const caption = () => card.querySelector("[data-role=caption]").textContent;
  out.before = [card.probeView.sentence, caption()];
  const menu = card.querySelector("[data-role=sentence]");
  menu.value = "1";
  menu.dispatchEvent(new Event("change"));
  out.after = [card.probeView.sentence, caption()];
  out.expected = data(card).sentences[1].caption;
  out.layerMenuHidden = card.querySelector("[data-role=layer]").hidden;
  document.getElementById("result").textContent = JSON.stringify(out);
})();
</script>"""


def test_gold_arcs_by_hand():
    sentence = {
        "words": ["She", "gave", "books"],
        "heads": [1, -1, 1],
        "relations": ["nsubj", "root", "obj"],
        "tokens": ["[CLS]", "she", "ga", "##ve", "books", "[SEP]"],
        "word_of_token": [-1, 0, 1, 1, 2, -1],
    }
    assert gold_arcs(sentence, None, None) == [(1, 2), (4, 2)]  # every arc, dependent -> head
    assert gold_arcs(sentence, "nsubj", "dependent_to_head") == [(1, 2)]
    assert gold_arcs(sentence, "obj", "head_to_dependent") == [(2, 4)]
    assert gold_arcs(sentence, "amod", "dependent_to_head") == []


def _sentence(words, heads, relations, entity=None) -> Sentence:
    fields = ("eid", "etype", "infstat", "minspan", "link")
    return Sentence(words, heads, relations, upos=["PRON" if w in ("It", "it") else "NOUN"
                    for w in words], feats=["_"] * len(words), entity=entity or [""] * len(words),
                    entity_fields=fields)  # fmt: skip


def test_coreference_links_and_arcs_by_hand():
    """The last word of "It sorted them , and they liked it" is linked to the first."""
    words = ["It", "sorted", "them", ",", "and", "they", "liked", "it"]
    entity = ["(8-object-giv-1-coref)", "", "(9-object-giv-1-coref)", "", "", "", "",
              "(8-object-giv-1-coref)"]  # fmt: skip
    heads, relations = [1, -1, 1, 6, 6, 6, 1, 6], ["nsubj", "root", "obj", "punct", "cc",
                                                  "nsubj", "conj", "obj"]  # fmt: skip
    sentence = _sentence(words, heads, relations, entity)
    assert coreference_links(sentence) == [(7, [0])]
    tokens = {"word_of_token": [-1, *range(8), -1], "heads": heads, "relations": relations,
              "coreference": [(7, [0])]}  # fmt: skip
    assert gold_arcs(tokens, COREFERENCE, "dependent_to_head") == [(8, 1)]
    unclosed = _sentence(words, heads, relations, ["(8-object-giv-1-coref", *[""] * 7])
    assert coreference_links(unclosed) == []  # a mention running past the sentence: no link


def test_choosing_by_hand():
    """Two heads over three candidate sentences whose predictions are set by hand: the
    syntactic head leads with the sentence where it is right most often and skips the one
    without its relation; the coreference head is shown on the sentence with a link."""
    import pandas as pd

    plain = _sentence(["a", "b", "c", "d", "e"], [1, -1, 1, 1, 1], ["det", "root", "obj", "obj",
                      "punct"])  # fmt: skip
    words = ["It", "sorted", "them", ",", "and", "they", "liked", "it"]
    entity = ["(8-object-giv-1-coref)", "", "", "", "", "", "", "(8-object-giv-1-coref)"]
    linked = _sentence(words, [1, -1, 1, 6, 6, 6, 1, 6], ["nsubj", "root", "obj", "punct", "cc",
                       "nsubj", "conj", "obj"], entity)  # fmt: skip
    no_obj = _sentence(["x", "y", "z", "w", "v"], [1, -1, 1, 1, 1], ["det", "root", "nsubj",
                       "nsubj", "punct"])  # fmt: skip
    examples = Examples(None, 1, 2)
    for index, sentence in enumerate([plain, linked, no_obj]):
        n = len(sentence.words)
        pattern, predicted = np.zeros((1, 2, n, n), np.float32), np.zeros((2, 1, 2, n), np.int64)
        examples.candidates[index] = _Candidate(
            index, sentence, ["t"] * n, list(range(n)), pattern, predicted
        )
    examples.candidates[0].predicted[0, 0, 0] = [1, 0, 1, 0, 1]  # obj: 1 of 2 right
    examples.candidates[1].predicted[0, 0, 0] = [1, 0, 1, 0, 0, 0, 0, 6]  # obj: 2 of 2
    examples.candidates[1].predicted[0, 0, 1, 7] = 0  # head 1 reads "it" -> "It"
    heads = pd.DataFrame({"layer": [0, 0], "head": [0, 1], "roles": ["syntactic", "coreference"],
                          "best_relation": ["obj", ""], "best_relation_direction":
                          ["dependent_to_head", ""]})  # fmt: skip
    chosen = examples.choose(heads)["heads"]
    assert chosen["0.0"] == {
        "relation": "obj",
        "direction": "dependent_to_head",
        "shown": [
            {"sentence": 1, "correct": 2, "words": 2},
            {"sentence": 0, "correct": 1, "words": 2},
        ],
    }
    assert chosen["0.1"]["relation"] == COREFERENCE
    assert chosen["0.1"]["shown"] == [{"sentence": 1, "correct": 1, "words": 1}]
    # the coreference head's card: its link drawn, its count in the caption
    kept = json.loads(json.dumps(examples.choose(heads)))  # as examples.json holds it
    for sentence, pattern in zip(kept["sentences"], examples.patterns().values(), strict=True):
        sentence["pattern"] = pattern.astype(np.float32)
    view, miss = head_view(kept, HeadId(0, 1))
    data = json.loads(re.search(r'class="probe-data">(.*?)</script>', view, re.S).group(1))
    assert miss is None and data["sentences"][0]["arcs"] == [[7, 0]]
    assert (
        "from 1 of 1 mention(s) it attends most to an antecedent" in data["sentences"][0]["caption"]
    )


def test_cards_lead_with_sentences_where_the_head_is_right(sample_report):
    examples = examples_io.read(sample_report)
    heads = examples["heads"]
    assert len(heads) == 6 * 12
    with_relation = [h for h in heads.values() if h["relation"]]
    assert with_relation, "the sample run has syntactic heads"
    html = (sample_report / "index.html").read_text()
    for key, head in heads.items():
        shown = head["shown"]
        assert 1 <= len(shown) <= examples_io.PER_HEAD
        assert len({s["sentence"] for s in shown}) == len(shown)
        if not head["relation"]:
            continue
        counts = [s["correct"] for s in shown]
        assert counts == sorted(counts, reverse=True)
        assert all(0 <= s["correct"] <= s["words"] for s in shown)
        for s in shown:  # the count is the gold arcs the head's predictions hit, recounted
            sentence = examples["sentences"][s["sentence"]]
            words = [i for i, r in enumerate(sentence["relations"]) if r == head["relation"]]
            assert s["words"] == sum(sentence["heads"][i] >= 0 for i in words)
        card = html[html.index(f'id="head-{key.replace(".", "-")}"') :]
        card = card[: card.index("</article>")]
        # a card never leads with a sentence where its head is wrong
        assert ('<details class="miss">' in card) == (counts[0] == 0), key


def test_kept_patterns_are_the_models(sample_report, minilm):
    model, tokenizer = minilm
    examples = examples_io.read(sample_report)
    assert len(examples["sentences"]) == examples_io.N_CANDIDATES
    indices = [s["index"] for s in examples["sentences"]]
    assert indices == sorted(indices)  # the treebank's first readable sentences, in order
    for sentence in examples["sentences"][:3]:
        ids = torch.tensor([tokenizer.convert_tokens_to_ids(sentence["tokens"])])
        with torch.no_grad(), probe.trace(model, "hook_pattern") as cache:
            model(input_ids=ids)
        expected = torch.stack([cache[f"blocks.{i}.attn.hook_pattern"][0] for i in range(6)])
        np.testing.assert_allclose(sentence["pattern"], expected.numpy(), atol=1e-3)
        words = {w for w in sentence["word_of_token"] if w >= 0}
        assert words == set(range(len(sentence["words"])))


def test_a_cards_view_holds_its_heads_pattern_and_arcs(sample_report):
    examples = examples_io.read(sample_report)
    html = (sample_report / "index.html").read_text()
    key, head = next((k, h) for k, h in examples["heads"].items() if h["relation"])
    card = html[html.index(f'id="head-{key.replace(".", "-")}"') :]
    data = re.search(r'class="probe-data">(.*?)</script>', card, re.S).group(1)
    view = json.loads(data)
    assert view["layers"] == view["heads"] == 1 and view["view"] == "both"
    layer, index = map(int, key.split("."))
    for shown, drawn in zip(head["shown"], view["sentences"], strict=True):
        sentence = examples["sentences"][shown["sentence"]]
        weights = np.frombuffer(base64.b64decode(drawn["weights"]), np.uint8) / 255
        expected = sentence["pattern"][layer, index].ravel()
        np.testing.assert_allclose(weights, expected, atol=0.5 / 255 + 1e-3)
        arcs = gold_arcs(sentence, head["relation"], head["direction"])
        assert [tuple(a) for a in drawn["arcs"]] == arcs and len(arcs) == shown["words"]
        assert f"gets {shown['correct']} of {shown['words']} {head['relation']}" in drawn["caption"]
    assert html.count("data/show.js") == 0 and html.count('"use strict"') == 1  # one script


@needs_chromium
def test_cards_in_chromium(sample_report, tmp_path):
    page = tmp_path / "report.html"
    html = (sample_report / "index.html").read_text()
    page.write_text(html.replace("</body>", DRIVER + "</body>"))
    done = chromium(page.as_uri(), tmp_path, "--dump-dom")
    assert console_messages(done.stderr) == []
    found = re.search(r'<pre id="result">(.*?)</pre>', done.stdout, re.S)
    assert found and found.group(1), "the driver did not run"
    seen = json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    assert seen["cards"] == seen["started"] == 72  # every card's view is drawn
    assert set(seen["views"]) == {"both"} and seen["withArcs"] == 72
    assert seen["before"][0] == 0 and seen["after"][0] == 1
    assert seen["after"][1] == seen["expected"] != seen["before"][1]
    assert seen["layerMenuHidden"] is True


def test_cards_without_a_relation_are_shown_on_different_sentences():
    """Four heads with no relation over four candidate sentences: each card leads with another
    sentence (the least shown so far), the longest first."""
    import pandas as pd

    examples = Examples(None, 1, 4)
    for index in range(4):
        n = 5 + index  # sentence 3 is the longest
        sentence = _sentence([f"w{i}" for i in range(n)], [1, -1, *[1] * (n - 2)],
                             ["det", "root", *["obj"] * (n - 2)])  # fmt: skip
        examples.candidates[index] = _Candidate(
            index, sentence, ["t"] * n, list(range(n)), np.zeros((1, 4, n, n), np.float32),
            np.zeros((2, 1, 4, n), np.int64),
        )  # fmt: skip
    none = [""] * 4
    heads = pd.DataFrame({"layer": [0] * 4, "head": range(4), "roles": none,
                          "best_relation": none, "best_relation_direction": none})  # fmt: skip
    chosen = examples.choose(heads)["heads"]
    leads = [chosen[f"0.{h}"]["shown"][0]["sentence"] for h in range(4)]
    assert leads[0] == 3 and sorted(leads) == [0, 1, 2, 3]
    assert [s["sentence"] for s in chosen["0.0"]["shown"]] == [3, 2, 1]


PAGE = """<pre id="page"></pre><script>
addEventListener("load", function () {
  var card = document.getElementById("head-2-3");
  document.getElementById("page").textContent = JSON.stringify({
    height: document.documentElement.scrollHeight,
    open: card.querySelector("details.body").open,
    layerOpen: card.closest("details.layer").open,
    closed: document.querySelectorAll("article.head details.body:not([open])").length});
});
</script>"""


@needs_chromium
def test_the_page_is_a_few_screens_until_a_head_is_opened(sample_report, tmp_path):
    """Closed, the report is a few screens (900 px each) high; a link to a head opens its card
    and its layer, and only those."""
    html = (sample_report / "index.html").read_text().replace("</body>", PAGE + "</body>")
    page = tmp_path / "page.html"
    page.write_text(html)
    seen = []
    for url in (page.as_uri(), page.as_uri() + "#head-2-3"):
        done = chromium(url, tmp_path, "--dump-dom")
        assert console_messages(done.stderr) == []
        found = re.search(r'<pre id="page">(.*?)</pre>', done.stdout, re.S)
        seen.append(json.loads(found.group(1).replace("&quot;", '"')))
    closed, opened = seen
    assert closed["height"] / 900 < 5 and closed["closed"] == 72 and not closed["open"]
    assert opened["open"] and opened["layerOpen"] and opened["closed"] == 71
    assert "S?" in html and "marks a role granted on its mean" in html  # the notation, explained
