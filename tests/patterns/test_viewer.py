"""probe.show: the viewer's data against the model's patterns, and the page driven by a script
in headless Chromium (selectors, hover, the model view's click, a 1,200-token input)."""

import json
import re

import numpy as np
import pytest
import torch
from browser import chromium, console_messages, needs_chromium
from matplotlib import image as plt_image

import probe

HOSTILE = '</script><img src=x onerror="window.pwned=1">'

# Drives one view as a user would, and writes what it saw into <pre id="result">.
DRIVER = """<pre id="result"></pre><script>
(function () {
  const root = document.querySelector(".probe-view"), v = root.probeView, out = {};
  const canvas = root.querySelector("canvas");
  const $ = (r) => root.querySelector("[data-role=" + r + "]");
  const ink = () => {  // read a copy: the viewer's own canvas is never read back
    const copy = document.createElement("canvas");
    copy.width = canvas.width;
    copy.height = canvas.height;
    const g = copy.getContext("2d");
    g.drawImage(canvas, 0, 0);
    const d = g.getImageData(0, 0, copy.width, copy.height).data;
    let n = 0;
    for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++;
    return n;
  };
  const set = (role, value) => {
    $(role).value = value;
    $(role).dispatchEvent(new Event("change"));
  };
  const at = (x, y, type) => {
    const b = canvas.getBoundingClientRect();
    const where = {clientX: b.left + x, clientY: b.top + y, bubbles: true};
    canvas.dispatchEvent(new MouseEvent(type, where));
  };
  out.start = [v.view, v.layer, v.head, v.draws];
  set("layer", "1"); set("head", "2");
  out.selected = [v.layer, v.head];
  out.inkAll = ink();
  at(20, 5 + 18 * 3 + 9, "mousemove");
  out.hover = v.hover; out.inkHover = ink(); out.status = $("status").textContent;
  canvas.dispatchEvent(new MouseEvent("mouseleave"));
  out.afterLeave = v.hover;
  set("view", "heatmap"); out.inkMap = ink();
  set("view", "model"); out.inkModel = ink();
  at(40 + 70 + 10, 20 + 10, "click");
  out.clicked = [v.view, v.layer, v.head, $("view").value, $("layer").value, $("head").value];
  out.elements = document.querySelectorAll("*").length;
  out.images = document.querySelectorAll("img").length;
  out.pwned = window.pwned || 0;
  document.getElementById("result").textContent = JSON.stringify(out);
})();
</script>"""


def page(view, tmp_path, name="view.html"):
    path = view.save(tmp_path / name)
    path.write_text(path.read_text().replace("</body>", DRIVER + "</body>"))
    return path


def result(dom: str) -> dict:
    found = re.search(r'<pre id="result">(.*?)</pre>', dom, re.S)
    assert found and found.group(1), "the driver did not run"
    return json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))


def test_the_view_holds_the_models_patterns():
    import transformers as tf

    config = tf.BertConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                           intermediate_size=64, vocab_size=128)  # fmt: skip
    torch.manual_seed(0)
    model = tf.AutoModel.from_config(config).eval()
    tokenizer = _tokenizer()
    view = probe.show(model, tokenizer, ["the cat sat on the mat", "dogs bark"])
    for text, tokens, patterns in zip(["the cat sat on the mat", "dogs bark"], view.tokens,
                                      view.patterns, strict=True):  # fmt: skip
        inputs = tokenizer(text, return_tensors="pt")
        with torch.no_grad(), probe.trace(model, "hook_pattern") as cache:
            model(**inputs)
        assert tokens == tokenizer.convert_ids_to_tokens(inputs["input_ids"][0])
        expected = torch.stack([cache[f"blocks.{i}.attn.hook_pattern"][0] for i in range(2)])
        np.testing.assert_allclose(patterns, expected.numpy(), atol=1e-6)
    again = probe.show(cache, tokens)  # a cache and its tokens give the same view
    np.testing.assert_allclose(again.patterns[0], view.patterns[1], atol=1e-6)


