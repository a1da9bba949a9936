/* The logit lens view (nncanon.views.lens): a table, one cell per layer x position, last layer on top. */
(function () {
  const T = DATA.tokens;
  if (!T.length || !DATA.layers.length) { missing("Nothing to draw: no token or no layer."); ready(); return; }
  const table = el("table", {class: "cells", id: "lens"}, null, VIEW);
  for (let r = DATA.layers.length - 1; r >= 0; r--) {
    const tr = el("tr", {}, null, table);
    el("th", {}, `layer ${DATA.layers[r]}`, tr);
    for (let s = 0; s < T.length; s++) {
      const p = DATA.p[r][s], top = showToken(DATA.top[r][s]);
      const td = el("td", {}, null, tr);
      const cell = el("div", {class: p === null ? "cell two nan" : "cell two", "data-layer": DATA.layers[r],
        "data-pos": s, style: p === null ? "" : `background:${blues(p)};color:${textOn(p)}`},
        `${top.slice(0, 10)}\n${fmt(p, 2)}`, td);
      cell.addEventListener("mousemove", (event) => tip(event,
        `layer ${DATA.layers[r]}, after "${showToken(T[s])}" (${s}):\ntop "${top}" p=${fmt(p)}`));
      cell.addEventListener("mouseleave", (event) => tip(event, null));
    }
  }
  const foot = el("tr", {}, null, table);
  el("th", {}, "input", foot);
  for (const token of T) el("th", {class: "tok"}, showToken(token).slice(0, 10), foot);
  el("p", {class: "legend"}, "Each cell: the lens's top next token after that input token, shaded by its probability.",
    VIEW);
  ready();
})();
