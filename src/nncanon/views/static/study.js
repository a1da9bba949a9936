/* The studies view (nncanon.views.studies): one layer x head heatmap per model, exact or estimated on each. */
(function () {
  const exact = DATA.kind === "exact";
  const banner = exact ? "EXACT: each head zeroed in its own run" :
    "ESTIMATED (--fast): attribution patching, a first-order estimate, not the exact effect";
  el("p", {class: exact ? "note exact" : "note estimated", id: "kind"}, banner, VIEW);
  el("p", {class: "legend"}, `${DATA.quantity}; red: the head helps the target, blue: it hurts; ` +
    (DATA.shared_scale ? "one colour scale for all models" : "one colour scale per model") +
    "; hatched: no such head; (linear): a linear mixer's heads", VIEW);
  const row = el("div", {class: "row", id: "models"}, null, VIEW);
  if (!DATA.models.length) missing("No model's effects were given.", row);
  for (const model of DATA.models) {
    const box = el("div", {class: "panel model"}, null, row);
    el("h2", {}, model.name, box);
    el("div", {class: exact ? "note exact" : "note estimated"}, exact ? "exact" : "estimated (--fast)", box);
    const table = el("table", {class: "cells"}, null, box);
    const heads = Math.max(0, ...model.grid.map((r) => r.length));
    model.grid.forEach((values, layer) => {
      const tr = el("tr", {}, null, table);
      el("th", {}, model.labels[layer], tr);
      values.forEach((v, head) => {
        const td = el("td", {}, null, tr);
        const t = v === null ? null : v / (model.limit || 1);
        const cell = el("div", {class: v === null ? "cell nan" : "cell", "data-layer": layer, "data-head": head,
          style: v === null ? "min-width:34px" : `min-width:34px;background:${redBlue(t)};color:${textOn(t)}`},
          v === null ? "" : fmt(v, 2), td);
        cell.addEventListener("mousemove", (event) => tip(event, `${model.name}, layer ${model.labels[layer]}, ` +
          `head ${head}: ${v === null ? "no such head" : fmt(v, 4)} (${exact ? "exact" : "estimated"})`));
        cell.addEventListener("mouseleave", (event) => tip(event, null));
      });
    });
    const foot = el("tr", {}, null, table);
    el("th", {}, "layer \\ head", foot);
    for (let h = 0; h < heads; h++) el("th", {}, String(h), foot);
  }
  const labels = Object.keys(DATA.studies);
  if (labels.length) {
    el("h2", {}, `ablation: P(${DATA.target}) at the last position (exact runs)`, VIEW);
    const table = el("table", {class: "cells", id: "ablation"}, null, VIEW);
    const head = el("tr", {}, null, table);
    el("th", {}, "run", head);
    for (const label of labels) el("th", {}, label, head);
    const runs = [];
    for (const label of labels) for (const run of Object.keys(DATA.studies[label])) if (!runs.includes(run)) runs.push(run);
    for (const run of runs) {
      const tr = el("tr", {}, null, table);
      el("th", {}, run, tr);
      for (const label of labels) {
        const p = DATA.studies[label][run];
        el("td", {class: "tok", style: p === undefined ? "" : `background:${blues(p)};color:${textOn(p)}`},
          p === undefined ? "-" : fmt(p, 3), tr);
      }
    }
  }
  ready();
})();
