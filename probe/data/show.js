// probe.show: an attention viewer drawn on canvases (no network, no modules, no DOM per token).
// Each .probe-view element holds its data, {sentences: [{tokens, T, mode, weights, arcs,
// caption}], layers, heads, k, view}; weights are bytes (weight × 255): "full" [L·H·T·T], or
// "top" [L·H·T·k] with their key indices (uint16) in "index"; arcs are [query, key] pairs drawn
// in gold (a treebank's dependencies). The script may appear once per view or once per page: it
// starts every view not yet started.
(function () {
  "use strict";
  function start(root) {
    const spec = JSON.parse(root.querySelector("script.probe-data").textContent);
    const $ = (name) => root.querySelector("[data-role=" + name + "]");
    const bytes = (b64) => Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
    const sentences = spec.sentences.map((s) => ({
      tokens: s.tokens, T: s.T, mode: s.mode, weights: bytes(s.weights), arcs: s.arcs || [],
      caption: s.caption || "", index: s.index ? new Uint16Array(bytes(s.index).buffer) : null,
    }));
    const single = spec.layers * spec.heads === 1;  // one head's card: no layer or head to pick
    const state = { sentence: 0, layer: 0, head: 0, view: spec.view || "head", hover: null,
                    draws: 0, start: 0 };
    root.probeView = state;  // read by tests and by whoever embeds the view

    // The weights of one head, each query's as [key, weight] pairs of at least `floor`.
    function rows(s, layer, head, floor) {
      const out = [], T = s.T;
      if (s.mode === "full") {
        const base = ((layer * spec.heads + head) * T) * T;
        for (let q = 0; q < T; q++) {
          const row = [];
          for (let j = 0; j < T; j++) {
            const w = s.weights[base + q * T + j] / 255;
            if (w >= floor) row.push([j, w]);
          }
          out.push(row);
        }
      } else {
        const k = spec.k, base = ((layer * spec.heads + head) * T) * k;
        for (let q = 0; q < T; q++) {
          const row = [];
          for (let i = 0; i < k; i++) {
            const w = s.weights[base + q * k + i] / 255;
            if (w >= floor) row.push([s.index[base + q * k + i], w]);
          }
          out.push(row);
        }
      }
      return out;
    }

    function canvas(width, height) {
      const c = $("canvas"), ratio = window.devicePixelRatio || 1;
      c.width = Math.max(1, Math.round(width * ratio));
      c.height = Math.max(1, Math.round(height * ratio));
      c.style.width = width + "px";
      c.style.height = height + "px";
      const g = c.getContext("2d");
      g.setTransform(ratio, 0, 0, ratio, 0, 0);
      g.clearRect(0, 0, width, height);
      return g;
    }

    const ROW = 18, COLUMN = 130, GAP = 160, SPACE = 24;
    // A long input's head view shows a window of WINDOW tokens (◀ ▶ move it by half); lines to
    // keys outside it end at its top or bottom edge. Heatmaps pool long inputs into at most
    // BINS × BINS cells (each the largest weight it covers).
    const WINDOW = 200, BINS = 1024;
    const shown = (s) => ({ from: state.start, to: Math.min(s.T, state.start + WINDOW) });
    const colour = getComputedStyle(root).getPropertyValue("--probe-accent").trim() || "#2f5fd0";
    const GOLD = "#e07000";
    const ink = () => getComputedStyle(root).color;
    const clip = (t) => (t.length > 16 ? t.slice(0, 15) + "…" : t);
    const arcsOf = (s) =>
      state.hover === null ? s.arcs : s.arcs.filter(([q]) => q === state.hover);

    // Head view: queries on the left, keys on the right, a line per weight (opacity = weight);
    // gold arcs dashed beneath.
    const headSize = (s) => ({ width: COLUMN * 2 + GAP, height: ROW * Math.min(s.T, WINDOW) + 10 });
    function drawHead(g, s) {
      const { from, to } = shown(s);
      const y = (i) => ROW * (Math.min(Math.max(i, from - 0.7), to - 0.3) - from) + 14;
      g.font = "13px system-ui, sans-serif";
      g.textBaseline = "middle";
      g.lineWidth = 2;
      g.strokeStyle = GOLD;
      g.setLineDash([5, 4]);
      for (const [q, k] of arcsOf(s)) {
        if (q < from || q >= to) continue;
        g.beginPath();
        g.moveTo(COLUMN, y(q));
        g.lineTo(COLUMN + GAP, y(k));
        g.stroke();
      }
      g.setLineDash([]);
      const weights = rows(s, state.layer, state.head, 0.02);
      g.strokeStyle = colour;
      for (let q = from; q < to; q++) {
        if (state.hover !== null && state.hover !== q) continue;
        for (const [j, w] of weights[q]) {
          g.globalAlpha = Math.min(1, w);
          g.beginPath();
          g.moveTo(COLUMN, y(q));
          g.lineTo(COLUMN + GAP, y(j));
          g.stroke();
        }
      }
      g.globalAlpha = 1;
      for (let i = from; i < to; i++) {
        g.fillStyle = state.hover === i ? colour : ink();
        g.textAlign = "right";
        g.fillText(clip(s.tokens[i]), COLUMN - 6, y(i));
        g.textAlign = "left";
        g.fillText(clip(s.tokens[i]), COLUMN + GAP + 6, y(i));
      }
    }

    // Heatmap: token × token, one cell per weight (a pixel or less on long inputs).
    function drawMap(target, s, layer, head, size) {
      const T = s.T, cell = Math.max(size / T, 0.25), side = Math.min(size, cell * T);
      const n = Math.min(T, BINS), bin = (i) => Math.floor((i * n) / T);
      const image = document.createElement("canvas");
      image.width = n;
      image.height = n;
      const g = image.getContext("2d"), pixels = g.createImageData(n, n);
      const weights = rows(s, layer, head, 1 / 255);
      for (let q = 0; q < T; q++) {
        for (const [j, w] of weights[q]) {
          const at = (bin(q) * n + bin(j)) * 4, shade = Math.round(255 * (1 - w));
          if (pixels.data[at + 3] && pixels.data[at] <= shade) continue;  // a larger one is there
          pixels.data[at] = shade;
          pixels.data[at + 1] = shade;
          pixels.data[at + 2] = 255;
          pixels.data[at + 3] = 255;
        }
      }
      g.putImageData(pixels, 0, 0);
      target.imageSmoothingEnabled = false;
      target.fillStyle = "#fff";
      target.fillRect(0, 0, side, side);
      target.drawImage(image, 0, 0, side, side);
      return side;
    }

    function mapSize(s) {
      const margin = s.T <= 60 ? 110 : 4, size = Math.min(640, Math.max(200, s.T * 14));
      return { margin, size, width: size + margin + 4, height: size + margin + 4 };
    }
    function drawHeatmap(g, s) {
      const { margin, size } = mapSize(s);
      g.save();
      g.translate(margin, margin);
      const side = drawMap(g, s, state.layer, state.head, size), step = side / s.T;
      g.lineWidth = 2;
      g.strokeStyle = GOLD;
      for (const [q, k] of arcsOf(s)) g.strokeRect(k * step, q * step, step, step);
      if (state.hover !== null) {
        g.strokeStyle = "#d33";
        g.strokeRect(0, state.hover * step, side, step);
      }
      g.restore();
      if (margin > 4) {
        g.font = "11px system-ui, sans-serif";
        g.fillStyle = ink();
        for (let i = 0; i < s.T; i++) {
          g.textAlign = "right";
          g.textBaseline = "middle";
          g.fillText(clip(s.tokens[i]), margin - 4, margin + step * (i + 0.5));
          g.save();
          g.translate(margin + step * (i + 0.5), margin - 4);
          g.rotate(-Math.PI / 2);
          g.textAlign = "left";
          g.fillText(clip(s.tokens[i]), 0, 0);
          g.restore();
        }
      }
      return { margin, side };
    }

    // The head view, the heatmap, or both side by side, on one canvas.
    function drawSentence() {
      const s = sentences[state.sentence];
      const parts = state.view === "both" ? ["head", "heatmap"] : [state.view];
      const sizes = parts.map((p) => (p === "head" ? headSize(s) : mapSize(s)));
      const width = sizes.reduce((sum, z) => sum + z.width, 0) + SPACE * (parts.length - 1);
      const g = canvas(width, Math.max(...sizes.map((z) => z.height)));
      let x = 0;
      state.parts = [];
      parts.forEach((p, i) => {
        g.save();
        g.translate(x, 0);
        const map = p === "head" ? drawHead(g, s) : drawHeatmap(g, s);
        g.restore();
        state.parts.push({ part: p, x, width: sizes[i].width, map });
        x += sizes[i].width + SPACE;
      });
    }

    // Model view: every head as a thumbnail; a click opens its heatmap.
    const THUMB = 64, PAD = 6;
    function drawModel() {
      const s = sentences[state.sentence];
      const g = canvas(40 + spec.heads * (THUMB + PAD), 20 + spec.layers * (THUMB + PAD));
      g.font = "11px system-ui, sans-serif";
      g.fillStyle = getComputedStyle(root).color;
      for (let h = 0; h < spec.heads; h++) g.fillText("H" + h, 40 + h * (THUMB + PAD), 12);
      for (let l = 0; l < spec.layers; l++) {
        g.fillStyle = getComputedStyle(root).color;
        g.fillText("L" + l, 4, 20 + l * (THUMB + PAD) + THUMB / 2);
        for (let h = 0; h < spec.heads; h++) {
          g.save();
          g.translate(40 + h * (THUMB + PAD), 20 + l * (THUMB + PAD));
          drawMap(g, s, l, h, THUMB);
          if (l === state.layer && h === state.head) {
            g.strokeStyle = "#d33";
            g.lineWidth = 2;
            g.strokeRect(0, 0, THUMB, THUMB);
          }
          g.restore();
        }
      }
    }

    function draw() {
      if (sentences[state.sentence].T <= state.start) state.start = 0;
      if ($("prev")) navigable();
      if (state.view === "model") drawModel();
      else drawSentence();
      state.draws += 1;
      const s = sentences[state.sentence];
      $("caption").textContent = s.caption;
      $("status").textContent =
        state.view === "model" ? "every head: click one to open it"
          : [single ? "" : "layer " + state.layer + ", head " + state.head,
             state.hover === null ? "" : "from “" + s.tokens[state.hover] + "”",
             s.mode === "top" ? "each token's " + spec.k + " largest weights" : "",
             s.T > WINDOW && state.view !== "heatmap"
               ? "head view: tokens " + shown(s).from + "–" + (shown(s).to - 1) + " of " + s.T +
                 " (◀ ▶ move)" : "",
             s.T > BINS && state.view !== "head" ? "heatmap: " + BINS + "² cells, each the " +
                 "largest weight it covers" : "",
             s.arcs.length ? "gold dashed: the treebank's arcs" : ""]
            .filter(Boolean).join(" · ");
    }

    function options(select, n, label) {
      for (let i = 0; i < n; i++) {
        const o = document.createElement("option");
        o.value = i;
        o.textContent = label(i);
        select.appendChild(o);
      }
    }
    options($("layer"), spec.layers, (i) => "layer " + i);
    options($("head"), spec.heads, (i) => "head " + i);
    const first = (i) => sentences[i].tokens.slice(0, 8).join(" ");
    options($("sentence"), sentences.length, (i) => i + 1 + "/" + sentences.length + ": " + first(i));
    $("sentence").hidden = sentences.length < 2;
    $("layer").hidden = $("head").hidden = single;
    $("view").querySelector("option[value=model]").hidden = single;
    $("view").value = state.view;
    for (const name of ["sentence", "layer", "head"]) {
      $(name).addEventListener("change", (e) => {
        state[name] = Number(e.target.value);
        state.hover = null;
        draw();
      });
    }
    function move(by) {
      const T = sentences[state.sentence].T;
      state.start = Math.max(0, Math.min(Math.max(0, T - WINDOW), state.start + by));
      state.hover = null;
      draw();
    }
    $("prev").addEventListener("click", () => move(-WINDOW / 2));
    $("next").addEventListener("click", () => move(WINDOW / 2));
    const navigable = () => { $("prev").hidden = $("next").hidden =
      sentences[state.sentence].T <= WINDOW || state.view === "heatmap" || state.view === "model"; };
    $("view").addEventListener("change", (e) => {
      state.view = e.target.value;
      state.hover = null;
      draw();
    });

    // The token under the pointer: a row of the head view, or of the heatmap.
    function under(x, y) {
      const T = sentences[state.sentence].T;
      for (const part of state.parts || []) {
        if (x < part.x || x >= part.x + part.width) continue;
        if (part.part === "head") {
          const i = Math.floor((y - 5) / ROW) + state.start;
          return i >= state.start && i < Math.min(T, state.start + WINDOW) ? i : null;
        }
        const { margin, side } = part.map;
        const i = Math.floor(((y - margin) / side) * T);
        return x >= part.x + margin && i >= 0 && i < T ? i : null;
      }
      return null;
    }
    $("canvas").addEventListener("mousemove", (e) => {
      if (state.view === "model") return;
      const box = e.target.getBoundingClientRect();
      const hover = under(e.clientX - box.left, e.clientY - box.top);
      if (hover !== state.hover) {
        state.hover = hover;
        draw();
      }
    });
    $("canvas").addEventListener("mouseleave", () => {
      if (state.hover !== null) {
        state.hover = null;
        draw();
      }
    });
    $("canvas").addEventListener("click", (e) => {
      if (state.view !== "model") return;
      const box = e.target.getBoundingClientRect();
      const h = Math.floor((e.clientX - box.left - 40) / (THUMB + PAD));
      const l = Math.floor((e.clientY - box.top - 20) / (THUMB + PAD));
      if (h < 0 || h >= spec.heads || l < 0 || l >= spec.layers) return;
      Object.assign(state, { layer: l, head: h, view: "heatmap", hover: null });
      $("layer").value = l;
      $("head").value = h;
      $("view").value = "heatmap";
      draw();
    });
    draw();
  }

  for (const root of document.querySelectorAll(".probe-view:not([data-started])")) {
    root.dataset.started = "1";
    start(root);
  }
})();