def test_patterns_are_checked_and_tokens_escaped():
    with pytest.raises(ValueError, match="2 sentences of patterns but 1 of tokens"):
        probe.show(torch.rand(2, 1, 1, 3, 3), ["a", "b", "c"])
    with pytest.raises(ValueError, match="4 tokens but patterns over 3"):
        probe.show(torch.rand(1, 1, 3, 3), ["a", "b", "c", "d"])
    with pytest.raises(ValueError, match="unknown view 'lines'; use one of head, heatmap"):
        probe.View([["a"]], [np.ones((1, 1, 1, 1))], view="lines")
    html = probe.show(torch.rand(1, 1, 2, 2), [HOSTILE, "&"]).html()
    data = re.search(r'class="probe-data">(.*?)</script>', html, re.S).group(1)
    assert "<" not in data and json.loads(data)["sentences"][0]["tokens"] == [HOSTILE, "&"]


def _tokenizer():
    from tokenizers_util import wordpiece

    return wordpiece()


@needs_chromium
@pytest.mark.slow
def test_the_viewer_in_chromium(tmp_path):
    torch.manual_seed(0)
    patterns = torch.softmax(3 * torch.randn(2, 4, 12, 12), -1)
    tokens = [f"tok{i}" for i in range(12)]
    tokens[5] = HOSTILE
    path = page(probe.show(patterns, tokens), tmp_path)
    done = chromium(path.as_uri(), tmp_path, "--dump-dom")
    assert console_messages(done.stderr) == []
    seen = result(done.stdout)
    assert seen["start"][:3] == ["head", 0, 0] and seen["start"][3] >= 1
    assert seen["selected"] == [1, 2]
    assert seen["hover"] == 3 and "from “tok3”" in seen["status"]
    assert 0 < seen["inkHover"] < seen["inkAll"]  # only the hovered token's lines
    assert seen["afterLeave"] is None
    assert seen["inkMap"] > 0 and seen["inkModel"] > 0
    assert seen["clicked"] == ["heatmap", 0, 1, "heatmap", "0", "1"]
    assert seen["images"] == 0 and seen["pwned"] == 0  # a token is text, never markup
    shot = tmp_path / "view.png"
    done = chromium(probe.show(patterns, tokens).save(tmp_path / "plain.html").as_uri(),
                    tmp_path, f"--screenshot={shot}")  # fmt: skip
    assert console_messages(done.stderr) == []
    pixels = plt_image.imread(shot)[..., :3]
    assert (pixels.mean(-1) < 0.9).sum() > 3000  # not blank: tokens and lines are drawn


@needs_chromium
@pytest.mark.slow
def test_a_long_input_stays_canvas_drawn(tmp_path):
    """1,200 tokens: each keeps its 16 largest weights; every view draws, and the page has a
    few dozen elements, not one per token or weight."""
    torch.manual_seed(0)
    patterns = torch.softmax(4 * torch.randn(2, 4, 1200, 1200), -1)
    view = probe.show(patterns, [f"w{i}" for i in range(1200)])
    assert view.save(tmp_path / "size.html").stat().st_size < 2_000_000
    done = chromium(page(view, tmp_path).as_uri(), tmp_path, "--dump-dom")
    assert console_messages(done.stderr) == []
    seen = result(done.stdout)
    assert seen["inkMap"] > 0 and seen["inkModel"] > 0 and seen["elements"] < 60


@needs_chromium
def test_views_on_one_page_start_once_each(tmp_path):
    """Each notebook output carries the script; a second copy starts only the views not yet
    started."""
    torch.manual_seed(0)
    views = [probe.show(torch.softmax(torch.randn(1, 2, 5, 5), -1), list("abcde")) for _ in "xy"]
    count = ("<pre id='result'></pre><script>document.getElementById('result').textContent = "
             "JSON.stringify([...document.querySelectorAll('.probe-view')]"
             ".map((v) => v.probeView.draws))</script>")  # fmt: skip
    path = tmp_path / "two.html"
    path.write_text(f"<!doctype html><html><body>{views[0].html()}{views[1].html()}{count}"
                    "</body></html>")  # fmt: skip
    done = chromium(path.as_uri(), tmp_path, "--dump-dom")
    assert console_messages(done.stderr) == []
    assert re.search(r"<pre id=\"result\">(.*?)</pre>", done.stdout).group(1) == "[1,1]"


def _llama(tokenizer, positions: int):
    import transformers as tf

    config = tf.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                            num_hidden_layers=2, intermediate_size=64, vocab_size=len(tokenizer),
                            max_position_embeddings=positions)  # fmt: skip
    torch.manual_seed(0)
    return tf.LlamaModel(config).eval()


