/* The attribution graph view (nncanon.views.graph): nodes by layer x position, edges on a canvas beneath. */
(function () {
  const N = DATA.nodes, count = N.kind.length, L = DATA.n_layers, P = DATA.tokens.length;
  const FEATURE = 0, ERROR = 1, TOKEN = 2, LOGIT = 3;
  if (!P) { missing("Nothing to draw: the graph holds no token."); ready(); return; }
  const E = DATA.src.length;
  const absW = new Float64Array(E);
  for (let e = 0; e < E; e++) absW[e] = Math.abs(DATA.w[e] || 0);
  const sortedW = Array.from(absW).sort((a, b) => a - b);
  const inEdges = Array.from({length: count}, () => []), outEdges = Array.from({length: count}, () => []);
  for (let e = 0; e < E; e++) { outEdges[DATA.src[e]].push(e); inEdges[DATA.tgt[e]].push(e); }

  function label(i) {
    const k = N.kind[i];
    if (k === FEATURE) return `L${N.layer[i]} feature ${N.feature[i]} @${N.pos[i]}`;
    if (k === ERROR) return `L${N.layer[i]} error @${N.pos[i]}`;
    if (k === TOKEN) return `token "${showToken(DATA.tokens[N.pos[i]])}" @${N.pos[i]}`;
    return `logit "${showToken(DATA.logits[N.feature[i]])}" p=${fmt(N.act[i])}`;
  }

  /* layout: row 0 the tokens, rows 1..L the blocks, row L+1 the logits; one column per position */
  const cells = new Map();
  let most = 1;
  for (let i = 0; i < count; i++) {
    if (N.kind[i] !== FEATURE && N.kind[i] !== ERROR) continue;
    const key = N.layer[i] * P + N.pos[i];
    if (!cells.has(key)) cells.set(key, []);
    cells.get(key).push(i);
    most = Math.max(most, cells.get(key).length);
  }
  const step = count > 2000 ? 9 : count > 300 ? 12 : 18;
  const per = Math.max(2, Math.ceil(Math.sqrt(most * 1.6)));
  const colW = Math.max(56, per * step + 12), rowH = Math.ceil(most / per) * step + 14;
  const left = 56, tokenH = 46, logitH = 40;
  const logits = [];
  for (let i = 0; i < count; i++) if (N.kind[i] === LOGIT) logits.push(i);
  const width = Math.max(left + P * colW + 10, left + logits.length * 120 + 10);
  const height = logitH + L * rowH + tokenH + 10;
  const X = new Float64Array(count), Y = new Float64Array(count);
  const rowY = (layer) => logitH + (L - 1 - layer) * rowH;
  for (const [key, members] of cells) {
    const layer = Math.floor(key / P), pos = key % P;
    members.forEach((i, j) => {
      X[i] = left + pos * colW + 8 + (j % per) * step + step / 2;
      Y[i] = rowY(layer) + 7 + Math.floor(j / per) * step + step / 2;
    });
  }
  for (let i = 0; i < count; i++) {
    if (N.kind[i] === TOKEN) { X[i] = left + N.pos[i] * colW + colW / 2; Y[i] = height - tokenH / 2 - 6; }
  }
  logits.forEach((i, j) => {
    X[i] = Math.min(left + (P - 1) * colW + colW / 2, width - 60) - j * 120;
    Y[i] = logitH / 2;
  });

  /* controls */
  const bar = el("div", {class: "row", id: "controls"}, null, VIEW);
  el("label", {for: "threshold"}, "edge threshold (|weight| percentile)", bar);
  const slider = el("input", {type: "range", id: "threshold", min: 0, max: 100, value: 0, step: 1}, null, bar);
  const shown = el("span", {id: "edges-shown", class: "legend"}, "", bar);
  const exportLink = el("a", {class: "button", id: "export", href: "#", download: "subgraph.json"},
    "export pinned subgraph (JSON)", bar);
  el("span", {class: "legend"}, `${count} nodes, ${E} edges; circles: features, squares: errors (size: share ` +
    "of the influence), boxes: logits; click a node to pin it", bar);

  const wrap = el("div", {class: "row"}, null, VIEW);
  const stage = el("div", {id: "stage", style: `position:relative;width:${width}px;height:${height}px;` +
    "overflow:visible;flex:none"}, null, wrap);
  const panel = el("div", {class: "panel", id: "info", style: "width:340px;position:sticky;top:8px"}, null, wrap);
  el("div", {class: "legend"}, "Hover or click a node.", panel);
  const canvas = el("canvas", {width: width, height: height, style: "position:absolute;left:0;top:0"}, null, stage);
  const svg = el("svg:svg", {width: width, height: height, style: "position:absolute;left:0;top:0"}, null, stage);
  const ctx = canvas.getContext("2d");

  /* axes: layer labels, token labels under the token nodes */
  for (let layer = 0; layer < L; layer++) {
    el("svg:text", {x: 4, y: rowY(layer) + rowH / 2 + 4, class: "legend", "font-size": 11}, `L${layer}`, svg);
    el("svg:line", {x1: left, x2: width, y1: rowY(layer), y2: rowY(layer), stroke: "#eef0f4"}, null, svg);
  }
  el("svg:text", {x: 4, y: height - tokenH / 2, "font-size": 11}, "tokens", svg);
  el("svg:text", {x: 4, y: logitH / 2 + 4, "font-size": 11}, "logits", svg);

  const maxShare = Math.max(1e-12, ...N.share.filter((s, i) => N.kind[i] === ERROR));
  const maxInfl = Math.max(1e-12, ...N.infl.map((v) => Math.abs(v || 0)));
  const shapes = new Array(count);
  const group = el("svg:g", {id: "nodes"}, null, svg);
  for (let i = 0; i < count; i++) {
    const k = N.kind[i];
    let shape;
    if (k === FEATURE) {
      shape = el("svg:circle", {cx: X[i], cy: Y[i], r: step * 0.38, fill: blues(0.25 + 0.75 * Math.abs(N.infl[i] || 0) / maxInfl),
        stroke: "#345"}, null, group);
    } else if (k === ERROR) {
      const side = 3 + (step - 4) * Math.sqrt((N.share[i] || 0) / maxShare);
      shape = el("svg:rect", {x: X[i] - side / 2, y: Y[i] - side / 2, width: side, height: side, fill: "#c9ccd4",
        stroke: "#777"}, null, group);
    } else if (k === TOKEN) {
      shape = el("svg:g", {}, null, group);
      el("svg:rect", {x: X[i] - colW / 2 + 3, y: Y[i] - 14, width: colW - 6, height: 28, rx: 4, fill: "#f1f3f8",
        stroke: "#99a"}, null, shape);
      el("svg:text", {x: X[i], y: Y[i] + 4, "text-anchor": "middle", "font-size": 11, class: "tok"},
        showToken(DATA.tokens[N.pos[i]]).slice(0, Math.max(3, Math.floor(colW / 7))), shape);
    } else {
      shape = el("svg:g", {}, null, group);
      el("svg:rect", {x: X[i] - 56, y: Y[i] - 14, width: 112, height: 28, rx: 4, fill: blues(N.act[i] || 0),
        stroke: "#345"}, null, shape);
      el("svg:text", {x: X[i], y: Y[i] + 4, "text-anchor": "middle", "font-size": 11, fill: textOn(N.act[i]),
        class: "tok"}, `${showToken(DATA.logits[N.feature[i]]).slice(0, 8)} p=${fmt(N.act[i], 2)}`, shape);
    }
    shape.setAttribute("class", `node kind-${k}`);
    shape.setAttribute("data-i", i);
    shapes[i] = shape;
  }

  let threshold = 0, hovered = -1, selected = -1;
  const pinned = new Set();
  function visible(e) { return absW[e] >= threshold; }
  const STYLES = [["rgba(200,60,30,0.8)", 1.6], ["rgba(40,90,200,0.8)", 1.6], ["rgba(200,60,30,0.05)", 0.7],
    ["rgba(40,90,200,0.05)", 0.7], ["rgba(200,60,30,0.18)", 0.7], ["rgba(40,90,200,0.18)", 0.7]];
  function draw() {
    /* one path per style (sign x focus): a few strokes whatever the number of edges */
    ctx.clearRect(0, 0, width, height);
    const focus = hovered >= 0 ? hovered : selected;
    const paths = STYLES.map(() => new Path2D());
    let n = 0;
    for (let e = 0; e < E; e++) {
      if (!visible(e)) continue;
      n++;
      const s = DATA.src[e], t = DATA.tgt[e];
      const group = (DATA.w[e] >= 0 ? 0 : 1) + (focus < 0 ? 4 : (s === focus || t === focus) ? 0 : 2);
      paths[group].moveTo(X[s], Y[s]);
      paths[group].lineTo(X[t], Y[t]);
    }
    for (const group of [2, 3, 4, 5, 0, 1]) {
      ctx.strokeStyle = STYLES[group][0];
      ctx.lineWidth = STYLES[group][1];
      ctx.stroke(paths[group]);
    }
    shown.textContent = `${n} of ${E} edges shown (|weight| >= ${fmt(threshold)})`;
  }
  function strongest(list, key) {
    return list.slice().sort((a, b) => absW[b] - absW[a]).slice(0, 6).map((e) => [DATA[key][e], DATA.w[e]]);
  }
  function info(i) {
    panel.replaceChildren();
    el("h2", {}, label(i), panel);
    const k = N.kind[i];
    if (k === FEATURE) el("div", {id: "activation"}, `activation ${fmt(N.act[i], 4)}`, panel);
    if (k === LOGIT) el("div", {}, `probability ${fmt(N.act[i], 4)}`, panel);
    el("div", {}, `influence on the logits ${fmt(N.infl[i])} (share ${fmt(100 * (N.share[i] || 0), 3)}%)`, panel);
    const pin = el("button", {id: "pin"}, pinned.has(i) ? "unpin" : "pin", panel);
    pin.addEventListener("click", () => { toggle(i); info(i); });
    for (const [title, list, key] of [["strongest inputs", inEdges[i], "src"], ["strongest outputs", outEdges[i], "tgt"]]) {
      el("h2", {}, title, panel);
      const items = strongest(list, key);
      if (!items.length) el("div", {class: "legend"}, "none kept", panel);
      for (const [j, w] of items) el("div", {class: "edge"}, `${w >= 0 ? "+" : ""}${fmt(w)}  ${label(j)}`, panel);
    }
    if (k === FEATURE) {
      el("h2", {}, "top activating contexts", panel);
      const found = DATA.contexts[`${N.layer[i]}_${N.feature[i]}`];
      const box = el("div", {id: "contexts"}, null, panel);
      if (!found || !found.length) el("div", {class: "legend"}, "none given for this feature", box);
      for (const [value, before, token, after] of found || []) {
        const line = el("div", {class: "context tok"}, null, box);
        el("span", {class: "legend"}, `${fmt(value)}  `, line);
        el("span", {}, showToken(before), line);
        el("mark", {}, showToken(token), line);
        el("span", {}, showToken(after), line);
      }
    }
  }
  function toggle(i) {
    if (pinned.has(i)) pinned.delete(i); else pinned.add(i);
    shapes[i].classList.toggle("pinned", pinned.has(i));
    shapes[i].setAttribute("stroke-width", pinned.has(i) ? 3 : 1);
  }
  window.exportPinned = function () {
    const ids = Array.from(pinned).sort((a, b) => a - b);
    const nodes = ids.map((i) => ({id: i, label: label(i), kind: ["feature", "error", "token", "logit"][N.kind[i]],
      layer: N.layer[i], position: N.pos[i], feature: N.kind[i] === FEATURE ? N.feature[i] : null,
      activation: N.act[i]}));
    const links = [];
    for (let e = 0; e < E; e++) {
      if (pinned.has(DATA.src[e]) && pinned.has(DATA.tgt[e])) links.push({source: DATA.src[e], target: DATA.tgt[e], weight: DATA.w[e]});
    }
    return {prompt: DATA.prompt, tokens: DATA.tokens, nodes: nodes, links: links};
  };
  exportLink.addEventListener("click", () => {
    const blob = new Blob([JSON.stringify(window.exportPinned(), null, 1)], {type: "application/json"});
    exportLink.href = URL.createObjectURL(blob);
  });
  group.addEventListener("mouseover", (event) => {
    const node = event.target.closest(".node");
    if (!node) return;
    hovered = Number(node.dataset.i);
    tip(event, label(hovered) + (N.kind[hovered] === FEATURE ? `\nactivation ${fmt(N.act[hovered], 4)}` : ""));
    draw();
  });
  group.addEventListener("mouseout", (event) => { hovered = -1; tip(event, null); draw(); });
  group.addEventListener("click", (event) => {
    const node = event.target.closest(".node");
    if (!node) return;
    selected = Number(node.dataset.i);
    toggle(selected);
    info(selected);
    draw();
  });
  slider.addEventListener("input", () => {
    const q = Number(slider.value) / 100;
    threshold = E ? sortedW[Math.min(E - 1, Math.floor(q * E))] * (q > 0 ? 1 : 0) : 0;
    for (let i = 0; i < count; i++) {
      if (N.kind[i] !== FEATURE && N.kind[i] !== ERROR) continue;
      const live = inEdges[i].some(visible) || outEdges[i].some(visible);
      shapes[i].style.opacity = live ? 1 : 0.2;
    }
    draw();
  });
  draw();
  ready();
})();
