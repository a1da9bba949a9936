/* The feature dashboard (nncanon.views.features): contexts shaded by activation, histogram, promoted logits. */
(function () {
  const top = el("div", {class: "row"}, null, VIEW);
  const left = el("div", {style: "flex:1;min-width:420px"}, null, top);
  const right = el("div", {style: "width:320px"}, null, top);
  el("h2", {}, `top activating contexts (density ${fmt(100 * DATA.density, 3)}% of ${DATA.tokens_seen} tokens)`, left);
  const box = el("div", {id: "contexts"}, null, left);
  if (!DATA.contexts.length) missing("The feature is never active on these texts.", box);
  const most = Math.max(1e-12, ...DATA.contexts.map((c) => c.value || 0));
  for (const context of DATA.contexts) {
    const line = el("div", {class: "context tok", style: "margin:3px 0"}, null, box);
    el("span", {class: "legend", style: "display:inline-block;width:56px"}, fmt(context.value), line);
    context.tokens.forEach((token, i) => {
      const a = context.acts[i];
      const span = el("span", {class: i === context.at ? "ctx-tok at" : "ctx-tok",
        style: `background:${a === null ? "#ddd" : redBlue(Math.max(0, a) / most)}` +
          (i === context.at ? ";outline:1px solid #333" : "")}, showToken(token), line);
      span.addEventListener("mousemove", (event) => tip(event, `"${showToken(token)}": ${fmt(a, 4)}`));
      span.addEventListener("mouseleave", (event) => tip(event, null));
    });
  }
  el("h2", {}, "activation histogram (active tokens)", right);
  const H = DATA.histogram, w = 300, h = 120;
  const svg = el("svg:svg", {width: w, height: h + 18, id: "histogram"}, null, right);
  const peak = Math.max(1, ...H.counts);
  H.counts.forEach((c, i) => {
    const bw = w / H.counts.length, bh = (h - 4) * c / peak;
    const bar = el("svg:rect", {class: "bin", x: i * bw, y: h - bh, width: Math.max(1, bw - 1), height: bh,
      fill: "#c2412d"}, null, svg);
    bar.addEventListener("mousemove", (event) => tip(event, `${fmt(H.edges[i])} to ${fmt(H.edges[i + 1])}: ${c}`));
    bar.addEventListener("mouseleave", (event) => tip(event, null));
  });
  if (H.edges.length) el("svg:text", {x: w - 2, y: h + 14, "text-anchor": "end", "font-size": 10}, fmt(H.edges[H.edges.length - 1]), svg);
  el("svg:text", {x: 0, y: h + 14, "font-size": 10}, "0", svg);
  for (const [title, key, color] of [["logits promoted", "promoted", "#c2412d"], ["logits suppressed", "suppressed", "#2c5fb8"]]) {
    if (!DATA[key]) continue;
    el("h2", {}, title, right);
    const table = el("table", {id: key}, null, right);
    const scale = Math.max(1e-12, ...DATA[key].map((r) => Math.abs(r[1] || 0)));
    for (const [token, value] of DATA[key]) {
      const tr = el("tr", {class: "logit"}, null, table);
      el("td", {class: "tok"}, showToken(token), tr);
      const td = el("td", {}, null, tr);
      el("div", {style: `height:10px;width:${Math.round(120 * Math.abs(value || 0) / scale)}px;background:${color}`}, null, td);
      el("td", {class: "legend"}, fmt(value), tr);
    }
  }
  ready();
})();
