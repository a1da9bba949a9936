/* The attention view (nncanon.views.attention): one thumbnail per layer x head, a large pattern with tokens. */
(function () {
  const T = DATA.tokens, n = T.length;
  if (!DATA.layers.length) { missing("No layer to draw."); ready(); return; }
  const grid = el("div", {id: "heads"}, null, VIEW);
  const big = el("div", {class: "panel", id: "pattern", style: "margin-top:10px"}, null, VIEW);
  const size = 72, cell = Math.max(1, size / Math.max(1, n));

  function paint(canvas, matrix, px) {
    const c = canvas.getContext("2d");
    for (let q = 0; q < n; q++) {
      for (let k = 0; k < n; k++) {
        const v = matrix[q][k];
        c.fillStyle = v === null ? "#dddddd" : (k > q && v === 0 ? "#fafafa" : blues(Math.sqrt(v)));
        c.fillRect(k * px, q * px, Math.ceil(px), Math.ceil(px));
      }
    }
  }
  function show(layer, head) {
    big.replaceChildren();
    el("h2", {}, `layer ${layer}, head ${head}: query (rows) attends to key (columns)`, big);
    const px = Math.max(14, Math.min(36, Math.floor(560 / Math.max(1, n))));
    const labelW = 110;
    const canvas = el("canvas", {id: "big", width: labelW + n * px, height: labelW + n * px}, null, big);
    const c = canvas.getContext("2d");
    const matrix = DATA.layers.find((l) => l.layer === layer).heads[head];
    c.save(); c.translate(labelW, labelW); paint(canvas, matrix, px); c.restore();
    c.fillStyle = "#1d2230"; c.font = "11px monospace";
    for (let i = 0; i < n; i++) {
      const text = showToken(T[i]).slice(0, 14);
      c.textAlign = "right"; c.fillText(text, labelW - 4, labelW + i * px + px / 2 + 4);
      c.save(); c.translate(labelW + i * px + px / 2 + 4, labelW - 4); c.rotate(-Math.PI / 2);
      c.textAlign = "left"; c.fillText(text, 0, 0); c.restore();
    }
    canvas.addEventListener("mousemove", (event) => {
      const r = canvas.getBoundingClientRect();
      const k = Math.floor((event.clientX - r.left - labelW) / px), q = Math.floor((event.clientY - r.top - labelW) / px);
      if (q < 0 || k < 0 || q >= n || k >= n) { tip(event, null); return; }
      tip(event, `"${showToken(T[q])}" (${q}) -> "${showToken(T[k])}" (${k}): ${fmt(matrix[q][k])}`);
    });
    canvas.addEventListener("mouseleave", (event) => tip(event, null));
  }
  let first = null;
  for (const layer of DATA.layers) {
    const row = el("div", {class: "row layer", style: "align-items:center;margin:3px 0"}, null, grid);
    el("div", {style: "width:60px", class: "legend"}, `layer ${layer.layer}`, row);
    if (!layer.heads) { el("div", {class: "missing no-attention"}, `no softmax attention: ${layer.reason}`, row); continue; }
    layer.heads.forEach((matrix, head) => {
      const canvas = el("canvas", {class: "head", width: Math.ceil(cell * n), height: Math.ceil(cell * n),
        "data-layer": layer.layer, "data-head": head, title: `layer ${layer.layer} head ${head}`,
        style: "border:1px solid #ccd;cursor:pointer"}, null, row);
      paint(canvas, matrix, cell);
      canvas.addEventListener("click", () => show(layer.layer, head));
      if (first === null) first = [layer.layer, head];
    });
  }
  if (first) show(first[0], first[1]); else missing("No layer serves softmax attention probabilities.", big);
  ready();
})();