def _text(tokenizer, words: int) -> str:
    vocabulary = [w for w in tokenizer.get_vocab() if w.isalpha()]
    return " ".join(vocabulary[i % len(vocabulary)] for i in range(words))


def test_a_long_input_is_read_in_row_blocks():
    """Past 64 tokens, probe.show(model, …) keeps each query's 16 largest weights, found in
    blocks of rows beside sdpa: the same weights and keys as the whole pattern's."""
    from probe.patterns.viewer import TOP_K, TopKeys, top_keys

    tokenizer = _tokenizer()
    model = _llama(tokenizer, 512)
    text = _text(tokenizer, 150)
    view = probe.show(model, tokenizer, text)
    inputs = tokenizer(text, return_tensors="pt")
    T = inputs["input_ids"].shape[1]
    assert isinstance(view.patterns[0], TopKeys) and view.patterns[0].shape == (2, 4, T, T)
    with torch.no_grad(), probe.trace(model, "hook_pattern") as cache:
        model(**inputs)
    whole = cache.stack("hook_pattern")[:, 0]  # [layer, head, q, k]
    expected = whole.topk(TOP_K, dim=-1)
    small = top_keys(model, dict(inputs), budget=4 * T * 7)  # blocks of a few rows
    for found in (view.patterns[0], small):
        got = torch.from_numpy(found.weights)
        torch.testing.assert_close(got, expected.values, atol=2e-7, rtol=0)
        # its keys hold its weights (early queries see fewer than 16 keys: the rest weigh 0)
        gathered = whole.gather(-1, torch.from_numpy(found.index)) * (got > 0)
        torch.testing.assert_close(gathered, got, atol=2e-7, rtol=0)


@needs_chromium
@pytest.mark.slow
def test_a_4k_token_input_stays_light(tmp_path):
    """A 4,096-token input: the page holds 16 weights per query (no 4k² anything) and every
    view draws."""
    tokenizer = _tokenizer()
    model = _llama(tokenizer, 4096)
    ids = torch.randint(5, len(tokenizer), (1, 4096), generator=torch.Generator().manual_seed(0))
    from probe.patterns.viewer import View, top_keys

    patterns = top_keys(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    view = View([tokenizer.convert_ids_to_tokens(ids[0].tolist())], [patterns])
    size = view.save(tmp_path / "size.html").stat().st_size
    assert size < 2 * 4 * 4096 * 16 * 3 * 1.4  # bytes of weights and keys, base64: linear in T
    done = chromium(page(view, tmp_path).as_uri(), tmp_path, "--dump-dom")
    assert console_messages(done.stderr) == []
    seen = result(done.stdout)
    assert seen["inkAll"] > 0 and seen["inkMap"] > 0 and seen["inkModel"] > 0
    assert seen["elements"] < 60
    # the page says what it shows: a window of the head view, pooled heatmaps, top-16 keys
    assert "head view: tokens 0–199 of 4096 (◀ ▶ move)" in seen["status"]
    assert "each token's 16 largest weights" in seen["status"]
    # ▶ moves the head view's window by half of it; ◀ back, never before token 0
    moves = """<pre id="moves"></pre><script>(function () {
      const root = document.querySelector(".probe-view"), v = root.probeView, seen = [];
      const click = (r) => root.querySelector("[data-role=" + r + "]").click();
      const status = () => root.querySelector("[data-role=status]").textContent;
      root.querySelector("[data-role=view]").value = "head";
      root.querySelector("[data-role=view]").dispatchEvent(new Event("change"));
      click("next"); click("next"); seen.push([v.start, status()]);
      click("prev"); click("prev"); click("prev"); seen.push([v.start, status()]);
      document.getElementById("moves").textContent = JSON.stringify(seen);
    })();</script>"""
    path = view.save(tmp_path / "moves.html")
    path.write_text(path.read_text().replace("</body>", moves + "</body>"))
    done = chromium(path.as_uri(), tmp_path, "--dump-dom")
    found = re.search(r'<pre id="moves">(.*?)</pre>', done.stdout, re.S).group(1)
    (after_next, status_next), (after_prev, _) = json.loads(found.replace("&quot;", '"'))
    assert after_next == 200 and "tokens 200–399 of 4096" in status_next and after_prev == 0
